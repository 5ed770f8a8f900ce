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

Two sources of random bits:

* :func:`stochastic_round` draws them from a ``torch.Generator`` (general use, tests).
* :func:`stochastic_round_hashed` (the optimizers' path) hashes ``(key, element index)`` with a
  counter-based integer hash, where :func:`rounding_key` derives the key from ``(seed, step,
  tensor id)``. No generator state: the bits of an element are a pure function of where it is,
  so a resumed run, or a sharded optimizer that knows each element's index in its tensor,
  rounds exactly as the original. The whole rounding (hash, add, truncate, convert) is one
  elementwise int32 expression, compiled with ``torch.compile`` into a single multithreaded,
  vectorised loop for large tensors (torch's CPU generator is single-threaded and was 2-3x the
  cost of an FP32 optimizer step); the eager fallback evaluates the same expression and gives
  bit-identical results. FP16 inputs below ``2**-24`` (rare) take the exact Bernoulli path,
  with its digits hashed from the same key. The optimizers' fused half-weight step traces the
  same expression into its own loops (:func:`hashed_round_bf16_bits`,
  :func:`hashed_round_fp16_bits`, :func:`finish_hashed_fp16`), keyed through
  :class:`HashedRounding`.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

__all__ = [
    "COMPILE_MIN_NUMEL",
    "COMPILE_OPTIONS",
    "ROUNDING_SCHEME",
    "HashedRounding",
    "RoundFn",
    "compilation_enabled",
    "element_counter",
    "flat_alias",
    "finish_hashed_fp16",
    "hash_bits",
    "hashed_round_bf16_bits",
    "hashed_round_fp16_bits",
    "hashed_round_fn",
    "rounding_key",
    "stochastic_round",
    "stochastic_round_hashed",
]

logger = logging.getLogger(__name__)

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


def _exact_bernoulli(
    p: Tensor,
    generator: torch.Generator | None,
    digits: Callable[[int], Tensor] | None = None,
) -> Tensor:
    """Draw ``True`` with probability exactly ``p`` (FP32 values in [0, 1); NaN gives False).

    ``p`` is compared digit by digit, 24 bits at a time, against a uniform random number of
    unbounded precision; a tie on one digit defers to the next. FP32 probabilities are finite
    binary fractions, so six digits make the draw exact. ``digits(d)`` supplies the ``d``-th
    digit of every lane (integers in ``[0, 2**24)``); by default they come from ``generator``.
    """
    result = torch.zeros(p.shape, dtype=torch.bool, device=p.device)
    active = torch.ones(p.shape, dtype=torch.bool, device=p.device)
    frac = p
    for d in range(_BERNOULLI_DIGITS):
        scaled = frac * _DIGIT  # exact: multiplication by a power of two without overflow
        digit = torch.floor(scaled)
        if digits is None:
            raw = torch.randint(
                0, 1 << 24, p.shape, device=p.device, dtype=torch.int32, generator=generator
            )
        else:
            raw = digits(d)
        u = raw.float()  # integers below 2**24 are exact in FP32
        result |= active & (u < digit)
        active &= u == digit
        frac = scaled - digit
    return result


def _round_fp16_subnormal(
    x: Tensor,
    generator: torch.Generator | None,
    digits: Callable[[int], Tensor] | None = None,
) -> Tensor:
    """Stochastic rounding onto the fixed grid ``k * 2**-24`` (FP16 subnormals), NaN kept.

    ``|x| * 2**24`` is exact, so this is integer stochastic rounding of a value below 1024
    with an exact Bernoulli draw for the fractional part, however small.
    """
    scaled = x.abs() * _FP16_SUBNORMAL_SCALE
    whole = torch.floor(scaled)
    up = _exact_bernoulli(scaled - whole, generator, digits)
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


# ----------------------------------------------------------------------------- counter-based bits

_MASK32 = (1 << 32) - 1
_MASK64 = (1 << 64) - 1
_MIX_1 = 0x7FEB352D  # lowbias32 multipliers (C. Wellons, hash-prospector), as int32
_MIX_2 = 0x846CA68B - (1 << 32)
_DIGIT_STRIDE = 0x9E3779B9  # golden-ratio step between the keys of Bernoulli digits
#: Tensors (pieces) with at least this many elements use the compiled kernel; smaller ones the
#: eager expression (same bits; a compiled call costs tens of microseconds of dispatch).
COMPILE_MIN_NUMEL = 1 << 15
_MAX_INDEX = (1 << 31) - 1
_FP16_TINY_EXPONENT = 103  # biased FP32 exponent of 2**-24, FP16's smallest subnormal
_FP16_NORMAL_EXPONENT = 113  # of 2**-14, FP16's smallest normal
_FP16_EXACT_EXPONENT = 94  # of 2**-33: below it 32 random bits cannot decide exactly
_FP16_TINY_BITS = _FP16_TINY_EXPONENT << 23  # FP32 pattern of 2**-24
_SIGN_BIT = -(1 << 31)
_QUIET_NAN_BIT = 1 << 22

Key = tuple[int, int]
#: Names the bit source in optimizer checkpoints (older ones carry generator states instead).
ROUNDING_SCHEME = "hash-lowbias32x2-v1"


def _int32(value: int) -> int:
    value &= _MASK32
    return value - (1 << 32) if value >= 1 << 31 else value


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def rounding_key(seed: int, step: int, tensor_id: int) -> Key:
    """The 64-bit key (two int32 halves) of one tensor's rounding at one optimizer step.

    SplitMix64 chained over ``seed``, ``step`` and ``tensor_id``: any change of one gives an
    unrelated key, so steps and tensors draw independent bits from the same seed.
    """
    z = _splitmix64(seed & _MASK64)
    z = _splitmix64(z ^ (step & _MASK64))
    z = _splitmix64(z ^ (tensor_id & _MASK64))
    return _int32(z), _int32(z >> 32)


def _mix32(h: Tensor) -> Tensor:
    """lowbias32, an invertible 32-bit avalanche mixer, in wrapping int32 arithmetic (the
    masks turn torch's arithmetic right shifts into logical ones)."""
    h = h ^ ((h >> 16) & 0xFFFF)
    h = h * _MIX_1
    h = h ^ ((h >> 15) & 0x1FFFF)
    h = h * _MIX_2
    return h ^ ((h >> 16) & 0xFFFF)


def hash_bits(index: Tensor, key: tuple[int | Tensor, int | Tensor]) -> Tensor:
    """32 pseudo-random bits (int32) per element index: two keyed rounds of lowbias32.

    A bijection of ``index`` for a fixed key (distinct elements of a tensor get distinct 32-bit
    values) and, through the second keyed round, unrelated bit streams for different keys.
    """
    return _mix32(_mix32(index ^ key[0]) ^ key[1])


_counters: dict[torch.device, Tensor] = {}


def element_counter(n: int, device: torch.device | str = "cpu") -> Tensor:
    """``arange(n)`` as int32, a read-only alias of one cached buffer per device.

    Compiled rounding loops add the first element's index to it instead of generating the
    indices: on CPU, Inductor's vector ``arange`` costs more than the whole hash; loading them
    costs less. Never write to the result.
    """
    device = torch.device(device)
    buf = _counters.get(device)
    if buf is None or buf.numel() < n:
        buf = torch.arange(max(n, 1 << 16), dtype=torch.int32, device=device)
        _counters[device] = buf
    return torch.empty(0, dtype=torch.int32, device=device).set_(
        buf.untyped_storage(), 0, (n,), (1,))


def flat_alias(t: Tensor, start: int = 0, stop: int | None = None) -> Tensor:
    """Elements ``start:stop`` of contiguous ``t`` as a flat alias without autograd flags or
    a view base. Compiled loops guard on those: given views, every parameter (or every kind
    of base) would compile its own variant."""
    stop = t.numel() if stop is None else stop
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset() + start, (stop - start,), (1,))


