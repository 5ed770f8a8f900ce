"""Compiled CPU kernels for half-weight optimizer steps with hashed stochastic rounding.

A large piece of an FP16/BF16 weight skips the FP32 working copies of the unfused path: compiled
loops update the moments from the half grad and write the stochastically rounded half weights,
doing the eager ops' arithmetic operation for operation, so the results are bit-identical (how:
``docs/design.md``, Optimizers). A torch build whose kernels round differently would break that,
so :func:`fusable` checks each kind of step once with :func:`probe_agrees`, which runs it on
small tensors along the fused and the unfused path and compares the bits.
"""

from __future__ import annotations

import logging
import math
import struct
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from popbert.optimizers.functional import adam_direction_scales, bias_corrections
from popbert.optimizers.stochastic_rounding import (
    COMPILE_MIN_NUMEL,
    COMPILE_OPTIONS,
    HashedRounding,
    RoundFn,
    compilation_enabled,
    element_counter,
    finish_hashed_fp16,
    flat_alias,
    hashed_round_bf16_bits,
    hashed_round_fp16_bits,
)
from popbert.optimizers.tiling import TilePlan

__all__ = ["DYNAMO_LIMITS", "FusedPiece", "Scratch", "StepRunner", "adamw_piece", "apply_piece",
           "f32", "fusable", "lamb_update_piece", "probe_agrees", "split_tile"]

logger = logging.getLogger(__name__)

# FP32 scalars of one piece, in this order (as the eager ops cast their Python scalars).
_LERP, _B2, _C2, _GSCALE, _EPS, _DIV, _DECAY, _STEP, _WD = range(9)
_fused_kernels: dict[str, Callable[..., object]] = {}
_fused_failed = False
_fused_checked: dict[tuple[object, ...], bool] = {}
# Dynamo runs a function eagerly once it has compiled it `recompile_limit` times (8 by default,
# counting every dtype, flag and global state such as grad mode it was called under), and
# eager `prims.fma` rounds twice: past the limit the fused step would silently stop matching
# the unfused one by an ulp. A kernel meets a few dozen such variants at most, so its calls get
# a higher limit, and reaching even that is an error rather than an eager run.
DYNAMO_LIMITS: dict[str, object] = {"recompile_limit": 64, "fail_on_recompile_limit_hit": True}


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
        from torch._inductor import inductor_prims  # noqa: F401 - registers prims.fma

        fn = torch.compile(_KERNEL_FNS[name], dynamic=True, options=COMPILE_OPTIONS)
        _fused_kernels[name] = fn
    with torch._dynamo.config.patch(DYNAMO_LIMITS):
        return fn(*operands)


def f32(value: float) -> float:
    """``value`` as torch's CPU kernels use a Python scalar on FP32 tensors (rounded once)."""
    return struct.unpack("f", struct.pack("f", value))[0]


class Scratch:
    """A reusable flat FP32 buffer (one per step call: no allocation per piece)."""

    def __init__(self) -> None:
        self._buf: Tensor | None = None

    def get(self, n: int, dtype: torch.dtype = torch.float32) -> Tensor:
        if self._buf is None or self._buf.numel() < n:
            self._buf = torch.empty(n, dtype=torch.float32)
        return flat_alias(self._buf.view(dtype), 0, n)


class FusedPiece:
    """One large piece of a half-weight step: flat aliases of weight, grad and moments, and
    the piece's rounding counter (key and index of its first element)."""

    def __init__(self, piece: tuple[int, int, int], lists: Sequence[list[Tensor]],
                 rounding: HashedRounding, scratch: Scratch) -> None:
        i, start, stop = piece
        self.i = i
        self.n = stop - start
        self.p, self.g, self.m, self.v = (flat_alias(t[i], start, stop) for t in lists)
        self.key = rounding.key(i)
        self.base = rounding.base(i, start)
        if self.base < 0 or self.base + self.n - 1 > (1 << 31) - 1:
            raise ValueError(f"element indices {self.base}..{self.base + self.n - 1} "
                             "exceed the int32 counter")
        self.args = torch.tensor([self.base, *self.key], dtype=torch.int32)
        self.scratch = scratch

    def moments(self, hp: Tensor, lerp_end: bool) -> Tensor:
        """Update the moments in place; returns ``sqrt(v)`` (torch's eager kernel: MKL's is not
        correctly rounded and a compiled one would be, so it stays eager)."""
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
    weight = f32(1.0 - beta1)
    lerp_end = not abs(weight) < 0.5  # torch's is_lerp_weight_small
    hp = [1.0] * 9
    hp[_LERP] = weight - 1.0 if lerp_end else weight  # exact in FP32 (Sterbenz)
    hp[_B2] = f32(beta2)
    hp[_C2] = f32(1.0 - beta2)
    hp[_GSCALE] = f32(grad_factor)
    bc2 = bias_corrections(beta2, [step], bias_correction)[0]
    hp[_EPS] = f32(eps * math.sqrt(bc2) if bias_correction else eps)
    return hp, lerp_end


