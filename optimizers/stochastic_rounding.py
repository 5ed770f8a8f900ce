"""Exact, seeded stochastic rounding of FP32 tensors to FP16 / BF16.

Half-precision weights updated with round-to-nearest lose every update smaller than half an ulp
(a weight of 1.0 in FP16 never moves under updates of 1e-4). Stochastic rounding picks one of
the two neighbouring representable values with probability proportional to proximity, so the
rounding error is zero on average and small updates accumulate in expectation. This is what
lets popbert keep FP16/BF16 weights with FP32 optimizer moments and no FP32 master copy.

Both paths work on the IEEE-754 bit pattern of the FP32 input, where consecutive values of the
target format are a fixed number of FP32 patterns apart inside one FP32 binade and the FP32 value
is linear in the pattern there. Adding ``k`` uniform random bits to the low ``k`` bits of the
pattern and truncating them rounds away from zero with probability exactly
``|x - lo| / (hi - lo)``:

* BF16 shares FP32's exponent range, so ``k = 16`` everywhere (subnormals included).
* FP16 has ``k = 13`` in its normal range and a larger ``k`` (up to 23) in its subnormal range,
  where the spacing is a constant ``2**-24``. Inputs below ``2**-24`` (whose neighbours are 0
  and ``2**-24``) use an exact multi-word Bernoulli draw instead.

Overflow follows IEEE semantics: a value between the largest finite number and the next
(unrepresentable) grid point rounds to the largest finite value or to infinity with the same
proportional probabilities; anything beyond becomes infinity. NaN stays NaN, infinities and
representable values are unchanged.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["stochastic_round", "round_to_dtype"]

_HALF_DTYPES = (torch.float16, torch.bfloat16)
_BF16_LOW_MASK = (1 << 16) - 1
_FP16_MIN_SUBNORMAL = 2.0**-24
# Biased FP32 exponent of 2**-24: below it the FP16 neighbours straddle FP32 binades.
_FP16_TINY_EXPONENT = 127 - 24
# FP32 has 24 significant bits and a smallest exponent of -149, so a probability |x| * 2**24 of
# an FP32 input is a multiple of 2**-125 and is exhausted after ceil(125 / 24) = 6 digits.
_BERNOULLI_DIGITS = 6
_DIGIT = float(1 << 24)


def _check_input(x: Tensor, dtype: torch.dtype) -> Tensor:
    if dtype not in _HALF_DTYPES and dtype != torch.float32:
        raise ValueError(f"stochastic_round targets float16, bfloat16 or float32, not {dtype}")
    if x.dtype == torch.float32:
        return x
    if x.dtype in _HALF_DTYPES:
        return x.float()  # exact widening
    raise TypeError(
        f"stochastic_round expects a float32 tensor (got {x.dtype}); converting from a wider "
        "type first would round twice"
    )


def _exact_bernoulli(p: Tensor, generator: torch.Generator | None) -> Tensor:
    """Draw ``True`` with probability exactly ``p`` (FP32 values in [0, 1)).

    ``p`` is compared digit by digit, 24 bits at a time, against a uniform random number of
    unbounded precision; a tie on one digit defers to the next. FP32 probabilities are finite
    binary fractions of at most 125 bits, so six digits make the draw exact.
    """
    result = torch.zeros(p.shape, dtype=torch.bool, device=p.device)
    active = torch.ones(p.shape, dtype=torch.bool, device=p.device)
    frac = p
    for _ in range(_BERNOULLI_DIGITS):
        scaled = frac * _DIGIT  # exact: multiplication by a power of two without overflow
        digit = torch.floor(scaled)
        u = torch.randint(
            0, 1 << 24, p.shape, device=p.device, dtype=torch.int32, generator=generator
        ).float()  # integers below 2**24 are exact in FP32
        result |= active & (u < digit)
        active &= u == digit
        frac = scaled - digit
    return result


def _round_bf16(x: Tensor, generator: torch.Generator | None) -> Tensor:
    bits = x.view(torch.int32)
    nan = torch.isnan(x)
    noise = torch.randint(
        0, 1 << 16, x.shape, device=x.device, dtype=torch.int32, generator=generator
    )
    noise.masked_fill_(nan, 0)  # NaN patterns near 0x7FFFFFFF must not overflow the int32 add
    out = ((bits + noise) & ~_BF16_LOW_MASK).view(torch.float32)
    out = torch.where(nan, x, out)  # a NaN payload living in the low bits would truncate to inf
    return out.to(torch.bfloat16)  # exact: the low 16 bits are zero


def _round_fp16(x: Tensor, generator: torch.Generator | None) -> Tensor:
    bits = x.view(torch.int32)
    nan = torch.isnan(x)
    exponent = (bits >> 23) & 0xFF
    # Number of FP32 mantissa bits below one FP16 ulp: 13 in FP16's normal range (and above, so
    # overflow rounds towards 65536 -> inf), 126 - exponent in its subnormal range (spacing 2**-24).
    shift = torch.clamp(126 - exponent, min=13, max=23)
    low_mask = (1 << shift) - 1
    noise = torch.randint(
        0, 1 << 23, x.shape, device=x.device, dtype=torch.int32, generator=generator
    )
    noise &= low_mask
    noise.masked_fill_(nan, 0)
    out = ((bits + noise) & ~low_mask).view(torch.float32)
    out = torch.where(nan, x, out)
    tiny = exponent < _FP16_TINY_EXPONENT  # |x| < 2**-24, zeros and FP32 subnormals included
    if bool(tiny.any()):
        xt = x[tiny]
        up = _exact_bernoulli(xt.abs() * _DIGIT, generator)  # |x| / 2**-24, exact
        magnitude = torch.where(up, _FP16_MIN_SUBNORMAL, 0.0).to(torch.float32)
        out[tiny] = torch.copysign(magnitude, xt)
    return out.to(torch.float16)  # exact: every value lies on the FP16 grid (or overflows to inf)


def stochastic_round(
    x: Tensor, dtype: torch.dtype, generator: torch.Generator | None = None
) -> Tensor:
    """Round FP32 ``x`` to ``dtype`` (float16 / bfloat16) stochastically and without bias.

    Each element becomes one of its two neighbours in ``dtype`` with probability proportional to
    proximity (``P(hi) = (x - lo) / (hi - lo)``), so ``E[result] == x`` exactly for values in
    range. Representable values, infinities and NaN are returned unchanged; values beyond the
    largest finite number overflow to infinity as described in the module docstring.
    ``generator`` (on ``x``'s device) makes the draw reproducible. ``dtype=float32`` returns
    ``x`` itself.
    """
    x = _check_input(x, dtype)
    if dtype == torch.float32:
        return x
    if dtype == torch.bfloat16:
        return _round_bf16(x, generator)
    return _round_fp16(x, generator)


def round_to_dtype(
    x: Tensor,
    dtype: torch.dtype,
    stochastic: bool,
    generator: torch.Generator | None = None,
) -> Tensor:
    """Convert FP32 ``x`` to ``dtype`` with stochastic rounding or round-to-nearest-even."""
    if stochastic:
        return stochastic_round(x, dtype, generator)
    return x.to(dtype)
