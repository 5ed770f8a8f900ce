"""``torch.optim.Optimizer`` classes for LAMB and AdamW with FP32 math and half-precision weights.

The classes own the bookkeeping (state, grouping by device and dtype, gradient unscaling and
clipping, rounding back to half weights, checkpointing) and delegate the arithmetic to
:mod:`popbert.optimizers.steps`, so the unsharded and sharded paths share one definition.

Weights stored in float16 / bfloat16 keep FP32 moments, their update is computed in FP32 from
the half weight and gradient (widened exactly), and the result is written back with stochastic
rounding (default for half weights; on CPU fused with the update into compiled loops) or
round-to-nearest. There is no FP32 master copy: state is 8 bytes per parameter on top of the
weight itself.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from itertools import chain
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from popbert.dtypes import rounds_stochastically
from popbert.optimizers.functional import clip_coefficient, per_tensor_sq_norms
from popbert.optimizers.steps import adamw_step_, lamb_step_
from popbert.optimizers.stochastic_rounding import ROUNDING_SCHEME, hashed_round_fn
from popbert.optimizers.tiling import default_tile_numel

__all__ = ["AdamFamilyOptimizer", "Lamb", "AdamW", "note_old_rounding_state"]

logger = logging.getLogger(__name__)

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_MOMENT_KEYS = ("exp_avg", "exp_avg_sq")
_RNG_KEY = "popbert_rng"

ParamsT = Iterable[Tensor] | Iterable[dict[str, Any]]


class AdamFamilyOptimizer(Optimizer):
    """Shared engine of :class:`Lamb` and :class:`AdamW` (groups differ only in options).

    Group options: ``lr``, ``betas``, ``eps``, ``weight_decay``, ``bias_correction``,
    ``trust_ratio`` (LAMB layer adaptation on/off), ``max_trust_ratio``, ``max_weight_norm``,
    ``stochastic_rounding`` (``None``: on for half weights). Optimizer-wide: ``max_grad_norm``
    (global clipping over all groups) and the stochastic-rounding seed (``seed``, or the initial
    seed of ``generator``; default ``torch.initial_seed()``, so ``torch.manual_seed`` controls
    it). Rounding bits are a hash of (seed, the parameter's step, its position among all
    parameters, element index): no generator state, so a checkpoint's steps and seed resume
    them exactly.
    """

    _allow_trust_ratio = True
    #: Elements per tile of the step (see ``tiling.default_tile_numel``); ``"auto"`` picks
    #: by device, ``None`` processes whole tensors.
    tile_numel: int | None | str = "auto"

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        trust_ratio: bool = True,
        max_trust_ratio: float | None = None,
        max_weight_norm: float | None = None,
        max_grad_norm: float | None = None,
        stochastic_rounding: bool | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        defaults = {
            "lr": lr,
            "betas": tuple(betas),
            "eps": eps,
            "weight_decay": weight_decay,
            "bias_correction": bias_correction,
            "trust_ratio": trust_ratio,
            "max_trust_ratio": max_trust_ratio,
            "max_weight_norm": max_weight_norm,
            "stochastic_rounding": stochastic_rounding,
        }
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        if generator is not None and seed is not None:
            raise ValueError("pass either generator or seed, not both")
        if generator is not None:
            self._seed = int(generator.initial_seed())
        else:
            self._seed = int(torch.initial_seed() if seed is None else seed)

    # ------------------------------------------------------------------ public accessors

    @property
    def seed(self) -> int:
        """Seed of the stochastic rounding (a sharded optimizer uses it unchanged)."""
        return self._seed

    def tensor_ids(self) -> dict[int, int]:
        """``id(param)`` -> the parameter's position among all groups' parameters: the tensor
        id its stochastic rounding hashes (stable across checkpoints, shared with RTS)."""
        params = chain.from_iterable(g["params"] for g in self.param_groups)
        return {id(p): i for i, p in enumerate(params)}

    def tile_numel_for(self, device: torch.device) -> int | None:
        """Elements per tile of the step on ``device`` (resolves ``tile_numel="auto"``)."""
        if self.tile_numel == "auto":
            return default_tile_numel(device)
        return self.tile_numel

    # ------------------------------------------------------------------ groups and state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Validate a group's options and parameters, then add it."""
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        if not self._allow_trust_ratio:
            group["trust_ratio"] = False
        _validate_group(group)
        for p in group["params"]:
            if p.dtype not in _SUPPORTED_DTYPES:
                raise TypeError(
                    f"{type(self).__name__} supports float32/float16/bfloat16 parameters, "
                    f"got {p.dtype}"
                )

    def _init_state(self, p: Tensor) -> dict[str, Any]:
        state = self.state[p]
        if not state:
            state["step"] = 0
            for name in _MOMENT_KEYS:
                state[name] = torch.zeros_like(p, dtype=torch.float32)
        return state

    def state_dict(self) -> dict[str, Any]:
        """Torch's state dict plus the stochastic-rounding seed and scheme (the per-parameter
        steps, already in the state, are the rest of the rounding counter)."""
        sd = super().state_dict()
        sd[_RNG_KEY] = {"seed": self._seed, "scheme": ROUNDING_SCHEME}
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state dict, keeping moments in FP32 and restoring the rounding seed.

        Torch's loader casts state tensors to the parameter dtype; that would truncate FP32
        moments of half weights, so they are re-copied from ``state_dict`` afterwards. Tensors
        are always copied, so the loaded optimizer never aliases the dict it came from.
        """
        state_dict = dict(state_dict)
        rng = state_dict.pop(_RNG_KEY, None)
        saved_ids = list(chain.from_iterable(g["params"] for g in state_dict["param_groups"]))
        params = list(chain.from_iterable(g["params"] for g in self.param_groups))
        if len(saved_ids) != len(params):
            raise ValueError(f"the state holds {len(saved_ids)} parameters, this optimizer "
                             f"{len(params)}")
        id_map = dict(zip(saved_ids, params, strict=True))
        for key, saved in state_dict["state"].items():  # checked before anything is loaded
            p = id_map.get(key)
            for name in _MOMENT_KEYS:
                if p is not None and name in saved and tuple(saved[name].shape) != p.shape:
                    raise ValueError(f"{name} of parameter {key} has shape "
                                     f"{tuple(saved[name].shape)}, the parameter {tuple(p.shape)}")
        super().load_state_dict(state_dict)
        for key, saved in state_dict["state"].items():
            p = id_map.get(key)
            if p is None:
                continue
            for name in _MOMENT_KEYS:
                if name in saved:
                    self.state[p][name] = saved[name].to(
                        device=p.device, dtype=torch.float32, copy=True
                    )
            if "step" in saved:
                self.state[p]["step"] = int(saved["step"])
        for group in self.param_groups:
            group["betas"] = tuple(group["betas"])
            if not self._allow_trust_ratio:
                group["trust_ratio"] = False
        if rng is not None:
            self._seed = int(rng["seed"])
            note_old_rounding_state(rng)

    # ------------------------------------------------------------------ the step

    @torch.no_grad()
    def step(
        self,
        closure: Callable[[], Any] | None = None,
        *,
        grad_scale: float | Tensor | None = None,
    ) -> Any:
        """One optimizer step.

        ``grad_scale``: the loss scale the gradients still carry; they are divided by it in
        FP32 inside the step (so FP16 gradients never underflow from an in-place unscale).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        grad_factor = 1.0
        if grad_scale is not None:
            grad_scale = float(grad_scale)
            if not grad_scale > 0:
                raise ValueError(f"grad_scale must be positive, got {grad_scale}")
            grad_factor = 1.0 / grad_scale

        active = []
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            for p in params:
                if p.grad.is_sparse:
                    raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            active.append((group, params))

        if self.max_grad_norm is not None:
            grads = [p.grad for _, params in active for p in params]
            sq_norm = _total_sq_norm(grads) * grad_factor**2
            grad_factor *= clip_coefficient(sq_norm, self.max_grad_norm)

        ids = self.tensor_ids()
        for group, params in active:
            for (device, dtype), bucket in _bucket_by_device_dtype(params).items():
                self._update_bucket(group, bucket, device, dtype, grad_factor, ids)
        return loss

    def _update_bucket(
        self,
        group: dict[str, Any],
        params: list[Tensor],
        device: torch.device,
        dtype: torch.dtype,
        grad_factor: float,
        ids: dict[int, int],
    ) -> None:
        states = [self._init_state(p) for p in params]
        for state in states:
            state["step"] += 1
        steps = [state["step"] for state in states]
        exp_avgs = [state["exp_avg"] for state in states]
        exp_avg_sqs = [state["exp_avg_sq"] for state in states]

        round_fn = None
        if dtype != torch.float32 and rounds_stochastically(group["stochastic_rounding"], dtype):
            round_fn = hashed_round_fn(self._seed, steps, [ids[id(p)] for p in params])

        common = {
            "lr": group["lr"],
            "beta1": group["betas"][0],
            "beta2": group["betas"][1],
            "eps": group["eps"],
            "weight_decay": group["weight_decay"],
            "bias_correction": group["bias_correction"],
            "grad_factor": grad_factor,
            "tile_numel": self.tile_numel_for(device),
            "round_fn": round_fn,
        }
        grads = [p.grad for p in params]
        if group["trust_ratio"]:
            lamb_step_(
                params,
                grads,
                exp_avgs,
                exp_avg_sqs,
                steps,
                max_trust_ratio=group["max_trust_ratio"],
                max_weight_norm=group["max_weight_norm"],
                **common,
            )
        else:
            adamw_step_(params, grads, exp_avgs, exp_avg_sqs, steps,
                        update_clipping=group.get("update_clipping", False), **common)


