"""LAMB and AdamW math in FP32 on lists of tensors, written once.

Building blocks take lists of FP32 tensors on one device and update them in place with
``torch._foreach_*`` kernels (torch.optim's multi-tensor path; they have no public name, hence
the ``noqa: SLF001`` where a result is read). A sharded data-parallel caller can compose them
on its 1/N slices of flattened parameters: LAMB's per-tensor norms are split out, so
:func:`per_tensor_sq_norms` returns *partial* squared norms (sum them over shards, e.g. with
an all-reduce), :func:`lamb_trust_ratios` turns the completed squared norms into ratios and
:func:`apply_updates_` applies them. Gradient clipping likewise: :func:`per_tensor_sq_norms`
over the grads, reduce, :func:`clip_coefficient`, then pass the factor as ``grad_factor``.

The whole steps :func:`adamw_step_` and :func:`lamb_step_` (used by the optimizer classes)
add FP16/BF16 weights (FP32 working copies, written back through a rounding function), grads
of any float dtype scaled by ``grad_factor``, tiling for cache-friendly CPU execution, and,
for LAMB, a hook that all-reduces the squared norms so shards can call it directly. On CPU,
half weights with the optimizers' hashed stochastic rounding
(:class:`~popbert.optimizers.stochastic_rounding.HashedRounding`) skip the working copies for
large pieces: compiled loops read the half weights and grads and write the rounded weights,
bit-identical to the copying path (see "fused half steps" below).

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

import logging
import math
import struct
import threading
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from popbert.optimizers.stochastic_rounding import (
    COMPILE_MIN_NUMEL,
    COMPILE_OPTIONS,
    HashedRounding,
    compilation_enabled,
    element_counter,
    finish_hashed_fp16,
    hashed_round_bf16_bits,
    hashed_round_fp16_bits,
)

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
    "default_tile_numel",
    "tile_plan",
]

logger = logging.getLogger(__name__)


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
    denoms = list(torch._foreach_sqrt(exp_avg_sqs))  # noqa: SLF001
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


# ----------------------------------------------------------------------------- whole steps

#: ``round_fn(values, outs, pieces)`` writes flat FP32 ``values`` into the half tensors ``outs``
#: (their concatenation); ``pieces[k] = (i, start)``: ``outs[k]`` holds elements ``start...`` of
#: fragment ``i`` of the step's lists, so counter-based stochastic rounding knows each element's
#: index (see :func:`popbert.optimizers.stochastic_rounding.hashed_round_fn`).
RoundFn = Callable[[Tensor, list[Tensor], list[tuple[int, int]]], None]
TilePlan = list[list[tuple[int, int, int]]]
CPU_TILE_NUMEL = 1 << 21


def default_tile_numel(device: torch.device) -> int | None:
    """Tile size for :func:`adamw_step_` / :func:`lamb_step_` on ``device``.

    On CPU, running every op of the step over tiles of 2M elements (8 MiB per FP32 array)
    keeps the working set near the cache and avoids full-size temporaries: about 2x faster
    than whole-tensor foreach ops for BERT-Base. Smaller tiles fit cache better but multiply
    the parallel regions, which costs on busy or many-core machines. Accelerators take whole
    tensors: fewer, larger kernels.
    """
    return CPU_TILE_NUMEL if torch.device(device).type == "cpu" else None


def tile_plan(
    sizes: Sequence[int], tile_numel: int | None, splittable: Sequence[bool] | None = None
) -> TilePlan:
    """Cut tensors (by element count) into tiles of about ``tile_numel`` elements.

    Each tile is a list of ``(tensor_index, start, stop)`` over the flattened tensors; small
    tensors share a tile, large ones are split unless ``splittable[i]`` is False (then they
    form one piece however large). ``tile_numel=None`` gives one tile of whole tensors.
    """
    if tile_numel is None:
        return [[(i, 0, n) for i, n in enumerate(sizes)]] if sizes else []
    if tile_numel < 1:
        raise ValueError(f"tile_numel must be positive, got {tile_numel}")
    tiles: TilePlan = []
    current: list[tuple[int, int, int]] = []
    filled = 0
    for i, n in enumerate(sizes):
        if splittable is not None and not splittable[i]:
            current.append((i, 0, n))
            filled += n
        else:
            start = 0
            while start < n:
                stop = min(n, start + max(tile_numel - filled, 1))
                current.append((i, start, stop))
                filled += stop - start
                start = stop
                if filled >= tile_numel:
                    tiles.append(current)
                    current, filled = [], 0
                    continue
        if filled >= tile_numel:
            tiles.append(current)
            current, filled = [], 0
    if current:
        tiles.append(current)
    return tiles


def _take(tensors: Sequence[Tensor], tile: list[tuple[int, int, int]]) -> list[Tensor]:
    pieces = []
    for i, start, stop in tile:
        t = tensors[i]
        pieces.append(t if start == 0 and stop == t.numel() else t.view(-1)[start:stop])
    return pieces


def _fp32_copy(pieces: list[Tensor], scale: float = 1.0) -> tuple[Tensor, list[Tensor]]:
    """One flat FP32 buffer holding ``pieces * scale``, and views of it shaped like them."""
    sizes = [t.numel() for t in pieces]
    flat = torch.empty(sum(sizes), dtype=torch.float32, device=pieces[0].device)
    views = [c.view(t.shape) for c, t in zip(flat.split(sizes), pieces, strict=True)]
    torch._foreach_copy_(views, pieces)
    if scale != 1.0:
        flat.mul_(scale)
    return flat, views


class _Tile:
    """FP32 working views of one tile: weights (copied if half), grads (copied if scaled)."""

    def __init__(
        self,
        tile: list[tuple[int, int, int]],
        params: list[Tensor],
        grads: list[Tensor],
        exp_avgs: list[Tensor],
        exp_avg_sqs: list[Tensor],
        steps: Sequence[int],
    ) -> None:
        self.tile = tile
        self.index = [i for i, _, _ in tile]
        self.steps = [steps[i] for i in self.index]
        self.params = _take(params, tile)
        self.exp_avgs = _take(exp_avgs, tile)
        self.exp_avg_sqs = _take(exp_avg_sqs, tile)
        self._grads = _take(grads, tile)
        self._flat: Tensor | None = None
        self._views: list[Tensor] = []

    def grads(self, grad_factor: float) -> list[Tensor]:
        if grad_factor == 1.0 and all(g.dtype == torch.float32 for g in self._grads):
            return self._grads
        return _fp32_copy(self._grads, grad_factor)[1]

    def weights(self) -> list[Tensor]:
        if self.params[0].dtype == torch.float32:
            return self.params
        self._flat, self._views = _fp32_copy(self.params)
        return self._views

    def store(self, round_fn: RoundFn | None) -> None:
        """Write FP32 working weights back into half parameters (round to nearest without
        ``round_fn``), telling the rounding where each element belongs."""
        if self._flat is None:
            return
        if round_fn is None:
            torch._foreach_copy_(self.params, self._views)
        else:
            round_fn(self._flat, self.params, [(i, start) for i, start, _ in self.tile])
        self._flat, self._views = None, []


def _tiles(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    tile_numel: int | None,
) -> TilePlan:
    if len({p.dtype for p in params}) > 1:
        raise ValueError("one call takes parameters of one dtype")
    splittable = [
        all(t.is_contiguous() for t in group)
        for group in zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)
    ]
    return tile_plan([p.numel() for p in params], tile_numel, splittable)


# ----------------------------------------------------------------------------- fused half steps
#
# Half weights with counter-based stochastic rounding skip the FP32 copies of weights and grads
# and most passes over the state: per large piece, one compiled loop updates the FP32 moments in
# place from the half (or FP32) gradient, torch's own ``sqrt`` takes the second moment (its CPU
# kernel, MKL's, is not correctly rounded and a compiled one would be: it stays eager so the
# result is the unfused path's), and a second compiled loop computes the update from the half
# weight and its stochastic rounding (the hash of key and element index, as the rounding kernel
# draws it), writing FP32 patterns of the rounded values that one copy converts into the half
# parameter exactly (FP16's rare values below 2**-33 then take the exact path). The arithmetic is
# the eager path's, operation for operation, in FP32 with the same FP32 scalars; where torch's
# CPU kernels fuse a multiply-add (lerp, addcmul's last step, add with alpha) the loops use an
# FMA too. So weights and moments are bit-identical to the unfused path: checked on first use
# against it on a probe (a torch build whose kernels round differently keeps the unfused path)
# and tested. LAMB's per-tensor norms stay on torch's reductions (of the FP32 update and of the
# FP32 weights the first pass writes), between a first and a second compiled pass.

# FP32 scalars of one piece, in this order (as the eager ops cast their Python scalars).
_LERP, _B2, _C2, _GSCALE, _EPS, _DIV, _DECAY, _STEP, _WD = range(9)
_fused_kernels: dict[str, Callable[..., object]] = {}
_fused_failed = False
_fused_checked: dict[tuple[object, ...], bool] = {}


def _fma(a: Tensor, b: Tensor, c: Tensor) -> Tensor:
    """``a * b + c`` rounded once (Inductor's fused multiply-add; only ever compiled)."""
    return torch.ops.prims.fma(a.expand_as(b), b, c)


def _moments_kernel(g: Tensor, m: Tensor, v: Tensor, hp: Tensor, lerp_end: bool) -> None:
    """``m.lerp_(g, 1 - b1)`` and ``v.mul_(b2).addcmul_(g, g, 1 - b2)`` in place, as torch's CPU
    kernels compute them: lerp ``fma(w, g - m, m)`` (``fma(w - 1, g - m, g)`` for
    ``w >= 0.5``), addcmul ``fma(c g, g, v)``; ``g`` widened and scaled first."""
    g = g.float() * hp[_GSCALE]
    m_new = _fma(hp[_LERP], g - m, g if lerp_end else m)
    v_new = _fma(hp[_C2] * g, g, v * hp[_B2])
    m.copy_(m_new)
    v.copy_(v_new)


def _round_into(w: Tensor, counter: Tensor, args: Tensor, out: Tensor, fp16: bool
                ) -> Tensor | None:
    """Stochastic rounding of new FP32 weights ``w`` (element indices ``counter + args[0]``,
    keys ``args[1:]``) into int32 ``out``: FP32 patterns that convert to the half values
    exactly. FP16 returns whether some lanes are left to the exact path."""
    index = counter + args[0]
    if fp16:
        patterns, any_tiny = hashed_round_fp16_bits(w, index, args[1], args[2])
        out.copy_(patterns)
        return any_tiny
    out.copy_(hashed_round_bf16_bits(w, index, args[1], args[2]))
    return None


def _adamw_kernel(p: Tensor, m: Tensor, root: Tensor, hp: Tensor, counter: Tensor,
                  args: Tensor, out: Tensor, fp16: bool) -> Tensor | None:
    """``w * (1 - lr wd) + (-lr c) m / (sqrt(v) + eps')`` (mul, then addcdiv), rounded."""
    w = p.float() * hp[_DECAY] + hp[_STEP] * m / (root + hp[_EPS])
    return _round_into(w, counter, args, out, fp16)


def _lamb_update_kernel(p: Tensor, m: Tensor, root: Tensor, hp: Tensor, out: Tensor,
                        widened: Tensor, decay: bool) -> None:
    """LAMB's ``u = m / ((sqrt(v) + eps') / c) + wd w`` (the last step an FMA) into ``out``,
    and the FP32 weights into ``widened`` (for their norm)."""
    w = p.float()
    u = m / ((root + hp[_EPS]) / hp[_DIV])
    if decay:
        u = _fma(hp[_WD], w, u)
    out.copy_(u)
    widened.copy_(w)


def _apply_kernel(p: Tensor, u: Tensor, hp: Tensor, counter: Tensor, args: Tensor,
                  out: Tensor, fp16: bool) -> Tensor | None:
    """``w + alpha u`` as ``Tensor.add_(u, alpha=...)`` computes it (an FMA), rounded."""
    return _round_into(_fma(hp[0], u, p.float()), counter, args, out, fp16)


_KERNEL_FNS: dict[str, Callable[..., None]] = {
    "moments": _moments_kernel,
    "adamw": _adamw_kernel,
    "lamb_update": _lamb_update_kernel,
    "apply": _apply_kernel,
}


def _run_fused(name: str, *operands: object) -> object:
    fn = _fused_kernels.get(name)
    if fn is None:
        import torch._inductor.inductor_prims  # noqa: F401 - registers torch.ops.prims.fma

        fn = torch.compile(_KERNEL_FNS[name], dynamic=True, options=COMPILE_OPTIONS)
        _fused_kernels[name] = fn
    return fn(*operands)


def _flat_piece(t: Tensor, start: int, stop: int) -> Tensor:
    """Elements ``start:stop`` of contiguous ``t`` as a flat alias without autograd flags or a
    view base: the compiled kernels guard on those, and every parameter would otherwise
    compile its own variant."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() + start, (stop - start,), (1,))


def _f32(value: float) -> float:
    """``value`` as torch's CPU kernels use a Python scalar on FP32 tensors (rounded once)."""
    return struct.unpack("f", struct.pack("f", value))[0]


class _Scratch:
    """A reusable flat FP32 buffer (one per step call: no allocation per piece)."""

    def __init__(self) -> None:
        self._buf: Tensor | None = None

    def get(self, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=torch.float32)
        return _flat_piece(self._buf.view(dtype), 0, n)


class _FusedPiece:
    """One large piece of a half-weight step: flat aliases of weight, grad and moments, and
    the piece's rounding counter (key and index of its first element)."""

    def __init__(self, piece: tuple[int, int, int], lists: Sequence[list[Tensor]],
                 rounding: HashedRounding, scratch: _Scratch) -> None:
        i, start, stop = piece
        self.i = i
        self.n = stop - start
        self.p, self.g, self.m, self.v = (_flat_piece(t[i], start, stop) for t in lists)
        self.key = rounding.key(i)
        self.base = rounding.base(i, start)
        if self.base < 0 or self.base + self.n - 1 > (1 << 31) - 1:
            raise ValueError(f"element indices {self.base}..{self.base + self.n - 1} "
                             "exceed the int32 counter")
        self.args = torch.tensor([self.base, *self.key], dtype=torch.int32)
        self.scratch = scratch

    def moments(self, hp: Tensor, lerp_end: bool) -> Tensor:
        """Update the moments in place; returns ``sqrt(v)`` (torch's kernel, see above)."""
        _run_fused("moments", self.g, self.m, self.v, hp, lerp_end)
        return torch.sqrt(self.v)

    def write(self, name: str, operands: tuple[object, ...]) -> None:
        """Run kernel ``name``: it writes FP32 patterns of the rounded weights into the
        scratch buffer, and one copy converts them into the half parameter (exactly); FP16's
        rare tiny lanes are then rounded by the exact path."""
        fp16 = self.p.dtype == torch.float16
        any_tiny = _run_fused(name, *operands, element_counter(self.n), self.args,
                              self.scratch.get(self.n, torch.int32), fp16)
        values = self.scratch.get(self.n)
        self.p.copy_(values)
        if fp16 and bool(any_tiny):
            finish_hashed_fp16(values, self.p, self.key, self.base)


def _moment_scalars(beta1: float, beta2: float, step: int, eps: float, bias_correction: bool,
                    grad_factor: float) -> tuple[list[float], bool]:
    """A piece's FP32 scalars for the moments and the denominator, and lerp's branch."""
    weight = _f32(1.0 - beta1)
    lerp_end = not abs(weight) < 0.5  # torch's is_lerp_weight_small
    hp = [1.0] * 9
    hp[_LERP] = weight - 1.0 if lerp_end else weight  # exact in FP32 (Sterbenz)
    hp[_B2] = _f32(beta2)
    hp[_C2] = _f32(1.0 - beta2)
    hp[_GSCALE] = _f32(grad_factor)
    bc2 = _bias_corrections(beta2, [step], bias_correction)[0]
    hp[_EPS] = _f32(eps * math.sqrt(bc2) if bias_correction else eps)
    return hp, lerp_end


def _fused_adamw(piece: _FusedPiece, step: int, *, lr: float, beta1: float, beta2: float,
                 eps: float, weight_decay: float, bias_correction: bool,
                 grad_factor: float) -> None:
    hp, lerp_end = _moment_scalars(beta1, beta2, step, eps, bias_correction, grad_factor)
    if weight_decay != 0.0:
        hp[_DECAY] = _f32(1.0 - lr * weight_decay)
    hp[_STEP] = _f32(-lr * adam_direction_scales([step], beta1, beta2, bias_correction)[0])
    scalars = torch.tensor(hp, dtype=torch.float32)
    root = piece.moments(scalars, lerp_end)
    piece.write("adamw", (piece.p, piece.m, root, scalars))


def _fused_lamb_update(piece: _FusedPiece, step: int, widened: Tensor, *, beta1: float,
                       beta2: float, eps: float, weight_decay: float, bias_correction: bool,
                       grad_factor: float) -> Tensor:
    """LAMB's first pass: moments in place, the FP32 weights into ``widened``; returns the
    FP32 update ``u`` (flat)."""
    hp, lerp_end = _moment_scalars(beta1, beta2, step, eps, bias_correction, grad_factor)
    if bias_correction:
        hp[_DIV] = _f32(adam_direction_scales([step], beta1, beta2, True)[0])
    hp[_WD] = _f32(weight_decay)
    scalars = torch.tensor(hp, dtype=torch.float32)
    root = piece.moments(scalars, lerp_end)
    _run_fused("lamb_update", piece.p, piece.m, root, scalars, root, widened,
               weight_decay != 0.0)
    return root  # the update, written over sqrt(v)


def _fused_apply(piece: _FusedPiece, update: Tensor, alpha: float) -> None:
    """``w += alpha u`` (``alpha`` cast as ``Tensor.add_`` casts it), then rounded."""
    piece.write("apply", (piece.p, update, torch.tensor([alpha], dtype=torch.float32)))


_probe = threading.local()  # .mode: "fused" / "unfused" while a probe runs (see _fusable)


def _fusable(round_fn: RoundFn | None, lists: Sequence[list[Tensor]], plan: TilePlan,
             probe: Callable[[], tuple[list[Tensor], list[Tensor]]], key: tuple[object, ...]
             ) -> HashedRounding | None:
    """The hashed rounding to fuse into the step, or None for the unfused path.

    The first call of each kind (kernel, dtypes, flags) with pieces to fuse runs ``probe``
    (the same step on small random tensors) fused and unfused and fuses only if they agree
    bit for bit: a torch build whose CPU kernels round differently (no FMA, say) keeps the
    unfused path. Steps without large pieces compile nothing.
    """
    global _fused_failed
    mode = getattr(_probe, "mode", None)
    if mode is not None:
        return round_fn if mode == "fused" else None  # type: ignore[return-value]
    params, grads = lists[0], lists[1]
    if _fused_failed or not isinstance(round_fn, HashedRounding) or not compilation_enabled():
        return None
    if not params or params[0].device.type != "cpu":
        return None  # Inductor's CPU loops are what was measured and checked
    if params[0].dtype not in (torch.float16, torch.bfloat16):
        return None
    if not any(_split_tile(tile, lists, round_fn)[0] for tile in plan):
        return None
    key = (*key, params[0].dtype, tuple(sorted({str(g.dtype) for g in grads})))
    ok = _fused_checked.get(key)
    if ok is None:
        try:
            ok = _probe_agrees(probe)
        except Exception:  # no C++ compiler, unsupported platform...: unfused is exact too
            logger.warning("compiling the fused half-weight optimizer step failed; using the "
                           "unfused step (same results, slower)", exc_info=True)
            _fused_failed = True
            return None
        if not ok:
            logger.warning("the fused half-weight optimizer step does not reproduce the unfused "
                           "one bit for bit with this torch build (%s); using the unfused step",
                           key)
        _fused_checked[key] = ok
    return round_fn if ok else None


def _probe_agrees(probe: Callable[[], tuple[list[Tensor], list[Tensor]]]) -> bool:
    results = []
    for mode in ("fused", "unfused"):
        _probe.mode = mode
        try:
            results.append(probe())
        finally:
            _probe.mode = None
    (w1, s1), (w2, s2) = results
    same = [torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(w1, w2)]
    return all(same) and all(torch.equal(a, b) for a, b in zip(s1, s2, strict=True))


def _probe_inputs(params: list[Tensor], grads: list[Tensor]) -> tuple[list[Tensor], ...]:
    """Fresh random weights, grads and moments like the step's (one piece fused, one not)."""
    gen = torch.Generator().manual_seed(0)
    sizes = [COMPILE_MIN_NUMEL + 37, 53]
    weights = [(torch.randn(n, generator=gen) * 0.05).to(params[0].dtype) for n in sizes]
    grad = [(torch.randn(n, generator=gen) * 1e-3).to(grads[0].dtype) for n in sizes]
    m = [torch.randn(n, generator=gen) * 1e-4 for n in sizes]
    v = [torch.rand(n, generator=gen) * 1e-7 for n in sizes]
    for w in weights:
        w[:5] = 0.0  # exact zeros: LAMB's guards, and FP16 rounding of tiny results
    return weights, grad, m, v


def _split_tile(tile: list[tuple[int, int, int]], lists: Sequence[list[Tensor]],
                fused: HashedRounding | None) -> tuple[list[tuple[int, int, int]],
                                                       list[tuple[int, int, int]]]:
    """(pieces for the fused kernels, the rest): large pieces of contiguous tensors."""
    if fused is None:
        return [], tile
    big, rest = [], []
    for piece in tile:
        i, start, stop = piece
        ok = stop - start >= COMPILE_MIN_NUMEL and all(t[i].is_contiguous() for t in lists)
        (big if ok else rest).append(piece)
    return big, rest


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
) -> None:
    """One AdamW step in place (torch.optim.AdamW's update, computed in FP32).

    ``params`` share one dtype: FP32 is updated in place; FP16/BF16 is widened to FP32 per
    tile and written back with ``round_fn`` (see :data:`RoundFn`; default: round to nearest).
    ``grads`` of any float dtype are widened and multiplied by ``grad_factor`` (unscale, clip)
    without modifying them. Moments are FP32. ``tile_numel``: see :func:`default_tile_numel`.
    """
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    hyper = {"lr": lr, "beta1": beta1, "beta2": beta2, "eps": eps,
             "weight_decay": weight_decay, "bias_correction": bias_correction,
             "grad_factor": grad_factor}

    def probe() -> tuple[list[Tensor], list[Tensor]]:
        w, g, m, v = _probe_inputs(params, grads)
        adamw_step_(w, g, m, v, [3, 3], **hyper, round_fn=HashedRounding(0, [3, 3], [0, 1]))
        return w, m + v

    plan = _tiles(params, grads, exp_avgs, exp_avg_sqs, tile_numel)
    fused = _fusable(round_fn, lists, plan, probe,
                     ("adamw", abs(_f32(1.0 - beta1)) >= 0.5, weight_decay != 0.0))
    scratch = _Scratch()
    for tile in plan:
        big, tile = _split_tile(tile, lists, fused)
        for piece in big:
            assert fused is not None
            _fused_adamw(_FusedPiece(piece, lists, fused, scratch), steps[piece[0]], **hyper)
        if not tile:
            continue
        t = _Tile(tile, params, grads, exp_avgs, exp_avg_sqs, steps)
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
    plan = _tiles(params, grads, exp_avgs, exp_avg_sqs, tile_numel)
    lists = (params, grads, exp_avgs, exp_avg_sqs)
    hyper = {
        "beta1": beta1,
        "beta2": beta2,
        "weight_decay": weight_decay,
        "bias_correction": bias_correction,
    }

    def probe() -> tuple[list[Tensor], list[Tensor]]:
        w, g, m, v = _probe_inputs(params, grads)
        lamb_step_(w, g, m, v, [3, 3], lr=lr, eps=eps, trust_ratio=trust_ratio,
                   max_trust_ratio=max_trust_ratio, max_weight_norm=max_weight_norm,
                   grad_factor=grad_factor, round_fn=HashedRounding(0, [3, 3], [0, 1]),
                   **hyper)
        return w, m + v

    fused = _fusable(round_fn, lists, plan, probe,
                     ("lamb", trust_ratio, abs(_f32(1.0 - beta1)) >= 0.5,
                      weight_decay != 0.0))

    def updates_of(t: _Tile, weights: list[Tensor]) -> list[Tensor]:
        denoms = adam_denominators(t.exp_avg_sqs, t.steps, beta2, eps, bias_correction)
        return lamb_updates(weights, t.exp_avgs, denoms, t.steps, **hyper)

    scratch, widened = _Scratch(), _Scratch()

    def first_pass(tile: list[tuple[int, int, int]]) -> tuple[
            list[tuple[_FusedPiece, Tensor, Tensor]], _Tile | None, list[Tensor], list[Tensor]]:
        """Moments and updates of one tile: (fused pieces with their FP32 updates and weights'
        squared norms, the unfused rest with its FP32 weights and updates)."""
        big, rest = _split_tile(tile, lists, fused)
        done = []
        for piece in big:
            assert fused is not None
            fp = _FusedPiece(piece, lists, fused, scratch)
            w32 = widened.get(fp.n)
            update = _fused_lamb_update(fp, steps[piece[0]], w32, eps=eps,
                                        grad_factor=grad_factor, **hyper)
            # The norm of the FP32 weights, as the unfused path takes it (before w32 is reused).
            done.append((fp, update, per_tensor_sq_norms([w32]) if trust_ratio else None))
        if not rest:
            return done, None, [], []
        t = _Tile(rest, params, grads, exp_avgs, exp_avg_sqs, steps)
        weights = t.weights()
        adam_moments_(t.exp_avgs, t.exp_avg_sqs, t.grads(grad_factor), beta1, beta2)
        return done, t, weights, updates_of(t, weights)

    if not trust_ratio:
        for tile in plan:
            done, t, weights, updates = first_pass(tile)
            for fp, update, _ in done:
                _fused_apply(fp, update, -lr)
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
                    _fused_apply(fp, update, ratio * -lr)  # as apply_updates_ computes it

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
