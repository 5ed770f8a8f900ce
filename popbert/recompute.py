"""Recomputation: the graph's checkpoint annotations, and a meter for the memory they save.

`Builder.checkpointOutput` marks tensors to keep for the backward pass with PopART's attribute
``__recompute_output_in_backward_pass = 1`` on an Identity node (BERT: every layer output except
each device's last, see `builders/placement.py`). The torch backend turns the stretches between
checkpoints into recompute regions (:class:`popbert.pipeline.Program`): a recomputed region runs
under ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, so dropout masks repeat
exactly), keeps only its inputs, and rebuilds its activations during the backward pass. Results
are the same; peak activation memory falls by roughly the activations of all but one region, for
one extra forward pass of the recomputed regions (about a third more compute per step).

:class:`PeakMemory` measures it on any device: on CUDA from the allocator's statistics, on CPU by
tracking every tensor storage created inside the block until it is freed.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.fx as fx
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

RECOMPUTE = "__recompute_output_in_backward_pass"
CHECKPOINT = 1  # PopART's RecomputeType.Checkpoint
RECOMPUTE_OUTPUT = 2  # RecomputeType.Recompute

__all__ = ["CHECKPOINT", "RECOMPUTE", "PeakMemory", "annotation", "checkpoint_count",
           "is_checkpoint"]


def annotation(node: fx.Node, key: str) -> Any:
    """The ONNX annotation ``key`` (``__pipeline_stage``, ...) of an fx node, or None."""
    meta = node.meta.get("onnx") or {}
    return (meta.get("attributes") or {}).get(key)


def is_checkpoint(node: fx.Node) -> bool:
    """Whether the node's output is a recomputation checkpoint (kept for backward)."""
    value = annotation(node, RECOMPUTE)
    return value is not None and int(value) == CHECKPOINT


def checkpoint_count(module: fx.GraphModule) -> int:
    """Number of checkpoint nodes in a lowered graph."""
    return sum(is_checkpoint(n) for n in module.graph.nodes)


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
        for value in tree_flatten(out)[0]:
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