class Lamb(AdamFamilyOptimizer):
    """LAMB (You et al. 2019, Algorithm 2) with FP32 moments, for FP32 or half weights.

    ``u = m_hat / (sqrt(v_hat) + eps) + weight_decay * w`` and
    ``w -= lr * phi(||w||) / ||u|| * u`` per tensor (ratio 1 if a norm is zero). Groups with
    ``trust_ratio=False`` take the plain Adam step (biases, LayerNorm betas); use
    :func:`popbert.optimizers.param_groups_by_name` to build such groups. Graphcore's BERT
    pre-training uses ``bias_correction=False``.
    """

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        trust_ratio: bool = True,
        max_trust_ratio: float | None = None,
        max_weight_norm: float | None = None,
        max_grad_norm: float | None = None,
        stochastic_rounding: bool | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            bias_correction=bias_correction,
            trust_ratio=trust_ratio,
            max_trust_ratio=max_trust_ratio,
            max_weight_norm=max_weight_norm,
            max_grad_norm=max_grad_norm,
            stochastic_rounding=stochastic_rounding,
            generator=generator,
            seed=seed,
        )


class AdamW(AdamFamilyOptimizer):
    """AdamW (Loshchilov & Hutter): torch.optim.AdamW's update, FP32 math, to ~1e-7 relative.

    Adds half-precision weights with FP32 moments and stochastic rounding, ``max_grad_norm``
    and ``grad_scale``. Any ``trust_ratio`` key in a group is ignored (always off).
    """

    _allow_trust_ratio = False

    def __init__(
        self,
        params: ParamsT,
        lr: float,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-6,
        weight_decay: float = 0.01,
        *,
        bias_correction: bool = True,
        max_grad_norm: float | None = None,
        stochastic_rounding: bool | None = None,
        generator: torch.Generator | None = None,
        seed: int | None = None,
    ) -> None:
        super().__init__(
            params,
            lr,
            betas,
            eps,
            weight_decay,
            bias_correction=bias_correction,
            trust_ratio=False,
            max_grad_norm=max_grad_norm,
            stochastic_rounding=stochastic_rounding,
            generator=generator,
            seed=seed,
        )