def _index(counter: Tensor, args: Tensor) -> Tensor:
    return counter + args[0]


def _bf16_round_bits(bits: Tensor, index: Tensor, key0: Tensor | int,
                     key1: Tensor | int) -> Tensor:
    """FP32 patterns of the BF16 values of FP32 patterns ``bits`` (low 16 bits zero).

    Adds 16 random bits below BF16's last mantissa bit and truncates them (the conversion is
    then exact). NaN lanes skip the add (it could carry out of their payload) and are
    quietened, so they stay NaN whatever the conversion does with the payload.
    """
    noise = hash_bits(index, (key0, key1)) & 0xFFFF
    nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return torch.where(nan, bits | _QUIET_NAN_BIT, (bits + noise) & -65536)


def _bf16_round(bits: Tensor, index: Tensor, key0: Tensor | int, key1: Tensor | int) -> Tensor:
    """BF16 values of FP32 patterns ``bits`` (elementwise; keys scalar or per element)."""
    return _bf16_round_bits(bits, index, key0, key1).view(torch.float32).to(torch.bfloat16)


def _fp16_round(
    bits: Tensor, index: Tensor, key0: Tensor | int, key1: Tensor | int
) -> tuple[Tensor, Tensor]:
    """FP16 values of FP32 patterns ``bits``, and the lanes left to the exact path."""
    rounded, tiny = _fp16_round_bits(bits, index, key0, key1)
    return rounded.view(torch.float32).to(torch.float16), tiny


