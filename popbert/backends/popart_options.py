"""popbert's execution options in PopART's terms: ``popart.SessionOptions``, ``popart.DataFlow``
and the device a session runs on.

Each function takes the ``popart`` module as its first argument, so the same code serves
Graphcore's SDK and the contract test's stand-in, and importing this module never needs the SDK.
Only what differs from PopART's defaults is set; the translation table is in docs/design.md,
section "popbert.backends.popart_options".
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from popbert.backends import BackendUnavailable
from popbert.errors import one_line

if TYPE_CHECKING:
    from popbert.runtime.options import SessionOptions

log = logging.getLogger(__name__)

__all__ = ["DEVICES", "IPU_MODEL_TILES", "PopartOptions", "acquire_device", "data_flow",
           "device_ipus", "session_options"]

DEVICES = ("ipu", "ipu-model")
IPU_MODEL_TILES = 1472  # tiles of a Mk2 IPU (GC200)


@dataclass
class PopartOptions:
    """What only the PopART backend needs to know, beyond popbert's ``SessionOptions``.

    ``device``: ``"ipu"`` (IPUs, acquired with ``DeviceManager().acquireAvailableDevice``) or
    ``"ipu-model"`` (the IPU Model simulator shipped in the SDK, ``tiles_per_ipu`` tiles per IPU).
    ``engine_cache``: a directory for compiled engines (PopART itself also honours
    ``$POPART_CACHE_DIR``). ``optimizer_state_offchip``: keep the optimizer state in streaming
    memory. ``session_options``: further ``popart.SessionOptions`` attributes, set verbatim after
    the translation (e.g. ``{"enableOutlining": False}``).
    """

    device: str = "ipu"
    tiles_per_ipu: int = IPU_MODEL_TILES
    engine_cache: str | Path | None = None
    optimizer_state_offchip: bool = False
    session_options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise ValueError(f"PopartOptions.device must be one of {', '.join(DEVICES)}, got "
                             f"{self.device!r}")
        if int(self.tiles_per_ipu) < 1:
            raise ValueError(f"PopartOptions.tiles_per_ipu must be >= 1, got "
                             f"{self.tiles_per_ipu}")


def session_options(popart: ModuleType, options: SessionOptions,
                    popart_options: PopartOptions, *, manual_placement: bool,
                    stochastic_rounding: bool) -> Any:
    """``popart.SessionOptions`` for ``options`` (the table: docs/design.md, section
    "popbert.backends.popart_options").

    ``manual_placement``: the graph places its ops with ``__ipu_number``;
    ``stochastic_rounding``: the optimizer rounds weight updates stochastically.
    """
    opts = popart.SessionOptions()
    replicas, accumulation = options.replication_factor, options.gradient_accumulation
    if manual_placement:
        opts.virtualGraphMode = popart.VirtualGraphMode.Manual
    elif options.pipeline:
        raise ValueError("pipelining on PopART needs a graph placed with __ipu_number / "
                         "__pipeline_stage annotations (model.layers_per_ipu)")
    if options.pipeline:
        opts.enablePipelining = True
    if options.recompute:
        opts.autoRecomputation = (popart.RecomputationType.Pipeline if options.pipeline
                                  else popart.RecomputationType.RecomputeAll)
    if replicas > 1:
        opts.enableReplicatedGraphs = True
        opts.replicatedGraphCount = replicas
    if accumulation > 1:
        opts.enableGradientAccumulation = True
        opts.accumulationFactor = accumulation
    if replicas > 1 or accumulation > 1:
        opts.accumulationAndReplicationReductionType = popart.ReductionType.Mean
    if stochastic_rounding:
        opts.enableStochasticRounding = True
    storage = (popart.TensorStorage.OffChip if popart_options.optimizer_state_offchip
               else popart.TensorStorage.OnChip)
    if options.replicated_tensor_sharding and replicas > 1:
        # Shard every optimizer-state tensor with at least one element per replica (the torch
        # backend's RTS shards them all).
        opts.optimizerStateTensorLocationSettings = popart.TensorLocationSettings(
            popart.TensorLocation(storage, popart.ReplicatedTensorSharding.On),
            minElementsForReplicatedTensorSharding=replicas)
    else:
        if options.replicated_tensor_sharding:
            log.warning("replicated_tensor_sharding with one replica shards nothing")
        if popart_options.optimizer_state_offchip:
            opts.optimizerStateTensorLocationSettings = popart.TensorLocationSettings(
                popart.TensorLocation(storage, popart.ReplicatedTensorSharding.Off))
    if popart_options.engine_cache is not None:
        opts.enableEngineCaching = True
        opts.cachePath = str(popart_options.engine_cache)
    for name, value in popart_options.session_options.items():
        setattr(opts, name, value)
    return opts


def data_flow(popart: ModuleType, device_iterations: int, anchors: Iterable[str]) -> Any:
    """``popart.DataFlow``: ``device_iterations`` batches per step, every anchor returned for
    every micro-batch (``AnchorReturnType("ALL")``), so a run gives each step's mean as the
    torch backend does."""
    return popart.DataFlow(device_iterations,
                           {name: popart.AnchorReturnType("ALL") for name in anchors})


def device_ipus(replicas: int, ipus_per_replica: int) -> int:
    """IPUs to acquire: replicas × the graph's IPUs, rounded up to a power of two (IPU systems
    hand out power-of-two partitions)."""
    wanted = max(1, replicas) * max(1, ipus_per_replica)
    return 1 << (wanted - 1).bit_length()


def acquire_device(popart: ModuleType, popart_options: PopartOptions, num_ipus: int) -> Any:
    """The ``popart.DeviceInfo`` the session runs on; no free IPUs is a one-line
    :class:`~popbert.backends.BackendUnavailable`."""
    manager = popart.DeviceManager()
    if popart_options.device == "ipu-model":
        return manager.createIpuModelDevice({"numIPUs": num_ipus,
                                             "tilesPerIPU": int(popart_options.tiles_per_ipu)})
    try:
        device = manager.acquireAvailableDevice(num_ipus)
    except Exception as error:  # popart.popart_exception: no such partition, none free, ...
        raise BackendUnavailable(f"could not acquire {num_ipus} IPU(s): "
                                 f"{one_line(error, 300)}") from None
    if device is None:
        raise BackendUnavailable(f"could not acquire {num_ipus} IPU(s): none free (see "
                                 "gc-monitor), or fewer in this partition")
    return device
