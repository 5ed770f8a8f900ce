"""Session options: what the torch backend honours of PopART's ``SessionOptions``.

Most options are keys of the config's ``execution`` section under the same name (see
``_FROM_EXECUTION``): :meth:`SessionOptions.from_config` copies them, and :meth:`validate` checks
them by those keys' own rules, so a range or a choice is written once, on ``ExecutionConfig``.
Options are checked when made, so a bad value fails where it was written.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from popbert.config.sections import ExecutionConfig
from popbert.distributed.replicas import devices_per_replica
from popbert.errors import ConfigError
from popbert.rules import MUST_BE, rule_of
from popbert.runtime.devices import available_devices, resolve_device

if TYPE_CHECKING:
    from popbert.config import RunConfig
    from popbert.distributed.replicas import Replicas

log = logging.getLogger(__name__)

__all__ = ["SessionOptions"]

# Option -> the `execution` key it is (the same name but for replicas). `device` is not here:
# the options hold the resolved device of this replica ("cuda:1"), not the config's choice.
_FROM_EXECUTION = {"replication_factor": "replicas", **{name: name for name in (
    "backend", "gradient_accumulation", "device_iterations", "weight_dtype", "compute_dtype",
    "compile", "replicated_tensor_sharding", "pipeline", "pipeline_schedule", "recompute",
    "trim_padding", "gradient_cache_rows")}}


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
    backend: str = "torch"  # after the older options: positional construction keeps its meaning
    # Run each micro-batch cut to its longest row (the graph's sequence axis must be symbolic).
    trim_padding: bool = False
    # Rows per pass of a micro-batch cut at its `embedding` output (`popbert.runtime.texts`);
    # None: the whole micro-batch in one pass.
    gradient_cache_rows: int | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ValueError naming the first option that breaks its ``execution`` key's rule
        (called on construction; call it again after changing fields by hand)."""
        for option, key in _FROM_EXECUTION.items():
            rule, value = rule_of(ExecutionConfig, key), getattr(self, option)
            if rule is not None and not rule.allows(value):
                raise ValueError(rule.message(f"SessionOptions.{option}", value, form=MUST_BE))

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
    def _execution_fields(cfg: RunConfig) -> dict[str, Any]:
        """The options read straight from ``cfg.execution`` (every backend's)."""
        return {option: getattr(cfg.execution, key) for option, key in _FROM_EXECUTION.items()}