def _fp16_round_bits(
    bits: Tensor, index: Tensor, key0: Tensor | int, key1: Tensor | int
) -> tuple[Tensor, Tensor]:
    """FP32 patterns of the FP16 values of FP32 patterns ``bits`` (converting them is exact),
    and the lanes left to the exact path.

    FP16's spacing is ``2**13`` FP32 patterns from its smallest normal up; below it the spacing
    is the constant ``2**-24``, i.e. ``2**(13 + 113 - e)`` patterns at biased exponent ``e``
    down to ``2**-24`` (``e = 103``): those lanes get that many random bits. Below ``2**-24``
    the result is 0 or ``2**-24`` with probability ``|x| / 2**-24 = m * 2**(e - 126)`` (``m``
    the 24-bit significand): a 32-bit draw decides it exactly while that is a multiple of
    ``2**-32`` (``e >= 94``); only nonzero inputs below ``2**-33`` are flagged for the exact
    multi-digit path.
    """
    noise = hash_bits(index, (key0, key1))
    magnitude = bits & 0x7FFFFFFF
    exponent = magnitude >> 23
    low_bits = (_FP16_NORMAL_EXPONENT - exponent).clamp(0, 10) + 13
    low_mask = torch.bitwise_left_shift(torch.ones_like(low_bits), low_bits) - 1
    grid = (bits + (noise & low_mask)) & ~low_mask
    # Unsigned 32-bit compare in int32: flipping the sign bits orders them as unsigned.
    significand = (magnitude & 0x7FFFFF) | 0x800000
    shift = (exponent - _FP16_EXACT_EXPONENT).clamp(0, 8)
    threshold = torch.bitwise_left_shift(significand, shift)  # below 2**32 (wraps to int32)
    up = (noise ^ _SIGN_BIT) < (threshold ^ _SIGN_BIT)
    below = (bits & _SIGN_BIT) | (up.to(torch.int32) * _FP16_TINY_BITS)
    rounded = torch.where(exponent < _FP16_TINY_EXPONENT, below, grid)
    return torch.where(magnitude > 0x7F800000, bits, rounded), _fp16_tiny(bits)  # NaN kept


def _fp16_tiny(bits: Tensor) -> Tensor:
    """Nonzero lanes below ``2**-33``: left to the exact multi-digit Bernoulli path."""
    magnitude = bits & 0x7FFFFFFF
    return (magnitude < (_FP16_EXACT_EXPONENT << 23)) & (magnitude != 0)


def _bf16_kernel(bits: Tensor, counter: Tensor, args: Tensor, out: Tensor) -> None:
    """One tensor's slice: ``args`` = [offset of its first element, key0, key1]. ``out``
    (int32) receives FP32 patterns of the rounded values: the narrowing conversion is left to
    an eager copy, which costs less than Inductor's bit cast feeding its conversion."""
    out.copy_(_bf16_round_bits(bits, _index(counter, args), args[1], args[2]))


def _fp16_kernel(bits: Tensor, counter: Tensor, args: Tensor, out: Tensor) -> Tensor:
    rounded, tiny = _fp16_round_bits(bits, _index(counter, args), args[1], args[2])
    out.copy_(rounded)
    return tiny.any()