class StableAdamW(AdamW):
    """StableAdamW (Wortsman et al. 2023; ModernBERT's optimizer): AdamW whose learning rate,
    per tensor and step, is divided by max(1, RMS_t), RMS_t = sqrt(mean(g^2 / v_hat)) — the
    AdaFactor-style update clipping that replaces global gradient clipping against loss
    spikes. Everything else (FP32 math, half weights, stochastic rounding) is :class:`AdamW`'s.
    Not for replicated tensor sharding: RMS_t needs the whole tensor.
    """

    def __init__(self, params: ParamsT, lr: float, *args: Any, **kwargs: Any) -> None:
        super().__init__(params, lr, *args, **kwargs)
        for group in self.param_groups:
            group["update_clipping"] = True
        self.defaults["update_clipping"] = True


def note_old_rounding_state(rng: dict[str, Any]) -> None:
    """Log when a checkpoint's rounding state comes from the generator-based scheme."""
    if rng.get("generators") or rng.get("replica_generators"):
        logger.info(
            "the checkpoint holds stochastic-rounding generator states from an older popbert; "
            "rounding bits now hash (seed, step, tensor, element), so half weights resume with "
            "different random bits than that run would have drawn (the seed is kept)")
def _validate_group(group: dict[str, Any]) -> None:
    beta1, beta2 = group["betas"]
    group["betas"] = (float(beta1), float(beta2))
    if not 0.0 <= group["lr"]:
        raise ValueError(f"invalid learning rate {group['lr']}")
    if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0):
        raise ValueError(f"invalid betas {group['betas']}")
    if not 0.0 <= group["eps"]:
        raise ValueError(f"invalid eps {group['eps']}")
    if not 0.0 <= group["weight_decay"]:
        raise ValueError(f"invalid weight_decay {group['weight_decay']}")
    for key in ("max_trust_ratio", "max_weight_norm"):
        if group[key] is not None and not group[key] > 0:
            raise ValueError(f"{key} must be positive, got {group[key]}")


def _bucket_by_device_dtype(
    params: list[Tensor],
) -> dict[tuple[torch.device, torch.dtype], list[Tensor]]:
    buckets: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    for p in params:
        buckets.setdefault((p.device, p.dtype), []).append(p)
    return buckets


def _total_sq_norm(grads: list[Tensor]) -> float:
    """Sum of squared gradient norms over all devices, computed in FP32."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for g in grads:
        by_device.setdefault(g.device, []).append(g)
    return sum(float(per_tensor_sq_norms(gs).sum()) for gs in by_device.values())
