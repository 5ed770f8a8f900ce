"""Whole LAMB and AdamW steps in place: the arithmetic of the optimizer classes and of RTS shards.

One call takes the lists of one parameter dtype on one device. It adds to the FP32 math of
:mod:`popbert.optimizers.functional` what a real step needs: FP16/BF16 weights (updated in FP32
and written back through a rounding function), grads of any float dtype scaled by
``grad_factor``, tiling (:mod:`popbert.optimizers.tiling`), and for LAMB a hook that all-reduces
the per-tensor squared norms, so a shard can call it directly. On CPU, large pieces of half
weights with hashed stochastic rounding take the compiled kernels of
:mod:`popbert.optimizers.fused`, bit-identical to the unfused path.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch
from torch import Tensor

from popbert.optimizers.functional import (
    adam_denominators,
    adam_moments_,
    adamw_apply_,
    apply_updates_,
    lamb_trust_ratios,
    lamb_updates,
    per_tensor_sq_norms,
    update_clipping_scales,
)
from popbert.optimizers.fused import (
    FusedPiece,
    Scratch,
    adamw_piece,
    apply_piece,
    f32,
    fusable,
    lamb_update_piece,
    split_tile,
)
from popbert.optimizers.stochastic_rounding import HashedRounding, RoundFn
from popbert.optimizers.tiling import Tile, TilePlan, step_tiles

__all__ = ["adamw_step_", "lamb_step_"]

Lists = tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]


def adamw_step_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool = True,
    grad_factor: float = 1.0,
    tile_numel: int | None = None,
    round_fn: RoundFn | None = None,
    update_clipping: bool = False,
) -> None:
    """One AdamW step in place (torch.optim.AdamW's update, computed in FP32).

    ``update_clipping``: StableAdamW — each tensor's learning rate (and so its decoupled
    weight decay) divided by max(1, RMS of g / sqrt(v_hat)) over the whole tensor
    (:func:`~popbert.optimizers.functional.update_clipping_scales`); the step then never takes
    the compiled kernels, whose learning rate is one scalar.

    ``params`` share one dtype: FP32 is updated in place; FP16/BF16 is widened to FP32 per
    tile and written back with ``round_fn`` (see
    :data:`~popbert.optimizers.stochastic_rounding.RoundFn`; default: round to nearest).
    ``grads`` of any float dtype are widened and multiplied by ``grad_factor`` (unscale, clip)
    without modifying them. Moments are FP32. ``tile_numel``: see
    :func:`~popbert.optimizers.tiling.default_tile_numel`.
    """
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    hyper = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
             "weight_decay": weight_decay, "bias_correction": bias_correction,
             "grad_factor": grad_factor}
    plan = step_tiles(params, grads, exp_avgs, exp_avg_sqs, tile_numel)
    if update_clipping:
        scales = update_clipping_scales(grads, exp_avg_sqs, steps, beta2=beta2, eps=eps,
                                        bias_correction=bias_correction,
                                        grad_factor=grad_factor)
        _adamw(lists, steps, plan, round_fn, None, lr_scales=scales, **hyper)
        return
    fuse = fusable(round_fn, lists, plan,
                   ("adamw", abs(f32(1.0 - beta1)) >= 0.5, weight_decay != 0.0),
                   partial(_probe_run, _adamw, hyper))
    _adamw(lists, steps, plan, round_fn, fuse, **hyper)


def _probe_run(run: Callable[..., None], hyper: dict[str, object], params: list[Tensor],
               grads: list[Tensor], exp_avgs: list[Tensor], exp_avg_sqs: list[Tensor],
               steps: list[int], round_fn: HashedRounding, fuse: HashedRounding | None) -> None:
    """``run`` (:func:`_adamw` or :func:`_lamb`) as the probe of
    :func:`~popbert.optimizers.fused.probe_agrees` calls it: whole tensors, one tile, unsharded
    (a :data:`~popbert.optimizers.fused.StepRunner` once ``run`` and ``hyper`` are bound)."""
    plan = step_tiles(params, grads, exp_avgs, exp_avg_sqs, None)
    run((params, grads, exp_avgs, exp_avg_sqs), steps, plan, round_fn, fuse, **hyper)


def _adamw(lists: Lists, steps: Sequence[int], plan: TilePlan, round_fn: RoundFn | None,
           fuse: HashedRounding | None, *, lr: float, beta1: float, beta2: float, eps: float,
           weight_decay: float, bias_correction: bool, grad_factor: float,
           lr_scales: Sequence[float] | None = None) -> None:
    """:func:`adamw_step_` over ``plan``, large pieces fused with ``fuse`` (None: none);
    ``lr_scales``: per-tensor factors of ``lr`` (update clipping; never fused)."""
    params, grads, exp_avgs, exp_avg_sqs = lists
    hyper = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
             "weight_decay": weight_decay, "bias_correction": bias_correction,
             "grad_factor": grad_factor}
    scratch = Scratch()
    for tile in plan:
        big, tile = split_tile(tile, lists, fuse)
        for piece in big:
            assert fuse is not None
            adamw_piece(FusedPiece(piece, lists, fuse, scratch), steps[piece[0]], **hyper)
        if not tile:
            continue
        t = Tile(tile, params, grads, exp_avgs, exp_avg_sqs, steps)
        weights = t.weights()
        adam_moments_(t.exp_avgs, t.exp_avg_sqs, t.grads(grad_factor), beta1, beta2)
        denoms = adam_denominators(t.exp_avg_sqs, t.steps, beta2, eps, bias_correction)
        adamw_apply_(
            weights,
            t.exp_avgs,
            denoms,
            t.steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            bias_correction=bias_correction,
            lr_scales=None if lr_scales is None else [lr_scales[i] for i in t.index],
        )
        t.store(round_fn)


def lamb_step_(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    bias_correction: bool = True,
    trust_ratio: bool = True,
    max_trust_ratio: float | None = None,
    max_weight_norm: float | None = None,
    grad_factor: float = 1.0,
    tile_numel: int | None = None,
    round_fn: RoundFn | None = None,
    tensor_index: Sequence[int] | None = None,
    num_tensors: int | None = None,
    reduce_sq_norms: Callable[[Tensor], Tensor] | None = None,
) -> None:
    """One LAMB step in place; dtypes, ``grad_factor`` and tiling as in :func:`adamw_step_`.

    ``trust_ratio=False`` gives the plain Adam step ``w -= lr (r + wd w)`` used for biases and
    LayerNorm betas. A tile is applied once the norms of all its tensors are complete, so the
    transient memory is the update (and, for half weights, the FP32 copy) of about the largest
    tensor; sharded calls hold their whole shard's updates until the all-reduce.

    Sharded use: pass this replica's fragments (views of flattened parameters and state) as
    the lists, ``tensor_index[i]`` = the id of the tensor fragment ``i`` belongs to (ids in
    ``range(num_tensors)``, the same numbering on every replica) and ``reduce_sq_norms``, which
    receives a float64 ``[2, num_tensors]`` tensor of partial squared norms (weights, updates)
    and returns it summed over replicas, e.g. ``lambda sq: (dist.all_reduce(sq), sq)[1]``.
    """
    plan = step_tiles(params, grads, exp_avgs, exp_avg_sqs, tile_numel)
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    hyper = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
             "weight_decay": weight_decay, "bias_correction": bias_correction,
             "trust_ratio": trust_ratio, "max_trust_ratio": max_trust_ratio,
             "max_weight_norm": max_weight_norm, "grad_factor": grad_factor}
    fuse = fusable(round_fn, lists, plan,
                   ("lamb", trust_ratio, abs(f32(1.0 - beta1)) >= 0.5, weight_decay != 0.0),
                   partial(_probe_run, _lamb, hyper))
    _lamb(lists, steps, plan, round_fn, fuse, **hyper, tensor_index=tensor_index,
          num_tensors=num_tensors, reduce_sq_norms=reduce_sq_norms)


def _lamb(lists: Lists, steps: Sequence[int], plan: TilePlan, round_fn: RoundFn | None,
          fuse: HashedRounding | None, *, lr: float, beta1: float, beta2: float, eps: float,
          weight_decay: float, bias_correction: bool, trust_ratio: bool,
          max_trust_ratio: float | None, max_weight_norm: float | None, grad_factor: float,
          tensor_index: Sequence[int] | None = None, num_tensors: int | None = None,
          reduce_sq_norms: Callable[[Tensor], Tensor] | None = None) -> None:
    """:func:`lamb_step_` over ``plan``, large pieces fused with ``fuse`` (None: none)."""
    params, grads, exp_avgs, exp_avg_sqs = lists
    hyper = {
        "beta1": beta1,
        "beta2": beta2,
        "weight_decay": weight_decay,
        "bias_correction": bias_correction,
    }

    def updates_of(t: Tile, weights: list[Tensor]) -> list[Tensor]:
        denoms = adam_denominators(t.exp_avg_sqs, t.steps, beta2, eps, bias_correction)
        return lamb_updates(weights, t.exp_avgs, denoms, t.steps, **hyper)

    scratch, widened = Scratch(), Scratch()

    def first_pass(tile: list[tuple[int, int, int]]) -> tuple[
            list[tuple[FusedPiece, Tensor, Tensor]], Tile | None, list[Tensor], list[Tensor]]:
        """Moments and updates of one tile: (fused pieces with their FP32 updates and weights'
        squared norms, the unfused rest with its FP32 weights and updates)."""
        big, rest = split_tile(tile, lists, fuse)
        done = []
        for piece in big:
            assert fuse is not None
            fp = FusedPiece(piece, lists, fuse, scratch)
            w32 = widened.get(fp.n)
            update = lamb_update_piece(fp, steps[piece[0]], w32, eps=eps,
                                       grad_factor=grad_factor, **hyper)
            # The norm of the FP32 weights, as the unfused path takes it (before w32 is reused).
            done.append((fp, update, per_tensor_sq_norms([w32]) if trust_ratio else None))
        if not rest:
            return done, None, [], []
        t = Tile(rest, params, grads, exp_avgs, exp_avg_sqs, steps)
        weights = t.weights()
        adam_moments_(t.exp_avgs, t.exp_avg_sqs, t.grads(grad_factor), beta1, beta2)
        return done, t, weights, updates_of(t, weights)

    if not trust_ratio:
        for tile in plan:
            done, t, weights, updates = first_pass(tile)
            for fp, update, _ in done:
                apply_piece(fp, update, -lr)
            if t is not None:
                apply_updates_(weights, updates, lr)
                t.store(round_fn)
        return

    if tensor_index is None:
        tensor_index = range(len(params))
    if num_tensors is None:
        num_tensors = max(tensor_index, default=-1) + 1
    device = params[0].device if params else torch.device("cpu")
    sq_norms = torch.zeros(2, num_tensors, dtype=torch.float64, device=device)

    def add_norms(index: list[int], weight_sq: Tensor, updates: list[Tensor]) -> Tensor:
        where = torch.tensor([tensor_index[i] for i in index], device=device)
        partial = torch.stack([weight_sq, per_tensor_sq_norms(updates)])
        sq_norms.index_add_(1, where, partial.to(device=device, dtype=torch.float64))
        return where

    # A tensor's ratio is final once its last piece is through the first pass, so each tile is
    # applied as soon as all its tensors are complete: only the updates of tensors still in
    # progress are held. Shards wait for the all-reduce, so they hold everything.
    last_tile = {}
    for k, tile in enumerate(plan):
        for i, _, _ in tile:
            last_tile[i] = k
    ready_at = [max(last_tile[i] for i, _, _ in tile) for tile in plan]
    if reduce_sq_norms is not None:
        ready_at = [len(plan) - 1] * len(plan)
    pending: list[tuple[Callable[[Tensor], None], int]] = []
    for k, tile in enumerate(plan):
        done, t, weights, updates = first_pass(tile)
        if done:
            where = add_norms([fp.i for fp, _, _ in done], torch.cat([sq for _, _, sq in done]),
                              [u for _, u, _ in done])

            def apply_fused(ratios: Tensor, done=done, where=where) -> None:
                for (fp, update, _), ratio in zip(done, ratios[where].tolist(), strict=True):
                    apply_piece(fp, update, ratio * -lr)  # as apply_updates_ computes it

            pending.append((apply_fused, ready_at[k]))
        if t is not None:
            where = add_norms(t.index, per_tensor_sq_norms(weights), updates)

            def apply_rest(ratios: Tensor, t=t, weights=weights, updates=updates,
                           where=where) -> None:
                apply_updates_(weights, updates, lr, ratios[where])
                t.store(round_fn)

            pending.append((apply_rest, ready_at[k]))
        if not pending or pending[0][1] > k:
            continue
        if reduce_sq_norms is not None:
            sq_norms = reduce_sq_norms(sq_norms)
        ratios = lamb_trust_ratios(
            sq_norms[0],
            sq_norms[1],
            max_trust_ratio=max_trust_ratio,
            max_weight_norm=max_weight_norm,
        )
        while pending and pending[0][1] <= k:
            apply, _ = pending.pop(0)
            apply(ratios)
    if reduce_sq_norms is not None and not plan:  # an empty shard still joins the all-reduce
        reduce_sq_norms(sq_norms)