def adamw_piece(piece: FusedPiece, step: int, *, lr: float, beta1: float, beta2: float,
                eps: float, weight_decay: float, bias_correction: bool,
                grad_factor: float) -> None:
    """The whole AdamW step of one piece: moments in place, then the rounded weights."""
    hp, lerp_end = _moment_scalars(beta1, beta2, step, eps, bias_correction, grad_factor)
    if weight_decay != 0.0:
        hp[_DECAY] = f32(1.0 - lr * weight_decay)
    hp[_STEP] = f32(-lr * adam_direction_scales([step], beta1, beta2, bias_correction)[0])
    scalars = torch.tensor(hp, dtype=torch.float32)
    root = piece.moments(scalars, lerp_end)
    piece.write("adamw", (piece.p, piece.m, root, scalars))


def lamb_update_piece(piece: FusedPiece, step: int, widened: Tensor, *, beta1: float,
                      beta2: float, eps: float, weight_decay: float, bias_correction: bool,
                      grad_factor: float) -> Tensor:
    """LAMB's first pass: moments in place, the FP32 weights into ``widened``; returns the
    FP32 update ``u`` (flat)."""
    hp, lerp_end = _moment_scalars(beta1, beta2, step, eps, bias_correction, grad_factor)
    if bias_correction:
        hp[_DIV] = f32(adam_direction_scales([step], beta1, beta2, True)[0])
    hp[_WD] = f32(weight_decay)
    scalars = torch.tensor(hp, dtype=torch.float32)
    root = piece.moments(scalars, lerp_end)
    _run_fused("lamb_update", piece.p, piece.m, root, scalars, root, widened,
               weight_decay != 0.0)
    return root  # the update, written over sqrt(v)


def apply_piece(piece: FusedPiece, update: Tensor, alpha: float) -> None:
    """``w += alpha u`` (``alpha`` cast as ``Tensor.add_`` casts it), then rounded."""
    piece.write("apply", (piece.p, update, torch.tensor([alpha], dtype=torch.float32)))


#: ``run_step(params, grads, exp_avgs, exp_avg_sqs, steps, round_fn, fuse)``: one whole step
#: over one tile of whole tensors, fusing large pieces with ``fuse`` (``None``: the unfused path).
StepRunner = Callable[[list[Tensor], list[Tensor], list[Tensor], list[Tensor], list[int],
                       HashedRounding, HashedRounding | None], None]


def fusable(round_fn: RoundFn | None, lists: Sequence[list[Tensor]], plan: TilePlan,
            key: tuple[object, ...], run_step: StepRunner) -> HashedRounding | None:
    """The hashed rounding to fuse into the step, or None for the unfused path.

    The first call of each kind (``key``: kernel and flags; dtypes are added) with pieces to
    fuse checks ``run_step`` with :func:`probe_agrees` and fuses only if it passes: a torch
    build whose CPU kernels round differently (no FMA, say) keeps the unfused path. Steps
    without large pieces compile nothing.
    """
    global _fused_failed
    params, grads = lists[0], lists[1]
    if _fused_failed or not isinstance(round_fn, HashedRounding) or not compilation_enabled():
        return None
    if not params or params[0].device.type != "cpu":
        return None  # Inductor's CPU loops are what was measured and checked
    if params[0].dtype not in (torch.float16, torch.bfloat16):
        return None
    if not any(split_tile(tile, lists, round_fn)[0] for tile in plan):
        return None
    key = (*key, params[0].dtype, tuple(sorted({str(g.dtype) for g in grads})))
    ok = _fused_checked.get(key)
    if ok is None:
        try:
            ok = probe_agrees(run_step, params[0].dtype, grads[0].dtype)
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


def probe_agrees(run_step: StepRunner, dtype: torch.dtype, grad_dtype: torch.dtype) -> bool:
    """Run ``run_step`` on the same small random tensors (one piece large enough to fuse, one
    not) fused, then unfused; True when weights and moments agree bit for bit."""
    results = []
    for fuse in (True, False):
        w, g, m, v = _probe_inputs(dtype, grad_dtype)
        rounding = HashedRounding(0, [3, 3], [0, 1])
        run_step(w, g, m, v, [3, 3], rounding, rounding if fuse else None)
        results.append((w, m + v))
    (w1, s1), (w2, s2) = results
    same = [torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(w1, w2)]
    return all(same) and all(torch.equal(a, b) for a, b in zip(s1, s2, strict=True))


def _probe_inputs(dtype: torch.dtype, grad_dtype: torch.dtype) -> tuple[list[Tensor], ...]:
    """Fresh random weights, grads and moments of the step's dtypes."""
    gen = torch.Generator().manual_seed(0)
    sizes = [COMPILE_MIN_NUMEL + 37, 53]
    weights = [(torch.randn(n, generator=gen) * 0.05).to(dtype) for n in sizes]
    grad = [(torch.randn(n, generator=gen) * 1e-3).to(grad_dtype) for n in sizes]
    m = [torch.randn(n, generator=gen) * 1e-4 for n in sizes]
    v = [torch.rand(n, generator=gen) * 1e-7 for n in sizes]
    for w in weights:
        w[:5] = 0.0  # exact zeros: LAMB's guards, and FP16 rounding of tiny results
    return weights, grad, m, v


def split_tile(tile: list[tuple[int, int, int]], lists: Sequence[list[Tensor]],
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
