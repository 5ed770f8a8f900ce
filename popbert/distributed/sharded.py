"""Replicated tensor sharding (RTS): optimizer state and accumulated gradient split over replicas.

The trainable weights live in one flat buffer per (device, dtype), padded to a multiple of N
(:mod:`popbert.distributed.buffers`). Replica r owns the r-th 1/N slice. After every micro-batch
its flat gradient is reduce-scattered and added to an FP32 shard accumulator, so each replica holds
1/N of the accumulated gradient and 1/N of the FP32 Adam moments. The update runs on the shard with
:mod:`popbert.optimizers.steps`; LAMB's per-tensor norms are partial sums over the pieces of
each tensor that the shard holds, completed by one small all-reduce. The updated shard is rounded
to the weight dtype (stochastically for half weights) and all-gathered into the flat weight
buffer, in the weight dtype. Stochastic rounding hashes (seed, step, tensor, element index within
the tensor), so a replica rounds its slice exactly as the unsharded optimizer rounds those
elements. Checkpoints hold the gathered, unsharded optimizer state in the
ordinary optimizer's format, so they load with or without RTS and on any replica count.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch
from torch import Tensor

from popbert.distributed.buffers import (
    FlatSpace,
    attach_grad_views,
    flat_spaces,
    flatten_parameters,
)
from popbert.distributed.replicas import Replicas
from popbert.dtypes import rounds_stochastically
from popbert.optimizers.functional import clip_coefficient, per_tensor_sq_norms
from popbert.optimizers.optimizer import AdamFamilyOptimizer
from popbert.optimizers.steps import adamw_step_, lamb_step_
from popbert.optimizers.stochastic_rounding import hashed_round_fn

log = logging.getLogger(__name__)

__all__ = ["ShardedOptimizer"]


@dataclass
class _Piece:
    """The part of parameter ``index`` that lies in this replica's shard of a space."""

    index: int
    param_offset: int
    length: int
    shard_offset: int
    shape: tuple[int, ...]  # the parameter's
    whole: bool  # the piece is the whole parameter


@dataclass
class _ShardSpace:
    space: FlatSpace
    weights: Tensor  # the flat weight buffer (weight dtype), parameters are views of it
    shard_size: int
    pieces: list[_Piece]
    exp_avg: Tensor
    exp_avg_sq: Tensor
    grad_acc: Tensor  # FP32 accumulated gradient shard (sum over replicas, not yet / N)
    scatter: Tensor  # reduce-scatter output in the gradient dtype

    def shard(self, rank: int) -> Tensor:
        return self.weights[rank * self.shard_size:(rank + 1) * self.shard_size]

    def view(self, flat_shard: Tensor, piece: _Piece) -> Tensor:
        """A piece of a shard-sized tensor; shaped like its parameter when it holds all of it
        (so reductions over it round exactly as the unsharded optimizer's do)."""
        part = flat_shard[piece.shard_offset:piece.shard_offset + piece.length]
        return part.view(piece.shape) if piece.whole else part


