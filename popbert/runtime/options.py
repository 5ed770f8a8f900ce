"""Session options: what the torch backend honours of PopART's ``SessionOptions``.

:class:`SessionOptions` is checked once, when it is made, so a bad value fails where it was
written rather than in the middle of a session's set-up. :meth:`SessionOptions.from_config` is the
one function that turns a run config into options, including which devices this replica uses.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from popbert.backends import BACKENDS
from popbert.distributed.replicas import devices_per_replica
from popbert.dtypes import FLOAT_FORMATS
from popbert.errors import ConfigError
from popbert.runtime.devices import available_devices, resolve_device
from popbert.runtime.schedules import SCHEDULES

if TYPE_CHECKING:
    from popbert.config import RunConfig
    from popbert.distributed.replicas import Replicas

log = logging.getLogger(__name__)

__all__ = ["SessionOptions"]


@dataclass
class SessionOptions:
    """Execution options of a session (validated on construction; see :meth:`validate`).

    ``device`` is resolved by :func:`popbert.runtime.devices.resolve_device` when the session
    starts ("auto": CUDA when present). ``weight_dtype`` / ``compute_dtype`` are formats of
    :data:`popbert.dtypes.FLOAT_FORMATS`. ``backend``: who runs the graph, ``"torch"`` (the
    lowering) or ``"popart"`` (Graphcore's PopART on IPUs, :mod:`popbert.backends.popart`, which
    reads the other options in its own terms and ignores ``device``).
    """

    device: str = "cpu"
    gradient_accumulation: int = 1
    device_iterations: int = 1
    replication_factor: int = 1
    weight_dtype: str = "float32"
    compute_dtype: str = "float32"
    compile: bool = False
    seed: int | None = None
    replicated_tensor_sharding: bool = False
    pipeline: bool = False
    pipeline_schedule: str = "1f1b"  # or "gpipe"
    # Device of each `__ipu_number` when pipelining (index = ipu); None: all on `device`.
    pipeline_devices: list[str] | None = None
    # Worker thread per device when pipelining: None = when the stages span several devices.
    pipeline_threads: bool | None = None
    recompute: bool = False
    backend: str = "torch"  # last: positional construction keeps its meaning

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first option out of range (called on construction;
        call it again after changing fields by hand)."""
        for key in ("gradient_accumulation", "device_iterations", "replication_factor"):
            if int(getattr(self, key)) < 1:
                raise ValueError(f"SessionOptions.{key} must be >= 1, got {getattr(self, key)}")
        for key in ("weight_dtype", "compute_dtype"):
            if getattr(self, key) not in FLOAT_FORMATS:
                raise ValueError(f"SessionOptions.{key} must be one of {list(FLOAT_FORMATS)}, "
                                 f"got {getattr(self, key)!r}")
        if self.backend not in BACKENDS:
            raise ValueError(f"SessionOptions.backend must be one of {list(BACKENDS)}, "
                             f"got {self.backend!r}")
        if self.pipeline_schedule not in SCHEDULES:
            raise ValueError(f"SessionOptions.pipeline_schedule must be one of {SCHEDULES}, "
                             f"got {self.pipeline_schedule!r}")

    @classmethod
    def from_config(cls, cfg: RunConfig, replicas: Replicas | None = None) -> SessionOptions:
        """The session options of ``cfg`` for this replica.

        On CUDA a replica spans ``devices_per_replica(cfg)`` GPUs starting at
        ``LOCAL_RANK × span`` (``replicas.local_rank``; 0 without replicas); a pipeline puts its
        ``__ipu_number`` i on the i-th of them, or every stage on the first GPU (with a warning)
        when this replica sees fewer. A device that is not there is a ConfigError.
        """
        e = cfg.execution
        if e.backend != "torch":  # PopART places the graph on its own devices
            return cls(**cls._execution_fields(cfg))
        resolved = resolve_device(e.device)
        device, pipeline_devices = str(resolved), None
        if resolved.type == "cuda":
            local_rank = replicas.local_rank if replicas is not None else 0
            span = devices_per_replica(cfg)
            first = (resolved.index or 0) + local_rank * span
            available = torch.cuda.device_count()
            if first >= available:
                raise ConfigError(
                    f"execution.device is {e.device!r} but replica {local_rank} on this node "
                    f"needs cuda:{first} (available: {available_devices()}): start fewer "
                    "processes per node")
            device = f"cuda:{first}"
            if e.pipeline:
                if first + span <= available:
                    pipeline_devices = [f"cuda:{first + i}" for i in range(span)]
                else:
                    log.warning("the pipeline spans %d devices but only %d GPU(s) are visible "
                                "to this replica: every stage runs on %s (the schedule, not a "
                                "speed-up)", span, available - first, device)
        return cls(device=device, pipeline_devices=pipeline_devices,
                   **cls._execution_fields(cfg))

    @staticmethod
    def _execution_fields(cfg: RunConfig) -> dict:
        """The options read straight from ``cfg.execution`` (every backend's)."""
        e = cfg.execution
        return dict(backend=e.backend, gradient_accumulation=e.gradient_accumulation,
                    device_iterations=e.device_iterations, replication_factor=e.replicas,
                    weight_dtype=e.weight_dtype, compute_dtype=e.compute_dtype,
                    compile=e.compile, replicated_tensor_sharding=e.replicated_tensor_sharding,
                    pipeline=e.pipeline, pipeline_schedule=e.pipeline_schedule,
                    recompute=e.recompute)