_KERNELS: dict[torch.dtype, Callable[..., object]] = {
    torch.bfloat16: _bf16_kernel,
    torch.float16: _fp16_kernel,
}
_compiled_kernels: dict[torch.dtype, Callable[..., object]] = {}
#: Inductor options of every compiled rounding loop (and the optimizers' fused step): loops
#: read the thread count at run time. Compiled for a fixed count, a loop cached (in process or
#: on disk) under one ``torch.set_num_threads`` was seen running serially under another.
COMPILE_OPTIONS: dict[str, object] = {"cpp.dynamic_threads": True}
_compile_disabled = os.environ.get("POPBERT_SR_COMPILE", "1") == "0"


def _run_kernel(
    dtype: torch.dtype, bits: Tensor, args: Tensor, out: Tensor, compiled: bool | None
) -> object:
    """Round into ``out`` (1-D, contiguous): the kernel writes FP32 patterns of the rounded
    values, converted exactly by one copy; FP16 returns whether some lanes are tiny."""
    global _compile_disabled
    kernel = _KERNELS[dtype]
    forced = compiled is True
    if compiled is None:
        compiled = not _compile_disabled and bits.numel() >= COMPILE_MIN_NUMEL
    patterns = torch.empty(bits.shape[0], dtype=torch.int32, device=bits.device)
    counter = element_counter(bits.shape[0], bits.device)
    fn = kernel
    if compiled:
        fn = _compiled_kernels.get(dtype)
        if fn is None:
            fn = torch.compile(kernel, dynamic=True, options=COMPILE_OPTIONS)
            _compiled_kernels[dtype] = fn
    try:
        any_tiny = fn(bits, counter, args, patterns)
    except Exception:  # no C++ compiler, unsupported platform...: the eager path is exact too
        if forced or fn is kernel:
            raise
        logger.warning("compiling the stochastic-rounding kernel failed; using eager torch "
                       "(same bits, slower)", exc_info=True)
        _compile_disabled = True
        any_tiny = kernel(bits, counter, args, patterns)
    out.copy_(patterns.view(torch.float32))
    return any_tiny


def stochastic_round_hashed(
    x: Tensor,
    dtype: torch.dtype,
    key: Key,
    offset: int = 0,
    *,
    out: Tensor | None = None,
    compiled: bool | None = None,
) -> Tensor:
    """Stochastic rounding of FP32 ``x`` to ``dtype`` with counter-based random bits.

    Element ``i`` of ``x`` (row-major) is element ``offset + i`` of its tensor and draws its
    bits from ``hash_bits(offset + i, key)``, so rounding a tensor whole or in slices (tiles,
    shards) gives the same result. Same guarantees as :func:`stochastic_round`: exact
    probabilities, unbiased, special values kept. ``out`` (``dtype``, ``x``'s number of
    elements, any shape) receives the result. ``compiled``: ``None`` compiles for tensors of at
    least :data:`COMPILE_MIN_NUMEL` elements (``POPBERT_SR_COMPILE=0`` turns that off),
    ``True`` / ``False`` force it; both give identical bits.
    """
    x = _check_input(x, dtype)
    n = x.numel()
    if out is not None and (out.dtype != dtype or out.numel() != n):
        raise ValueError(f"out must be {dtype} with {n} elements, got {out.dtype} with "
                         f"{out.numel()}")
    if dtype == torch.float32:
        if out is not None:
            out.copy_(x.view(out.shape))
            return out
        return x
    if offset < 0 or offset + n - 1 > _MAX_INDEX:
        raise ValueError(f"element indices {offset}..{offset + n - 1} exceed the int32 counter")
    flat = x.reshape(-1)
    bits = flat.view(torch.int32)
    args = torch.tensor([offset, key[0], key[1]], dtype=torch.int32, device=x.device)
    direct = out is not None and out.is_contiguous()
    if direct:
        # A flat alias without autograd flags or a view base: the compiled kernel guards on
        # those, and every parameter (piece) would otherwise compile its own variant.
        result = torch.empty(0, dtype=dtype, device=x.device).set_(
            out.untyped_storage(), out.storage_offset(), (n,), (1,))
    else:
        result = torch.empty(n, dtype=dtype, device=x.device)
    with torch.no_grad():
        if n > 0:
            any_tiny = _run_kernel(dtype, bits, args, result, compiled)
            if dtype == torch.float16 and bool(any_tiny):
                lanes = _tiny_lanes(bits)
                index = lanes.to(torch.int32) + offset
                _round_fp16_tiny_lanes(flat, result, lanes, index, key[0], key[1])
    if out is None:
        return result.view(x.shape)
    if not direct:
        out.copy_(result.view(out.shape))
    return out


