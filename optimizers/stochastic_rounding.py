"""Exact, seeded stochastic rounding of FP32 tensors to FP16 / BF16.

Half-precision weights updated with round-to-nearest lose every update smaller than half an ulp
(a weight of 1.0 in FP16 never moves under updates of 1e-4). Stochastic rounding picks one of
the two neighbouring representable values with probability proportional to proximity, so the
rounding error is zero on average and small updates accumulate in expectation. This is what
lets popbert keep FP16/BF16 weights with FP32 optimizer moments and no FP32 master copy.

Rounding works on the IEEE-754 bit pattern of the FP32 input: consecutive values of the target
format are ``2**k`` FP32 patterns apart and the FP32 value is linear in the pattern between
them, so adding ``k`` uniform random bits to the low ``k`` bits of the pattern and truncating
them rounds away from zero with probability exactly ``|x - lo| / (hi - lo)``:

* BF16 shares FP32's exponent range, so ``k = 16`` everywhere (subnormals included).
* FP16 has ``k = 13`` in its normal range (and above it). Below ``2**-14`` FP16's spacing is a
  constant ``2**-24``; those rare lanes are rounded as integers of ``x * 2**24`` with an exact
  multi-digit Bernoulli draw, which also covers inputs far below the smallest FP16 subnormal.

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
_FP16_MIN_NORMAL = 2.0**-14  # below it FP16's spacing is a constant 2**-24
_FP16_SUBNORMAL_SCALE = 2.0**24
# A probability held in FP32 is a binary fraction of at most 24 + 125 bits below the point
# (24 significant bits, smallest exponent -149, scaled by 2**24), exhausted after 6 digits of 24.
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
    """Draw ``True`` with probability exactly ``p`` (FP32 values in [0, 1); NaN gives False).

    ``p`` is compared digit by digit, 24 bits at a time, against a uniform random number of
    unbounded precision; a tie on one digit defers to the next. FP32 probabilities are finite
    binary fractions, so six digits make the draw exact.
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


def _round_fp16_subnormal(x: Tensor, generator: torch.Generator | None) -> Tensor:
    """Stochastic rounding onto the fixed grid ``k * 2**-24`` (FP16 subnormals), NaN kept.

    ``|x| * 2**24`` is exact, so this is integer stochastic rounding of a value below 1024
    with an exact Bernoulli draw for the fractional part, however small.
    """
    scaled = x.abs() * _FP16_SUBNORMAL_SCALE
    whole = torch.floor(scaled)
    up = _exact_bernoulli(scaled - whole, generator)
    magnitude = (whole + up.float()) / _FP16_SUBNORMAL_SCALE  # NaN stays NaN
    return torch.copysign(magnitude, x)


def stochastic_round(
    x: Tensor, dtype: torch.dtype, generator: torch.Generator | None = None
) -> Tensor:
    """Round FP32 ``x`` to ``dtype`` (float16 / bfloat16) stochastically and without bias.

    Each element becomes one of its two neighbours in ``dtype`` with probability proportional to
    proximity (``P(hi) = (x - lo) / (hi - lo)``), so ``E[result] == x`` exactly for values in
    range. Representable values, infinities and NaN are returned unchanged; values beyond the
    largest finite number overflow to infinity as described in the module docstring.
    ``generator`` (on ``x``'s device) makes the draw reproducible. ``dtype=float32`` returns
    ``x`` itself. Costs one host synchronisation (a check for rare special lanes).
    """
    x = _check_input(x, dtype)
    if dtype == torch.float32:
        return x
    bits = x.view(torch.int32)
    low_bits = 16 if dtype == torch.bfloat16 else 13
    noise = torch.empty(x.shape, dtype=torch.int32, device=x.device)
    # Lanes the bit trick cannot take: NaN (whose low payload bits would truncate to inf or
    # overflow the integer add) and, for FP16, its subnormal range where the ulp is fixed.
    special: Tensor | None = None
    if dtype == torch.float16:
        magnitude = torch.abs(x, out=noise.view(torch.float32))  # noise as scratch space
        special = torch.ge(magnitude, _FP16_MIN_NORMAL).logical_not_()  # NaN fails ">="
    elif not bool(torch.isfinite(x.sum())):  # cheap NaN-free proof for the common case
        special = torch.isnan(x)
    lanes = None  # flat indices of the special lanes
    if special is not None:
        lanes = special.reshape(-1).nonzero().squeeze(1)
        if lanes.numel() == 0:
            lanes = None

    noise.random_(0, 1 << low_bits, generator=generator)
    flat_noise = noise.view(-1)
    if lanes is not None:
        flat_noise.index_fill_(0, lanes, 0)
    noise.add_(bits).bitwise_and_(-(1 << low_bits))
    out = noise.view(torch.float32)
    if lanes is not None:
        values = x.reshape(-1).index_select(0, lanes)
        if dtype == torch.float16:
            values = _round_fp16_subnormal(values, generator)
        out.view(-1).index_copy_(0, lanes, values)  # bfloat16: only NaN lanes, kept as they are
    return out.to(dtype)  # exact: every value lies on the target grid (or overflows to inf)


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
