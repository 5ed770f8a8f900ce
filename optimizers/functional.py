"""LAMB and AdamW math in FP32 on lists of tensors, written once.

Everything here takes lists of FP32 tensors on one device and updates them in place with
``torch._foreach_*`` kernels. The optimizer classes call these functions on whole parameters; a
sharded data-parallel caller calls the same functions on its 1/N slices of flattened parameters.
LAMB's per-tensor norms are therefore split out: :func:`per_tensor_sq_norms` returns *partial*
squared norms (sum them over shards, e.g. with an all-reduce), :func:`lamb_trust_ratios` turns
the completed squared norms into ratios, and :func:`apply_updates_` applies them. The same holds
for gradient clipping: :func:`per_tensor_sq_norms` over grads, reduce, then
:func:`clip_coefficient`.

Conventions: ``steps`` holds, per tensor, the step number *after* incrementing (1 on the first
update), so tensors that skipped steps keep their own bias correction. Updates follow

* Adam moments: ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``
* direction: ``r = m_hat / (sqrt(v_hat) + eps)`` with ``m_hat = m / (1 - b1^t)``,
  ``v_hat = v / (1 - b2^t)`` when bias correction is on, else ``m`` and ``v``; computed as
  ``r = c * m / (sqrt(v) + eps * sqrt(1 - b2^t))`` with ``c = sqrt(1 - b2^t) / (1 - b1^t)``
  (the same value, one pass over the state fewer than dividing ``sqrt(v)`` first)
* AdamW: ``w = w (1 - lr wd) - lr r`` (decoupled decay, as torch.optim.AdamW)
* LAMB (You et al. 2019, Algorithm 2): ``u = r + wd w``,
  ``w = w - lr phi(||w||) / ||u|| u`` with ratio 1 when either norm is 0.
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
    "lamb_updates",
    "per_tensor_sq_norms",
    "lamb_trust_ratios",
    "apply_updates_",
    "clip_coefficient",
    "adamw_step_",
    "lamb_step_",
]


def _bias_corrections(beta: float, steps: Sequence[int], enabled: bool) -> list[float]:
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
    denoms = list(torch._foreach_sqrt(exp_avg_sqs))
    if bias_correction:
        bc2 = _bias_corrections(beta2, steps, True)
        torch._foreach_add_(denoms, [eps * math.sqrt(bc) for bc in bc2])
    else:
        torch._foreach_add_(denoms, eps)
    return denoms


def adam_direction_scales(
    steps: Sequence[int], beta1: float, beta2: float, bias_correction: bool
) -> list[float]:
    """Per-tensor ``sqrt(1 - b2^t) / (1 - b1^t)``, so ``r = scale * m / denom``."""
    bc1 = _bias_corrections(beta1, steps, bias_correction)
    bc2 = _bias_corrections(beta2, steps, bias_correction)
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
) -> None:
    """AdamW weight update in place: ``w = w (1 - lr wd) - lr r``."""
    if not params:
        return
    if weight_decay != 0.0:
        torch._foreach_mul_(params, 1.0 - lr * weight_decay)
    scales = adam_direction_scales(steps, beta1, beta2, bias_correction)
    torch._foreach_addcdiv_(params, exp_avgs, denoms, [-lr * c for c in scales])


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
    """Return new tensors ``u = r + wd * w`` (LAMB's update before the trust ratio)."""
    if not params:
        return []
    scales = adam_direction_scales(steps, beta1, beta2, bias_correction)
    if weight_decay != 0.0:
        updates = list(torch._foreach_mul(params, weight_decay))
        torch._foreach_addcdiv_(updates, exp_avgs, denoms, scales)
    else:
        updates = list(torch._foreach_div(exp_avgs, denoms))
        if bias_correction:
            torch._foreach_mul_(updates, scales)
    return updates


def per_tensor_sq_norms(tensors: Sequence[Tensor]) -> Tensor:
    """Squared L2 norm of each tensor, as one FP32 vector (empty input -> empty vector).

    On a shard these are partial sums: add them across shards before taking ratios.
    """
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    norms = torch._foreach_norm(list(tensors), 2, dtype=torch.float32)
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
) -> None:
    """One AdamW step on FP32 tensors, in place (same arithmetic as torch.optim.AdamW)."""
    adam_moments_(exp_avgs, exp_avg_sqs, grads, beta1, beta2)
    denoms = adam_denominators(exp_avg_sqs, steps, beta2, eps, bias_correction)
    adamw_apply_(
        params,
        exp_avgs,
        denoms,
        steps,
        lr=lr,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        bias_correction=bias_correction,
    )


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
) -> None:
    """One LAMB step on whole FP32 tensors, in place.

    ``trust_ratio=False`` gives the plain Adam step ``w -= lr (r + wd w)`` used for biases and
    LayerNorm betas. Sharded callers compose the pieces instead (see the module docstring).
    """
    adam_moments_(exp_avgs, exp_avg_sqs, grads, beta1, beta2)
    denoms = adam_denominators(exp_avg_sqs, steps, beta2, eps, bias_correction)
    updates = lamb_updates(
        params,
        exp_avgs,
        denoms,
        steps,
        beta1=beta1,
        beta2=beta2,
        weight_decay=weight_decay,
        bias_correction=bias_correction,
    )
    del denoms
    ratios = None
    if trust_ratio and params:
        ratios = lamb_trust_ratios(
            per_tensor_sq_norms(params),
            per_tensor_sq_norms(updates),
            max_trust_ratio=max_trust_ratio,
            max_weight_norm=max_weight_norm,
        )
    apply_updates_(params, updates, lr, ratios)
