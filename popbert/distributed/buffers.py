"""Flat parameter and gradient buffers: one tensor per (device, dtype) instead of one per weight.

Collectives on hundreds of small tensors are slow; on one flat buffer they are one call. A
:class:`FlatSpace` lays the parameters of one device and dtype out back to back (aligned, padded).

Without sharding (:class:`GradientBuffer`) each parameter's ``.grad`` is a view into one flat
buffer, all-reduced once per optimizer step, and every replica runs the ordinary optimizer on the
whole model (identical state everywhere). Replicated tensor sharding
(:mod:`popbert.distributed.sharded`) flattens the weights themselves as well
(:func:`flatten_parameters`), so each replica can update and all-gather its slice in place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from popbert.distributed.replicas import Replicas

ALIGN = 16  # elements between parameters in flat buffers are aligned to

__all__ = ["ALIGN", "FlatSpace", "GradientBuffer", "attach_grad_views", "broadcast_parameters",
           "flat_spaces", "flatten_parameters"]


@dataclass
class FlatSpace:
    """Parameters of one (device, dtype), laid out back to back in one flat buffer."""

    device: torch.device
    dtype: torch.dtype
    params: list[torch.nn.Parameter]
    offsets: list[int]
    numel: int
    padded: int = 0
    grads: Tensor = field(default_factory=lambda: torch.empty(0))


def flat_spaces(params: Sequence[torch.nn.Parameter], multiple: int) -> list[FlatSpace]:
    """Group ``params`` by (device, dtype) and lay each group out back to back: offsets aligned
    to :data:`ALIGN` elements, the total padded to a multiple of ``multiple`` (the replica
    count, so a sharded buffer splits evenly)."""
    by_key: dict[tuple[str, torch.dtype], FlatSpace] = {}
    for p in params:
        key = (str(p.device), p.dtype)
        space = by_key.get(key)
        if space is None:
            space = by_key[key] = FlatSpace(p.device, p.dtype, [], [], 0)
        space.params.append(p)
        # 64-byte aligned, like separate allocations: kernels vectorise (and round) the same.
        space.numel = -(-space.numel // ALIGN) * ALIGN
        space.offsets.append(space.numel)
        space.numel += p.numel()
    for space in by_key.values():
        space.padded = -(-space.numel // multiple) * multiple
    return list(by_key.values())


def attach_grad_views(space: FlatSpace) -> None:
    """Point each parameter's ``.grad`` at its slice of the space's flat gradient buffer."""
    for p, offset in zip(space.params, space.offsets):
        view = space.grads[offset:offset + p.numel()].view(p.shape)
        if p.grad is None or p.grad.data_ptr() != view.data_ptr():
            p.grad = view


def flatten_parameters(space: FlatSpace) -> Tensor:
    """Move the space's parameters into one flat buffer; each ``p.data`` becomes a view of it."""
    flat = torch.zeros(space.padded, dtype=space.dtype, device=space.device)
    for p, offset in zip(space.params, space.offsets):
        view = flat[offset:offset + p.numel()].view(p.shape)
        view.copy_(p.detach())
        p.data = view
    return flat


def broadcast_parameters(params: Sequence[torch.nn.Parameter], replicas: Replicas) -> None:
    """Make every replica start from replica 0's weights (one broadcast per device/dtype)."""
    if not replicas.distributed:
        return
    with torch.no_grad():
        for space in flat_spaces(params, 1):
            flat = torch.zeros(space.numel, dtype=space.dtype, device=space.device)
            views = [flat[offset:offset + p.numel()].view(p.shape)
                     for p, offset in zip(space.params, space.offsets)]
            torch._foreach_copy_(views, [p.detach() for p in space.params])
            replicas.broadcast_(flat)
            torch._foreach_copy_([p.detach() for p in space.params], views)


class GradientBuffer:
    """Data parallelism without sharding: one flat gradient per device/dtype, mean-all-reduced.

    Each parameter's ``.grad`` is a view into the flat buffer, so backward accumulates straight
    into it and one all-reduce per step (not one per tensor) synchronises the replicas.
    """

    def __init__(self, params: Sequence[torch.nn.Parameter], replicas: Replicas):
        self.replicas = replicas
        self.spaces = flat_spaces(params, 1)
        for space in self.spaces:
            space.grads = torch.zeros(space.numel, dtype=space.dtype, device=space.device)
            attach_grad_views(space)

    def zero_(self) -> None:
        """Start a step: zero the flat buffers (and re-attach views a caller may have dropped)."""
        for space in self.spaces:
            space.grads.zero_()
            attach_grad_views(space)

    def all_reduce_mean_(self) -> None:
        """Mean of the gradients over the replicas, in place."""
        for space in self.spaces:
            self.replicas.all_reduce_(space.grads)
            space.grads.div_(self.replicas.size)
