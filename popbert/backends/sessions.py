"""`make_session`: the one place a training backend is chosen (`SessionOptions.backend`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import onnx

from popbert.backends import BACKENDS
from popbert.backends.popart import PopartTrainingSession
from popbert.distributed import Replicas
from popbert.optimizers import LossScaler
from popbert.runtime.inputs import InputChecker
from popbert.runtime.options import SessionOptions
from popbert.runtime.protocol import OptimizerFactory, Session
from popbert.runtime.session import TrainingSession, load_model


def make_session(model: onnx.ModelProto | bytes | str | Path, loss: str,
                 optimizer: OptimizerFactory, options: SessionOptions | None = None, *,
                 loss_scaler: LossScaler | None = None, replicas: Replicas | None = None,
                 backend: str | None = None, **backend_options: Any) -> Session:
    """A training session for `model` on `backend` (None: `options.backend`, else torch).

    torch: `TrainingSession`; popart: `PopartTrainingSession` from the same arguments plus
    `backend_options` (`popart_options=`, `popart=`), or a one-line
    `popbert.backends.BackendUnavailable` where Graphcore's SDK is not importable.
    """
    options = options or SessionOptions()
    chosen = backend or options.backend
    if chosen not in BACKENDS:
        raise ValueError(f"unknown backend {chosen!r}; expected one of {', '.join(BACKENDS)}")
    if chosen != options.backend:
        options = dataclasses.replace(options, backend=chosen)
    if chosen == "torch":
        if backend_options:
            raise TypeError(f"the torch backend takes no backend options, got "
                            f"{sorted(backend_options)}")
        return TrainingSession(model, loss, optimizer, options, loss_scaler=loss_scaler,
                               replicas=replicas)
    return PopartTrainingSession(load_model(model), loss, optimizer, options,
                                 loss_scaler=loss_scaler, replicas=replicas,
                                 input_checker=InputChecker, **backend_options)


__all__ = ["make_session"]