def _tiny_lanes(bits: Tensor) -> Tensor:
    """Flat indices of the lanes :func:`_fp16_tiny` flags (rare: eager is fine)."""
    return _fp16_tiny(bits).nonzero().squeeze(1)


def _round_fp16_tiny_lanes(
    flat: Tensor,
    result: Tensor,
    lanes: Tensor,
    index: Tensor,
    key0: Tensor | int,
    key1: Tensor | int,
) -> None:
    """Exact rounding of the tiny ``lanes`` of ``flat`` into ``result``, with Bernoulli digits
    hashed from each lane's element ``index`` and key (per lane, or scalars)."""

    def digits(d: int) -> Tensor:
        step = _int32((d + 1) * _DIGIT_STRIDE)
        digit_key0 = key0 + step if isinstance(key0, Tensor) else _int32(key0 + step)
        return (hash_bits(index, (digit_key0, key1)) >> 8) & 0xFFFFFF  # int32 add wraps

    values = _round_fp16_subnormal(flat.index_select(0, lanes), None, digits)
    result.index_copy_(0, lanes, values.to(torch.float16))


#: ``round_fn(values, outs, pieces)`` writes flat FP32 ``values`` into the half tensors ``outs``
#: (their concatenation); ``pieces[k] = (i, start)``: ``outs[k]`` holds elements ``start...`` of
#: fragment ``i`` of the step's lists, so counter-based stochastic rounding knows each element's
#: index (see :func:`hashed_round_fn`).
RoundFn = Callable[[Tensor, list[Tensor], list[tuple[int, int]]], None]


def _round_small(values: list[Tensor], outs: list[Tensor], bases: list[int],
                 keys: list[Key]) -> None:
    """Round several small slices in one eager pass (same elementwise arithmetic as the
    per-tensor kernel, with per-element indices and keys, so the same bits): small tensors
    (biases, norms) would otherwise cost a few dozen small torch calls each."""
    device = values[0].device
    sizes = [v.numel() for v in values]
    flat = torch.cat([v.reshape(-1) for v in values])
    counts = torch.tensor(sizes, device=device)
    starts = torch.tensor(bases, dtype=torch.int32, device=device)
    first = torch.tensor([0, *sizes[:-1]], device=device).cumsum(0).to(torch.int32)
    lane = torch.arange(flat.numel(), dtype=torch.int32, device=device)
    index = lane + (starts - first).repeat_interleave(counts)
    key0 = torch.tensor([k[0] for k in keys], dtype=torch.int32,
                        device=device).repeat_interleave(counts)
    key1 = torch.tensor([k[1] for k in keys], dtype=torch.int32,
                        device=device).repeat_interleave(counts)
    bits = flat.view(torch.int32)
    dtype = outs[0].dtype
    if dtype == torch.bfloat16:
        result = _bf16_round(bits, index, key0, key1)
    else:
        result, tiny = _fp16_round(bits, index, key0, key1)
        lanes = tiny.nonzero().squeeze(1)
        if lanes.numel():
            _round_fp16_tiny_lanes(flat, result, lanes, index.index_select(0, lanes),
                                   key0.index_select(0, lanes), key1.index_select(0, lanes))
    chunks = result.split(sizes)
    torch._foreach_copy_(outs, [c.view(o.shape) for c, o in zip(chunks, outs, strict=True)])


