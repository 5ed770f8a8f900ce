"""LAMB and AdamW math in FP32 on lists of tensors: the reference the whole steps are built from.

Each function updates lists of FP32 tensors on one device in place with ``torch._foreach_*``
kernels (torch.optim's multi-tensor path; they have no public name, hence the ``noqa: SLF001``
where a result is read). LAMB's per-tensor norms are split out so a sharded caller can compose
the step on its 1/N slices: :func:`per_tensor_sq_norms` gives *partial* squared norms (sum them
over shards), :func:`lamb_trust_ratios` turns the completed ones into ratios and
:func:`apply_updates_` applies them. Gradient clipping likewise: :func:`per_tensor_sq_norms`
over the grads, reduce, :func:`clip_coefficient`. The whole steps with half weights, tiling and
the compiled kernels are in :mod:`popbert.optimizers.steps`.

``steps`` holds, per tensor, the step number *after* incrementing (1 on the first update), so
tensors that skipped steps keep their own bias correction. The formulas are in
``docs/design.md`` (Optimizers).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "adam_moments_",
    "adam_denominators",
    "adam_direction_scales",
    "adamw_apply_",
    "bias_corrections",
    "lamb_updates",
    "per_tensor_sq_norms",
    "lamb_trust_ratios",
    "apply_updates_",
    "clip_coefficient",
    "update_clipping_scales",
]


def bias_corrections(beta: float, steps: Sequence[int], enabled: bool) -> list[float]:
    """Per-tensor ``1 - beta^t`` (all 1 when bias correction is off)."""
    if not enabled:
        return [1.0] * len(steps)
    return [1.0 - beta**step for step in steps]


def adam_moments_(
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    grads: list[Tensor],
    beta1: float,
    beta2: float,
) -> None:
    """Update the first and second moments in place (FP32 grads)."""
    if not grads:
        return
    torch._foreach_lerp_(exp_avgs, grads, 1.0 - beta1)
    torch._foreach_mul_(exp_avg_sqs, beta2)
    torch._foreach_addcmul_(exp_avg_sqs, grads, grads, 1.0 - beta2)


def adam_denominators(
    exp_avg_sqs: list[Tensor],
    steps: Sequence[int],
    beta2: float,
    eps: float,
    bias_correction: bool,
) -> list[Tensor]:
    """Return new tensors ``sqrt(v) + eps * sqrt(1 - b2^t)``.

    That is ``sqrt(1 - b2^t) * (sqrt(v_hat) + eps)``: the bias correction of ``v`` moves into a
    per-tensor scalar (see :func:`adam_direction_scales`), saving a full pass over the state.
    """
    if not exp_avg_sqs:
        return []
    denoms = list(torch._foreach_sqrt(exp_avg_sqs))  # noqa: SLF001
    if bias_correction:
        bc2 = bias_corrections(beta2, steps, True)
        torch._foreach_add_(denoms, [eps * math.sqrt(bc) for bc in bc2])
    else:
        torch._foreach_add_(denoms, eps)
    return denoms


def adam_direction_scales(
    steps: Sequence[int], beta1: float, beta2: float, bias_correction: bool
) -> list[float]:
    """Per-tensor ``sqrt(1 - b2^t) / (1 - b1^t)``, so ``r = scale * m / denom``."""
    bc1 = bias_corrections(beta1, steps, bias_correction)
    bc2 = bias_corrections(beta2, steps, bias_correction)
    return [math.sqrt(b2) / b1 for b1, b2 in zip(bc1, bc2, strict=True)]


def adamw_apply_(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    denoms: list[Tensor],
    steps: Sequence[int],
    *,
    lr: float,
    beta1: float,
    beta2: float,
    weight_decay: float,
    bias_correction: bool,
    lr_scales: Sequence[float] | None = None,
) -> None:
    """AdamW weight update in place: ``w = w (1 - lr wd) - lr r``; with ``lr_scales``, each
    tensor's ``lr`` times its scale (StableAdamW's update clipping)."""
    if not params:
        return
    lrs = [lr] * len(params) if lr_scales is None else [lr * s for s in lr_scales]
    if weight_decay != 0.0:
        if lr_scales is None:
            torch._foreach_mul_(params, 1.0 - lr * weight_decay)
        else:
            torch._foreach_mul_(params, [1.0 - x * weight_decay for x in lrs])
    scales = adam_direction_scales(steps, beta1, beta2, bias_correction)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, [-x * c for x, c in zip(lrs, scales)])


def update_clipping_scales(
    grads: list[Tensor],
    exp_avg_sqs: list[Tensor],
    steps: Sequence[int],
    *,
    beta2: float,
    eps: float,
    bias_correction: bool,
    grad_factor: float = 1.0,
) -> list[float]:
    """StableAdamW's per-tensor learning-rate factors, ``1 / max(1, RMS_t)`` with
    ``RMS_t = sqrt(mean(g^2 / max(v_hat, eps^2)))`` over the whole tensor (Wortsman et al.
    2023, "AdamW-AdaFactor update clipping"; ModernBERT trains with it). ``v_hat`` is the
    second moment this step will have, computed aside (the moments are not modified): where a
    gradient is far above its running scale — a loss spike — the whole tensor's step shrinks.
    """
    if not grads:
        return []
    bc2 = bias_corrections(beta2, steps, bias_correction)
    floor = eps * eps
    mean_squares = []
    for grad, v, correction in zip(grads, exp_avg_sqs, bc2, strict=True):
        g = grad.float() * grad_factor
        square = g * g
        v_hat = (v * beta2).add_(square, alpha=1.0 - beta2).div_(correction).clamp_(min=floor)
        mean_squares.append(square.div_(v_hat).mean())
    # One transfer for all tensors (a device sync per tensor would stall an accelerator).
    return [1.0 / max(1.0, math.sqrt(ms)) for ms in torch.stack(mean_squares).tolist()]


def lamb_updates(
    params: list[Tensor],
    exp_avgs: list[Tensor],
    denoms: list[Tensor],
    steps: Sequence[int],
    *,
    beta1: float,
    beta2: float,
    weight_decay: float,
    bias_correction: bool,
) -> list[Tensor]:
    """Return ``u = r + wd * w`` (LAMB's update before the trust ratio); consumes ``denoms``.

    On CPU the updates are written into the ``denoms`` buffers, saving an allocation.
    """
    if not params:
        return []
    if bias_correction:
        scales = adam_direction_scales(steps, beta1, beta2, bias_correction)
        torch._foreach_div_(denoms, scales)  # r = m / (denom / c)
    if denoms[0].device.type == "cpu":
        for m, d in zip(exp_avgs, denoms, strict=True):
            torch.div(m, d, out=d)
        updates = denoms
    else:
        updates = list(torch._foreach_div(exp_avgs, denoms))  # noqa: SLF001
    if weight_decay != 0.0:
        torch._foreach_add_(updates, params, alpha=weight_decay)
    return updates


def per_tensor_sq_norms(tensors: Sequence[Tensor]) -> Tensor:
    """Squared L2 norm of each tensor, as one FP32 vector (empty input -> empty vector).

    On a shard these are partial sums: add them across shards before taking ratios.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float32)  # noqa: SLF001
    return torch.stack(norms).square()