class ShardedOptimizer:
    """LAMB / AdamW with optimizer state and accumulated gradient sharded over the replicas.

    Wraps a :class:`~popbert.optimizers.AdamFamilyOptimizer` that only supplies the parameter
    groups and hyper-parameters (it never allocates state), so learning-rate schedules keep
    setting ``param_groups[i]["lr"]`` and checkpoints keep its ``state_dict`` format.
    Call :meth:`accumulate` after each backward pass, then :meth:`step`.
    """

    def __init__(self, base: AdamFamilyOptimizer, replicas: Replicas):
        if not isinstance(base, AdamFamilyOptimizer):
            raise TypeError("replicated tensor sharding needs popbert's Lamb or AdamW optimizer, "
                            f"got {type(base).__name__}")
        self.base = base
        self.replicas = replicas
        self.param_groups = base.param_groups
        self.params: list[torch.nn.Parameter] = [p for g in base.param_groups for p in g["params"]]
        self.group_of: list[int] = [i for i, g in enumerate(base.param_groups)
                                    for _ in g["params"]]
        self.steps: list[int] = [0] * len(self.params)
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self._accumulated = 0
        rank, size = replicas.rank, replicas.size
        self.shards: list[_ShardSpace] = []
        for space in flat_spaces(self.params, size):
            weights = flatten_parameters(space)
            shard_size = space.padded // size
            lo, hi = rank * shard_size, (rank + 1) * shard_size
            pieces = []
            for p, offset in zip(space.params, space.offsets):
                start, end = max(lo, offset), min(hi, offset + p.numel())
                if start < end:
                    pieces.append(_Piece(self._index[id(p)], start - offset, end - start,
                                         start - lo, tuple(p.shape),
                                         end - start == p.numel()))
            space.grads = torch.zeros(space.padded, dtype=space.dtype, device=space.device)
            attach_grad_views(space)
            fp32 = dict(dtype=torch.float32, device=space.device)
            self.shards.append(_ShardSpace(
                space, weights, shard_size, pieces, torch.zeros(shard_size, **fp32),
                torch.zeros(shard_size, **fp32), torch.zeros(shard_size, **fp32),
                torch.zeros(shard_size if size > 1 else 0, dtype=space.dtype,
                            device=space.device)))
        log.info("replicated tensor sharding: replica %d holds %d of %d optimizer values",
                 rank, sum(s.shard_size for s in self.shards),
                 sum(s.space.numel for s in self.shards))

    # -- bookkeeping ---------------------------------------------------------------------------
    @property
    def max_grad_norm(self) -> float | None:
        return self.base.max_grad_norm

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the flat gradient buffers (the views stay attached; ``set_to_none`` ignored)."""
        del set_to_none
        for shard in self.shards:
            shard.space.grads.zero_()
            attach_grad_views(shard.space)

    # -- gradients -----------------------------------------------------------------------------
    @torch.no_grad()
    def accumulate(self) -> None:
        """Reduce-scatter the gradients of the last backward pass(es) into the FP32 shard."""
        for shard in self.shards:
            space = shard.space
            if self.replicas.size == 1:
                part = space.grads
            else:
                part = self.replicas.reduce_scatter(shard.scatter, space.grads)
            if self._accumulated == 0:
                shard.grad_acc.copy_(part)
            else:
                shard.grad_acc.add_(part)
            space.grads.zero_()
        self._accumulated += 1

    def found_inf(self) -> bool:
        """Whether any replica's gradient shard holds inf/NaN (one scalar all-reduce)."""
        bad = torch.zeros(1, dtype=torch.float32, device=self._norm_device())
        for shard in self.shards:
            bad += (~torch.isfinite(shard.grad_acc)).sum().to(bad.device, torch.float32)
        return bool(self.replicas.all_reduce_(bad).item() > 0)

    # -- the update ----------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Any = None, *, grad_scale: float | None = None) -> None:
        """One optimizer step on this replica's shard, then all-gather the weights.

        The arithmetic is the optimizer package's own (``steps.lamb_step_`` /
        ``adamw_step_``) on this replica's pieces of each tensor; LAMB's squared norms are
        completed by an all-reduce of one small ``[2, tensors]`` vector per parameter group.
        """
        if closure is not None:
            raise ValueError("ShardedOptimizer.step does not take a closure")
        if self._accumulated == 0:
            raise RuntimeError("ShardedOptimizer.step without accumulate(): no gradients")
        if grad_scale is not None and not grad_scale > 0:
            raise ValueError(f"grad_scale must be positive, got {grad_scale}")
        # grad_acc holds the sum over replicas: the mean is folded into the gradient factor.
        factor = 1.0 / self.replicas.size / (1.0 if grad_scale is None else grad_scale)
        if self.max_grad_norm is not None:
            # Summed as the unsharded optimizer sums them (per device in FP32), then over
            # the replicas.
            partial = sum(float(per_tensor_sq_norms(
                [shard.view(shard.grad_acc, p) for p in shard.pieces]).sum())
                for shard in self.shards)
            sq = torch.tensor([partial], dtype=torch.float64, device=self._norm_device())
            total = float(self.replicas.all_reduce_(sq).item()) * factor**2
            factor *= clip_coefficient(total, self.max_grad_norm)
        for i in range(len(self.params)):
            self.steps[i] += 1

        for shard in self.shards:
            space = shard.space
            mine = shard.shard(self.replicas.rank)
            device = space.device

            def reduce(sq: Tensor, device: torch.device = device) -> Tensor:
                return self.replicas.all_reduce_(sq.to(device)).to(sq.device)

            for group_index, group in enumerate(self.param_groups):
                # Every replica calls every trust-ratio group, holding pieces or not: the norm
                # all-reduce inside is a collective.
                pieces = [p for p in shard.pieces if self.group_of[p.index] == group_index]
                if not pieces and not group["trust_ratio"]:
                    continue
                common = dict(
                    lr=group["lr"], beta1=group["betas"][0], beta2=group["betas"][1],
                    eps=group["eps"], weight_decay=group["weight_decay"],
                    bias_correction=group["bias_correction"], grad_factor=factor,
                    tile_numel=self.base.tile_numel_for(device),
                    round_fn=self._round_fn(group, space, pieces))
                lists = ([shard.view(mine, p) for p in pieces],
                         [shard.view(shard.grad_acc, p) for p in pieces],
                         [shard.view(shard.exp_avg, p) for p in pieces],
                         [shard.view(shard.exp_avg_sq, p) for p in pieces],
                         [self.steps[p.index] for p in pieces])
                if group["trust_ratio"]:
                    lamb_step_(*lists, max_trust_ratio=group["max_trust_ratio"],
                               max_weight_norm=group["max_weight_norm"],
                               tensor_index=[p.index for p in pieces],
                               num_tensors=len(self.params), reduce_sq_norms=reduce, **common)
                else:
                    adamw_step_(*lists, **common)
            self.replicas.all_gather(shard.weights, mine.clone())
        self._accumulated = 0

    def _round_fn(self, group: dict[str, Any], space: FlatSpace, pieces: list[_Piece]) -> Any:
        """Rounding of updated half weights: stochastic with the unsharded optimizer's bits
        (same seed, step and tensor ids; element indices offset to where each piece starts)."""
        if (space.dtype == torch.float32
                or not rounds_stochastically(group["stochastic_rounding"], space.dtype)):
            return None
        return hashed_round_fn(self.base.seed, [self.steps[p.index] for p in pieces],
                               [p.index for p in pieces], [p.param_offset for p in pieces])

    def _norm_device(self) -> torch.device:
        return self.shards[0].grad_acc.device if self.shards else torch.device("cpu")

    # -- checkpoints (the unsharded optimizer's format) ----------------------------------------
    def _gathered(self, shard: _ShardSpace, local: Tensor) -> Tensor:
        full = torch.empty(shard.space.padded, dtype=local.dtype, device=local.device)
        return self.replicas.all_gather(full, local)

    def state_dict(self) -> dict[str, Any]:
        """The whole optimizer state, gathered from every replica (a collective: all call it)."""
        sd = self.base.state_dict()  # param groups and seed; the base holds no moments
        state: dict[int, dict[str, Any]] = {}
        for shard in self.shards:
            moments = {"exp_avg": self._gathered(shard, shard.exp_avg).cpu(),
                       "exp_avg_sq": self._gathered(shard, shard.exp_avg_sq).cpu()}
            for p, offset in zip(shard.space.params, shard.space.offsets):
                i = self._index[id(p)]
                if self.steps[i] == 0:
                    continue
                entry: dict[str, Any] = {"step": self.steps[i]}
                for key, full in moments.items():
                    entry[key] = full[offset:offset + p.numel()].view(p.shape).clone()
                state[i] = entry
        sd["state"] = state
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an unsharded or gathered state dict: keep this replica's slice of every moment."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups) or any(
                len(s["params"]) != len(g["params"])
                for s, g in zip(saved_groups, self.param_groups)):
            raise ValueError("optimizer state has different parameter groups than this model")
        rng = dict(state_dict.get("popbert_rng") or {})
        base_sd = {"state": {}, "param_groups": saved_groups}
        if rng:
            base_sd["popbert_rng"] = rng  # the seed; old generator states are only noted
        self.base.load_state_dict(base_sd)
        self.param_groups = self.base.param_groups
        saved_ids = list(chain.from_iterable(g["params"] for g in saved_groups))
        position = {key: i for i, key in enumerate(saved_ids)}
        entries = {position[k]: v for k, v in state_dict["state"].items() if k in position}
        self.steps = [int(entries[i]["step"]) if i in entries else 0
                      for i in range(len(self.params))]
        for shard in self.shards:
            shard.exp_avg.zero_()
            shard.exp_avg_sq.zero_()
            for piece in shard.pieces:
                entry = entries.get(piece.index)
                if entry is None:
                    continue
                p = self.params[piece.index]
                for key, target in (("exp_avg", shard.exp_avg), ("exp_avg_sq", shard.exp_avg_sq)):
                    value = entry[key]
                    if tuple(value.shape) != tuple(p.shape):
                        raise ValueError(f"optimizer state {key} of parameter {piece.index} has "
                                         f"shape {tuple(value.shape)}, the model "
                                         f"{tuple(p.shape)}")
                    flat = value.reshape(-1)[piece.param_offset:piece.param_offset + piece.length]
                    target[piece.shard_offset:piece.shard_offset + piece.length].copy_(flat)
        self._accumulated = 0
