"""`Session`: what every training backend offers, so the Trainer and the loop need no other.

The torch session (`popbert.runtime.session.TrainingSession`) and the PopART session
(`popbert.backends.popart.PopartTrainingSession`) both implement it; `popbert.backends.make_session`
picks one from `SessionOptions.backend`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
import torch

if TYPE_CHECKING:
    from popbert.distributed import Replicas
    from popbert.optimizers import LossScaler
    from popbert.runtime.options import SessionOptions

Batch = Mapping[str, torch.Tensor | np.ndarray]
NamedParameters = list[tuple[str, torch.nn.Parameter]]
OptimizerFactory = Callable[[NamedParameters], torch.optim.Optimizer]


@runtime_checkable
class Session(Protocol):
    """A graph being trained: `run` performs optimizer steps, the rest reads or restores state.

    `run(batch)` takes `micro_batches_per_run()` micro-batches stacked on the batch axis and
    returns each output per optimizer step (first axis: steps); `run(batch, micro_batches=k)`
    gives each step k micro-batches instead of `gradient_accumulation` (batch-size warmup; a
    backend that cannot refuses it); `evaluate(batch)` runs one
    micro-batch without dropout or an update; `state_dict()` is everything a resumed run needs.
    """

    options: SessionOptions
    loss_name: str
    step: int
    replicas: Replicas
    loss_scaler: LossScaler | None
    optimizer: torch.optim.Optimizer
    named_parameters: NamedParameters
    step_hook: Callable[[int], None] | None
    device: torch.device

    @property
    def sharded(self) -> bool: ...

    def micro_batches_per_run(self) -> int: ...

    def run(self, batch: Batch, micro_batches: int | None = None) -> dict[str, torch.Tensor]: ...

    def evaluate(self, batch: Batch) -> dict[str, torch.Tensor]: ...

    def weights(self) -> dict[str, torch.Tensor]: ...

    def load_weights(self, weights: Mapping[str, Any], strict: bool = True) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


__all__ = ["Batch", "NamedParameters", "OptimizerFactory", "Session"]