class HashedRounding:
    """A ``round_fn`` for :mod:`popbert.optimizers.steps`, rounding stochastically.

    Fragment ``i`` of the step's lists is part of tensor ``tensor_ids[i]`` starting at element
    ``offsets[i]`` (0 by default) and is at optimizer step ``steps[i]``: its bits depend on
    ``(seed, steps[i], tensor_ids[i], element index)`` only. Called as a ``RoundFn``, pieces of
    at least :data:`COMPILE_MIN_NUMEL` elements take the compiled kernel one by one, smaller
    ones one batched eager pass. :meth:`key` and :meth:`base` expose the counter, so a step
    can round inside its own fused kernel and draw the very same bits.
    """

    def __init__(
        self,
        seed: int,
        steps: Sequence[int],
        tensor_ids: Sequence[int],
        offsets: Sequence[int] | None = None,
    ) -> None:
        self.seed = seed
        self.steps = steps
        self.tensor_ids = tensor_ids
        self.offsets = offsets

    def key(self, i: int) -> Key:
        """The rounding key of fragment ``i`` at its step."""
        return rounding_key(self.seed, self.steps[i], self.tensor_ids[i])

    def base(self, i: int, start: int) -> int:
        """Index in its tensor of element ``start`` of fragment ``i``."""
        return (0 if self.offsets is None else self.offsets[i]) + start

    def __call__(self, values: Tensor, outs: list[Tensor], pieces: list[tuple[int, int]]) -> None:
        small: tuple[list[Tensor], list[Tensor], list[int], list[Key]] = ([], [], [], [])
        offset = 0
        for out, (i, start) in zip(outs, pieces, strict=True):
            n = out.numel()
            part = values[offset:offset + n]
            offset += n
            key = self.key(i)
            base = self.base(i, start)
            if n >= COMPILE_MIN_NUMEL:
                stochastic_round_hashed(part, out.dtype, key, base, out=out)
            else:
                for collected, item in zip(small, (part, out, base, key), strict=True):
                    collected.append(item)
        if small[0]:
            _round_small(*small)


def hashed_round_fn(
    seed: int,
    steps: Sequence[int],
    tensor_ids: Sequence[int],
    offsets: Sequence[int] | None = None,
) -> HashedRounding:
    """The :class:`HashedRounding` of one step's fragments (a ``RoundFn``)."""
    return HashedRounding(seed, steps, tensor_ids, offsets)


def hashed_round_bf16_bits(values: Tensor, index: Tensor, key0: Tensor | int,
                           key1: Tensor | int) -> Tensor:
    """BF16 stochastic rounding of FP32 ``values`` at element indices ``index`` (int32), as
    the int32 patterns of FP32 numbers that convert to BF16 exactly (``.to(torch.bfloat16)``
    of their float view is the rounded value).

    The elementwise expression :func:`stochastic_round_hashed` evaluates (same bits for the
    same key and indices), for callers that trace it into their own compiled loop, e.g. the
    optimizers' fused half-weight step. Leaving the narrowing conversion to a separate eager
    copy is faster on CPU: Inductor's bit cast feeding a BF16 conversion costs more than the
    extra pass. Keys are scalars (int or int32 tensors) or per element.
    """
    return _bf16_round_bits(values.view(torch.int32), index, key0, key1)


def hashed_round_fp16_bits(values: Tensor, index: Tensor, key0: Tensor | int,
                           key1: Tensor | int) -> tuple[Tensor, Tensor]:
    """FP16 counterpart of :func:`hashed_round_bf16_bits`: int32 patterns of FP32 numbers
    that convert to the FP16 stochastic rounding exactly, and whether any lane is tiny.

    Tiny lanes (nonzero, below ``2**-33``) keep their input pattern: pass the result, viewed
    as float, to :func:`finish_hashed_fp16` after converting it, which rounds them exactly.
    Every other lane holds 0, a value of at least ``2**-24``, an infinity or NaN, so the tiny
    lanes can be told apart afterwards.
    """
    bits = values.view(torch.int32)
    rounded, tiny = _fp16_round_bits(bits, index, key0, key1)
    return torch.where(tiny, bits, rounded), tiny.any()


def finish_hashed_fp16(values: Tensor, out: Tensor, key: Key, offset: int = 0) -> None:
    """Round the tiny lanes of :func:`hashed_round_fp16_bits`' output exactly into ``out``.

    ``values``: that output viewed as FP32 (flat), element ``i`` being element ``offset + i``
    of its tensor under ``key``; ``out``: FP16, flat, holding its conversion. Only needed
    when the kernel reported tiny lanes (rare); same bits as :func:`stochastic_round_hashed`.
    """
    bits = values.view(torch.int32)
    lanes = _tiny_lanes(bits)
    if lanes.numel():
        index = lanes.to(torch.int32) + offset
        _round_fp16_tiny_lanes(values, out, lanes, index, key[0], key[1])


def compilation_enabled() -> bool:
    """Whether stochastic rounding (and the fused half-weight steps) may use ``torch.compile``:
    false under ``POPBERT_SR_COMPILE=0`` or after a compile failed on this platform."""
    return not _compile_disabled
