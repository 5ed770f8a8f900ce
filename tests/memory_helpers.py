"""Memory measurements of the recomputation, sharding and plan tests and of the memory
benchmarks (benchmarks/scaling.py, benchmarks/plan_accuracy.py).

:class:`PeakMemory`: peak memory of a block on any device. On CUDA it reads the allocator's
statistics; on CPU it tracks every tensor storage created inside the block until it is freed (a
dispatch mode), so CPU-only machines can measure the activation memory that recomputation
saves. :func:`optimizer_state_bytes` and :func:`gradient_shard_bytes`: what a replica's
optimizer holds.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from popbert.distributed.sharded import ShardedOptimizer


class _CpuTracker(TorchDispatchMode):
    """Counts bytes of live storages created by ops inside the mode (each storage once)."""

    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._live: dict[int, int] = {}

    def _release(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        out = func(*args, **(kwargs or {}))
        values = tree_flatten(out)[0]
        # A sparse gradient (popbert.lowering.embedding) owns its indices' and values' storages.
        values = [part for value in values for part in (
            (value._indices(), value._values()) if isinstance(value, torch.Tensor)
            and value.is_sparse else (value,))]
        for value in values:
            if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                storage = value.untyped_storage()
                key = id(storage)
                if key in self._live:
                    continue
                size = storage.nbytes()
                self._live[key] = size
                self.current += size
                self.peak = max(self.peak, self.current)
                weakref.finalize(storage, self._release, key)
        return out


class PeakMemory:
    """``with PeakMemory(device) as m: ...`` then ``m.peak_bytes``: peak memory of the block.

    CPU: bytes of tensors created inside the block and alive at the same time (activations,
    gradients, temporaries; what existed before the block is not counted). Runs ops through a
    dispatch mode, so it is for measurements, not for production steps. CUDA: the allocator's
    peak above what was allocated when the block started.
    """

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        self.peak_bytes = 0
        self._mode: _CpuTracker | None = None
        self._start = 0

    def __enter__(self) -> PeakMemory:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            self._mode = _CpuTracker()
            self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak_bytes = torch.cuda.max_memory_allocated(self.device) - self._start
        elif self._mode is not None:
            self._mode.__exit__(*exc)
            self.peak_bytes = self._mode.peak
            self._mode = None


def optimizer_state_bytes(optimizer: object) -> int:
    """Bytes of FP32 optimizer state (Adam moments) this replica holds: its 1/N share of a
    :class:`~popbert.distributed.sharded.ShardedOptimizer`'s."""
    if isinstance(optimizer, ShardedOptimizer):
        return sum(2 * s.shard_size * 4 for s in optimizer.shards)
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                total += value.numel() * value.element_size()
    return total


def gradient_shard_bytes(optimizer: ShardedOptimizer) -> int:
    """Bytes of this replica's FP32 accumulated-gradient shard."""
    return sum(s.shard_size * 4 for s in optimizer.shards)
