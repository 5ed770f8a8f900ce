"""Rows of every replica, gathered with their gradient: what in-batch negatives across replicas
need (`ai.graphcore::ReplicatedAllGather` in a graph; `popbert.tasks.embedding`).

Forward, each replica's [rows, ...] tensor is concatenated along the first axis in rank order
(every replica sees the same gathered tensor). Backward, each replica receives the sum over all
replicas of the gradient reaching its own rows: replica r's loss depends on every replica's
rows. With gradients mean-reduced over the replicas afterwards (`popbert.distributed.buffers`),
N replicas of B rows then train exactly as one process of N·B rows.

Outside torch.distributed, or with one replica, it is the identity.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor


def _world() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # type: ignore[override]
        world, rank = dist.get_world_size(), dist.get_rank()
        # Replicas may hold different numbers of rows (a short last batch): pad to the most.
        count = torch.tensor([x.shape[0]], dtype=torch.int64, device=x.device)
        counts = [torch.zeros_like(count) for _ in range(world)]
        dist.all_gather(counts, count)
        rows = [int(c.item()) for c in counts]
        most = max(rows)
        padded = x.new_zeros((most, *x.shape[1:]))
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(parts, padded.contiguous())
        ctx.rows, ctx.rank = rows, rank
        return torch.cat([part[:n] for part, n in zip(parts, rows)])

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:  # type: ignore[override]
        total = grad.contiguous().clone()
        dist.all_reduce(total, op=dist.ReduceOp.SUM)
        start = sum(ctx.rows[:ctx.rank])
        return total[start:start + ctx.rows[ctx.rank]]


def gather_rows(x: Tensor) -> Tensor:
    """Every replica's rows of `x`, in rank order, keeping the gradient (the identity with one
    replica)."""
    return x if _world() == 1 else _GatherRows.apply(x)


__all__ = ["gather_rows"]