def lamb_trust_ratios(
    weight_sq_norms: Tensor,
    update_sq_norms: Tensor,
    *,
    max_trust_ratio: float | None = None,
    max_weight_norm: float | None = None,
) -> Tensor:
    """Per-tensor LAMB trust ratios ``phi(||w||) / ||u||`` from complete squared norms.

    ``phi`` clamps ``||w||`` to ``max_weight_norm`` when given (PopART's ``maxWeightNorm``);
    the ratio is 1 where either norm is zero and is clamped to ``max_trust_ratio`` when given.
    """
    weight_norms = weight_sq_norms.sqrt()
    update_norms = update_sq_norms.sqrt()
    if max_weight_norm is not None:
        weight_norms = weight_norms.clamp(max=max_weight_norm)
    usable = (weight_norms > 0) & (update_norms > 0)
    ratios = torch.where(usable, weight_norms / update_norms, torch.ones_like(weight_norms))
    if max_trust_ratio is not None:
        ratios = ratios.clamp(max=max_trust_ratio)
    return ratios


def apply_updates_(
    params: list[Tensor],
    updates: list[Tensor],
    lr: float,
    ratios: Tensor | None = None,
) -> None:
    """``w -= lr * ratio * u`` in place, one ratio per tensor (``None``: plain step).

    ``updates`` may be consumed (scaled in place).
    """
    if not params:
        return
    if ratios is None:
        torch._foreach_add_(params, updates, alpha=-lr)
        return
    scales = ratios.to(torch.float64) * -lr
    device = params[0].device
    if device.type == "cpu":
        # CPU foreach kernels loop over tensors anyway; one fused pass per tensor is cheaper.
        for p, u, scale in zip(params, updates, scales.tolist(), strict=True):
            p.add_(u, alpha=scale)
        return
    # Elsewhere keep the scales on the device: no host synchronisation per step.
    torch._foreach_mul_(updates, list(scales.to(device=device, dtype=torch.float32).unbind(0)))
    torch._foreach_add_(params, updates)


def clip_coefficient(total_sq_norm: Tensor | float, max_norm: float, eps: float = 1e-6) -> float:
    """Factor ``min(1, max_norm / (||g|| + eps))`` for global gradient-norm clipping."""
    norm = math.sqrt(float(total_sq_norm))
    return min(1.0, max_norm / (norm + eps))
