"""Stochastic rounding: exact neighbours, unbiasedness, special values, reproducibility.

Every property is checked for both bit sources: torch's generator (:func:`stochastic_round`)
and the counter-based hash the optimizers use (:func:`stochastic_round_hashed`, eager here;
one test compares the compiled kernel with it bit for bit).
"""

from __future__ import annotations

import copy

import pytest
import torch

from popbert.optimizers import (
    rounding_key,
    stochastic_round,
    stochastic_round_hashed,
)
from popbert.optimizers.stochastic_rounding import _exact_bernoulli

HALF = [torch.float16, torch.bfloat16]
N_DRAWS = 1_000_000


def _generator_sr(x: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return stochastic_round(x, dtype, torch.Generator().manual_seed(seed))


def _hashed_sr(x: torch.Tensor, dtype: torch.dtype, seed: int) -> torch.Tensor:
    return stochastic_round_hashed(x, dtype, rounding_key(seed, 1, 0), compiled=False)


ROUNDERS = pytest.mark.parametrize("rounder", [_generator_sr, _hashed_sr],
                                   ids=["generator", "hashed"])


def _neighbours(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(toward-zero, away-from-zero) neighbours of FP32 ``x`` in ``dtype``, via nextafter."""
    nearest = x.to(dtype)
    zero = torch.zeros_like(nearest)
    overshoot = nearest.float().abs() > x.abs()
    lo = torch.where(overshoot, torch.nextafter(nearest, zero), nearest)
    away = torch.where(x < 0, torch.full_like(lo, -float("inf")), torch.full_like(lo, float("inf")))
    exact = lo.float() == x
    hi = torch.where(exact, lo, torch.nextafter(lo, away))
    return lo, hi


def _ulp(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    lo, hi = _neighbours(x, dtype)
    return (hi.double() - lo.double()).abs()


def _range_values(dtype: torch.dtype, kind: str, n: int, gen: torch.Generator) -> torch.Tensor:
    """FP32 values between grid points (a quarter-ish ulp above ``lo``) in one range."""
    finfo = torch.finfo(dtype)
    if kind == "small":  # smallest normal binades
        lo_mag, hi_mag = finfo.tiny, finfo.tiny * 64
    elif kind == "subnormal":
        lo_mag, hi_mag = finfo.tiny * 2**-8, finfo.tiny * 0.9
    elif kind == "large":
        lo_mag, hi_mag = finfo.max / 64, finfo.max / 2
    else:  # "unit"
        lo_mag, hi_mag = 0.5, 4.0
    log_mag = torch.empty(n, dtype=torch.float64).uniform_(0, 1, generator=gen)
    mags = torch.exp(
        torch.log(torch.tensor(lo_mag, dtype=torch.float64))
        + log_mag * torch.log(torch.tensor(hi_mag / lo_mag, dtype=torch.float64))
    )
    sign = torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    base = (mags * sign).float().to(dtype)  # grid points
    away = torch.where(base < 0, -float("inf"), float("inf")).to(dtype)
    ulp = (torch.nextafter(base, away).double() - base.double()).abs()  # spacing above |base|
    frac = torch.empty(n, dtype=torch.float64).uniform_(0.05, 0.45, generator=gen)
    values = (base.double() + torch.sign(base.double()) * frac * ulp).float()
    return values[values.abs() < finfo.max]


@ROUNDERS
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", ["unit", "small", "subnormal", "large"])
def test_unbiased_over_a_million_draws_and_rtn_is_biased(
    dtype: torch.dtype, kind: str, rounder
) -> None:
    gen = torch.Generator().manual_seed(17)
    values = _range_values(dtype, kind, 1000, gen)
    x = values.repeat(N_DRAWS // values.numel() + 1)[:N_DRAWS]
    ulp = _ulp(x, dtype)
    assert bool((ulp > 0).all())
    sr = rounder(x, dtype, 1)
    # Error of the magnitude, in ulps, so signs and ranges weigh the same.
    err = (sr.double().abs() - x.double().abs()) / ulp
    mean, stderr = float(err.mean()), float(err.std()) / N_DRAWS**0.5
    assert abs(mean) <= 3 * stderr, (mean, stderr)
    rtn_err = (x.to(dtype).double().abs() - x.double().abs()) / ulp
    assert float(rtn_err.mean()) < -30 * stderr  # frac in (0.05, 0.45): always toward zero


@ROUNDERS
@pytest.mark.parametrize("dtype", HALF)
def test_every_result_is_one_of_the_two_neighbours(dtype: torch.dtype, rounder) -> None:
    gen = torch.Generator().manual_seed(5)
    finfo = torch.finfo(dtype)
    log_mag = torch.empty(200_000).uniform_(
        float(torch.log2(torch.tensor(finfo.tiny))) - 12,
        float(torch.log2(torch.tensor(finfo.max))),
        generator=gen,
    )
    sign = torch.where(torch.rand(log_mag.shape, generator=gen) < 0.5, -1.0, 1.0)
    x = (torch.exp2(log_mag) * sign).float()
    x = x[torch.isfinite(x)]
    lo, hi = _neighbours(x, dtype)
    sr = rounder(x, dtype, 2)
    assert sr.dtype == dtype
    ok = (sr.float() == lo.float()) | (sr.float() == hi.float())
    assert bool(ok.all()), x[~ok][:5]
    # Both neighbours actually occur (it is not just truncation or round-to-nearest).
    inexact = lo != hi
    assert bool((sr[inexact] == hi[inexact]).any()) and bool((sr[inexact] == lo[inexact]).any())


def test_fp16_weight_of_one_accumulates_tiny_updates_only_with_sr() -> None:
    n, steps, update = 10_000, 300, 1e-4  # half an ulp at 1.0 is 4.9e-4
    gen = torch.Generator().manual_seed(0)
    w_sr = torch.ones(n, dtype=torch.float16)
    w_rtn = torch.ones(n, dtype=torch.float16)
    for _ in range(steps):
        w_sr = stochastic_round(w_sr.float() + update, torch.float16, gen)
        w_rtn = (w_rtn.float() + update).to(torch.float16)  # round to nearest
    assert bool((w_rtn == 1.0).all())
    # Per weight a random walk with variance <= steps * ulp^2 / 4: std of the mean ~ 1.7e-4 / 2.
    assert abs(float(w_sr.double().mean()) - (1.0 + steps * update)) < 1e-3


@ROUNDERS
@pytest.mark.parametrize("dtype", HALF)
def test_representable_values_are_unchanged(dtype: torch.dtype, rounder) -> None:
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    every = patterns.view(dtype)  # every bit pattern of the format
    every = every[~torch.isnan(every)]
    out = rounder(every.float(), dtype, 3)
    assert torch.equal(out.view(torch.int16), every.view(torch.int16))  # bit-exact, -0.0 kept


@ROUNDERS
@pytest.mark.parametrize("dtype", HALF)
def test_nan_and_inf(dtype: torch.dtype, rounder) -> None:
    payload_nan = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, 0x7FC00000], dtype=torch.int32)
    x = torch.cat([payload_nan.view(torch.float32), torch.tensor([float("inf"), -float("inf")])])
    x = x.repeat(1000)
    out = rounder(x, dtype, 4).float().view(-1, 6)
    assert bool(torch.isnan(out[:, :4]).all())
    assert bool((out[:, 4] == float("inf")).all()) and bool((out[:, 5] == -float("inf")).all())


@ROUNDERS
@pytest.mark.parametrize("dtype", HALF)
def test_overflow_rounds_to_max_or_inf_in_proportion(dtype: torch.dtype, rounder) -> None:
    finfo = torch.finfo(dtype)
    top = torch.tensor(finfo.max, dtype=dtype)
    ulp = float(top.float()) - float(torch.nextafter(top, torch.tensor(0.0, dtype=dtype)))
    # One ulp above max would be 2**(emax + 1): treat it as infinity's place on the grid.
    beyond = torch.tensor([finfo.max + 0.25 * ulp], dtype=torch.float64).float()
    x = beyond.repeat(200_000)
    out = rounder(x, dtype, 6).float()
    assert bool(((out == finfo.max) | (out == float("inf"))).all())
    frac_inf = float((out == float("inf")).double().mean())
    p = (float(beyond) - finfo.max) / ulp
    assert abs(frac_inf - p) < 4 * (p * (1 - p) / x.numel()) ** 0.5
    if dtype == torch.float16:  # FP32 has finite values a whole ulp beyond FP16's max
        far = torch.tensor([65536.0, 1e5, -7e4])
        assert rounder(far, dtype, 0).float().tolist() == [
            float("inf"),
            float("inf"),
            -float("inf"),
        ]


@ROUNDERS
def test_fp16_below_smallest_subnormal_and_fp32_subnormals(rounder) -> None:
    """|x| < 2**-24 rounds to 0 or 2**-24 with probability |x| / 2**-24 (the exact path)."""
    values = torch.tensor([2.0**-26, -(2.0**-25) * 1.5, 1e-40, 3.0 * 2.0**-30]).float()
    x = values.repeat(250_000)
    out = rounder(x, torch.float16, 8).double()
    assert bool(((out == 0) | (out.abs() == 2.0**-24)).all())
    assert bool((torch.sign(out[out != 0]) == torch.sign(x[out != 0].double())).all())
    per_value = out.view(-1, values.numel()).mean(0)
    expected = values.double()
    stderr = (2.0**-24 * (expected.abs() / 2.0**-24).sqrt()) / 250_000**0.5
    assert bool(((per_value - expected).abs() <= 4 * stderr + 1e-30).all())


def test_exact_bernoulli_probabilities() -> None:
    p = torch.tensor([0.0, 0.3, 0.5, 0.999, 2.0**-20]).float()
    draws = _exact_bernoulli(p.repeat(400_000), torch.Generator().manual_seed(9))
    freq = draws.view(-1, p.numel()).double().mean(0)
    stderr = (p.double() * (1 - p.double()) / 400_000).sqrt()
    assert freq[0] == 0.0
    assert bool(((freq - p.double()).abs() <= 4 * stderr + 1e-12).all())


def test_seeded_and_reproducible() -> None:
    x = torch.randn(10_000) * 3
    a = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(1))
    b = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(1))
    c = stochastic_round(x, torch.bfloat16, torch.Generator().manual_seed(2))
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_input_validation() -> None:
    with pytest.raises(TypeError):
        stochastic_round(torch.zeros(3, dtype=torch.float64), torch.float16)
    with pytest.raises(ValueError):
        stochastic_round(torch.zeros(3), torch.int8)
    x = torch.randn(4)
    assert stochastic_round(x, torch.float32) is x
    half = torch.randn(4).half()
    assert torch.equal(stochastic_round(half, torch.float16), half)  # exact widening path


@ROUNDERS
@pytest.mark.parametrize("dtype", HALF)
def test_non_contiguous_input_matches_contiguous(dtype: torch.dtype, rounder) -> None:
    x = torch.randn(48, 40, generator=torch.Generator().manual_seed(10)) * 1e-3
    x[3, 5] = float("nan")
    x[7, 1] = 3e-6  # FP16 subnormal lane
    xt = x.t()
    assert not xt.is_contiguous()
    a = rounder(xt, dtype, 4)
    b = rounder(xt.contiguous(), dtype, 4)
    assert torch.equal(a.float().nan_to_num(7.0), b.float().nan_to_num(7.0))
    assert bool(torch.isnan(a[5, 3]))


# ----------------------------------------------------------------------------- counter-based bits


def test_hashed_fp16_weight_of_one_accumulates_tiny_updates() -> None:
    n, steps, update = 10_000, 300, 1e-4
    w = torch.ones(n, dtype=torch.float16)
    for step in range(1, steps + 1):  # a new key per step, as the optimizers do
        key = rounding_key(0, step, 0)
        w = stochastic_round_hashed(w.float() + update, torch.float16, key, compiled=False)
    assert abs(float(w.double().mean()) - (1.0 + steps * update)) < 1e-3


@pytest.mark.parametrize("dtype", HALF)
def test_hashed_bits_depend_on_key_and_element_index_only(dtype: torch.dtype) -> None:
    x = torch.randn(5_000, generator=torch.Generator().manual_seed(11)) * 3
    key = rounding_key(7, 3, 2)
    whole = stochastic_round_hashed(x, dtype, key, compiled=False)
    assert torch.equal(whole, stochastic_round_hashed(x, dtype, key, compiled=False))
    # Rounded in slices that know their offset: the same bits (tiles, shards).
    parts = [stochastic_round_hashed(x[a:b], dtype, key, a, compiled=False)
             for a, b in ((0, 1234), (1234, 1235), (1235, 5_000))]
    assert torch.equal(torch.cat(parts), whole)
    # Another seed, step or tensor: other bits (about half the inexact lanes differ).
    for other in (rounding_key(8, 3, 2), rounding_key(7, 4, 2), rounding_key(7, 3, 3)):
        changed = stochastic_round_hashed(x, dtype, other, compiled=False) != whole
        assert 0.3 < float(changed.double().mean()) < 0.7
    shifted = stochastic_round_hashed(x, dtype, key, 1, compiled=False)
    assert not torch.equal(shifted, whole)


def test_rounding_keys_are_distinct_and_int32() -> None:
    keys = {rounding_key(seed, step, tensor)
            for seed in (0, 1, 2**40) for step in range(1, 50) for tensor in range(40)}
    assert len(keys) == 3 * 49 * 40
    assert all(-(2**31) <= k < 2**31 for key in keys for k in key)


def test_hashed_low_bits_are_uniform_and_uncorrelated_between_steps() -> None:
    """The 16 bits BF16 rounding adds: each bit fair, consecutive steps independent."""
    from popbert.optimizers.stochastic_rounding import hash_bits

    index = torch.arange(200_000, dtype=torch.int32)
    a = hash_bits(index, rounding_key(0, 1, 0)) & 0xFFFF
    b = hash_bits(index, rounding_key(0, 2, 0)) & 0xFFFF
    for bit in range(16):
        frac = float(((a >> bit) & 1).double().mean())
        assert abs(frac - 0.5) < 4 * (0.25 / index.numel()) ** 0.5, bit
    corr = torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1]
    assert abs(float(corr)) < 4 / index.numel() ** 0.5
    neighbours = torch.corrcoef(torch.stack([a[:-1].double(), a[1:].double()]))[0, 1]
    assert abs(float(neighbours)) < 4 / index.numel() ** 0.5


def _special_mix(n: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(21)
    x = torch.exp2(torch.empty(n).uniform_(-40, 17, generator=gen))
    x = torch.where(torch.rand(n, generator=gen) < 0.5, -x, x)
    x[::97] = float("nan")
    x[1::89] = float("inf")
    x[2::83] = 0.0
    x[3::79] = 1e-40  # FP32 subnormal
    x[4::73] = 65519.0  # FP16 overflow region
    return x


@pytest.mark.parametrize("dtype", HALF)
def test_compiled_kernel_matches_eager_bit_for_bit(dtype: torch.dtype) -> None:
    """One dynamic-shape compile per dtype, at a small size (compiling on CPU is slow)."""
    x = _special_mix(40_003)  # not a multiple of the vector width: the tail loop too
    key = rounding_key(3, 9, 5)
    eager = stochastic_round_hashed(x, dtype, key, 1_000, compiled=False)
    try:
        compiled = stochastic_round_hashed(x, dtype, key, 1_000, compiled=True)
    except Exception as error:  # noqa: BLE001 - a platform without a working torch.compile
        pytest.skip(f"torch.compile is unavailable here: {type(error).__name__}: {error}")
    assert torch.equal(compiled.view(torch.int16), eager.view(torch.int16))
    other = stochastic_round_hashed(x[:777], dtype, key, 1_000, compiled=True)  # no recompile
    assert torch.equal(other.view(torch.int16), eager[:777].view(torch.int16))


@pytest.mark.parametrize("dtype", HALF)
def test_traceable_round_expressions_match_stochastic_round_hashed(dtype: torch.dtype) -> None:
    """The expressions the fused optimizer step traces into its own loops (FP32 patterns that
    convert exactly, FP16's tiny lanes finished by the exact path) give the same bits as
    stochastic_round_hashed at the same key and element offset (evaluated eagerly here)."""
    from popbert.optimizers.stochastic_rounding import (
        element_counter,
        finish_hashed_fp16,
        hashed_round_bf16_bits,
        hashed_round_fp16_bits,
    )

    x = _special_mix(5_003)  # NaN, inf, zeros, FP32 subnormals (tiny for FP16), overflow
    key, offset = rounding_key(3, 9, 5), 1_000
    expected = stochastic_round_hashed(x, dtype, key, offset, compiled=False)
    counter = element_counter(x.numel())
    assert torch.equal(counter, torch.arange(x.numel(), dtype=torch.int32))
    index = counter + offset
    if dtype == torch.bfloat16:
        values = hashed_round_bf16_bits(x, index, *key).view(torch.float32)
        got = values.to(dtype)
    else:
        patterns, any_tiny = hashed_round_fp16_bits(x, index, *key)
        values = patterns.view(torch.float32)
        got = values.to(dtype)
        assert bool(any_tiny)
        finish_hashed_fp16(values, got, key, offset)
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))


def _half_params(dtype: torch.dtype) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(31)
    shapes = [(37, 11), (29,), (5, 3, 7), (1,)]
    return [torch.nn.Parameter((torch.randn(s, generator=gen) * 0.1).to(dtype)) for s in shapes]


def _grads(params: list[torch.Tensor], step: int) -> None:
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        g = (torch.randn(p.shape, generator=gen) * 0.1).to(p.dtype)
        if p.grad is None:
            p.grad = g
        else:  # keep the tensor: a sharded optimizer's grads are views of its flat buffer
            p.grad.copy_(g)


def test_optimizer_rounding_does_not_depend_on_tiling() -> None:
    """AdamW is elementwise: tiles of 7 elements and whole tensors round identically."""
    from popbert.optimizers import AdamW

    runs = []
    for tile in (None, 7):
        params = _half_params(torch.bfloat16)
        opt = AdamW(params, lr=1e-3, seed=4)
        opt.tile_numel = tile
        for step in range(3):
            _grads(params, step)
            opt.step()
        runs.append(params)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def test_resume_reproduces_rounding_and_old_checkpoints_load(caplog) -> None:
    from popbert.optimizers import Lamb

    def build(seed: int) -> tuple[list[torch.nn.Parameter], Lamb]:
        params = _half_params(torch.float16)
        return params, Lamb(params, lr=1e-2, seed=seed)

    params, opt = build(5)
    for step in range(2):
        _grads(params, step)
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    weights = [p.detach().clone() for p in params]
    later = []
    for step in range(2, 4):
        _grads(params, step)
        opt.step()
        later.append([p.detach().clone() for p in params])
    assert not torch.equal(later[0][0], later[1][0])  # the weights do move

    for old in (False, True):
        resumed_params, resumed = build(99)  # the checkpoint's seed wins
        with torch.no_grad():
            for p, w in zip(resumed_params, weights, strict=True):
                p.copy_(w)
        state = copy.deepcopy(saved)
        if old:  # a checkpoint from the generator-based rounding
            state["popbert_rng"] = {"seed": 5, "generators": {"cpu": torch.get_rng_state()}}
        with caplog.at_level("INFO", logger="popbert.optimizers.optimizer"):
            resumed.load_state_dict(state)
        assert ("older popbert" in caplog.text) == old
        for step, expected in zip(range(2, 4), later, strict=True):
            _grads(resumed_params, step)
            resumed.step()
            for p, w in zip(resumed_params, expected, strict=True):
                assert torch.equal(p, w)


class _OneOfTwoReplicas:
    """Replica ``rank`` of 2 in one process, for the AdamW path (no norm all-reduce): both
    replicas see the same gradients, and each keeps only its own slice of the weights."""

    size = 2

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def reduce_scatter(self, output: torch.Tensor, flat: torch.Tensor) -> torch.Tensor:
        n = output.numel()
        return output.copy_(flat[self.rank * n:(self.rank + 1) * n] * 2)  # the sum of two

    def all_gather(self, flat: torch.Tensor, shard: torch.Tensor) -> torch.Tensor:
        n = shard.numel()
        flat[self.rank * n:(self.rank + 1) * n].copy_(shard)
        return flat

    def all_reduce_(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        raise AssertionError("the AdamW path needs no all-reduce")


@pytest.mark.parametrize("dtype", HALF)
def test_sharded_optimizer_rounds_exactly_like_the_unsharded_one(dtype: torch.dtype) -> None:
    """Stochastic rounding hashes each element's index in its tensor, so two replicas' slices
    (tensors split between them at odd offsets) round to the unsharded optimizer's weights."""
    from popbert.distributed import ShardedOptimizer
    from popbert.optimizers import AdamW

    plain = _half_params(dtype)
    opt = AdamW(plain, lr=1e-3, seed=6)
    shards = []
    for rank in range(2):
        params = _half_params(dtype)
        shards.append((params, ShardedOptimizer(AdamW(params, lr=1e-3, seed=6),
                                                _OneOfTwoReplicas(rank))))
    assert any(not piece.whole for _, s in shards for piece in s.shards[0].pieces)
    for step in range(3):
        _grads(plain, step)
        opt.step()
        for params, sharded in shards:
            sharded.zero_grad()
            _grads(params, step)
            sharded.accumulate()
            sharded.step()
        # Each replica updated its own half of the flat weights: stitch them together.
        (_, s0), (_, s1) = shards
        half = s0.shards[0].shard_size
        s0.shards[0].weights[half:].copy_(s1.shards[0].weights[half:])
        s1.shards[0].weights[:half].copy_(s0.shards[0].weights[:half])
    for a, b in zip(shards[0][0], plain, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", HALF)
def test_round_fn_batches_small_pieces_with_the_same_bits(monkeypatch, dtype) -> None:
    """Pieces below the compile threshold are rounded in one batched pass: same bits as one
    call per piece (per-element indices and keys, FP16's exact tiny-value path included)."""
    from popbert.optimizers import hashed_round_fn
    from popbert.optimizers import stochastic_rounding as sr

    monkeypatch.setattr(sr, "COMPILE_MIN_NUMEL", 50)  # pieces of 60 and 100: per piece
    monkeypatch.setattr(sr, "_compile_disabled", True)  # ... in eager torch
    sizes = [10, 100, 3, 60, 1, 7]
    values = _special_mix(sum(sizes))
    values[5] = 2.0**-30  # below FP16's smallest subnormal
    steps, ids, offsets = [3, 3, 4, 3, 9, 3], [0, 1, 2, 3, 4, 5], [0, 5, 0, 100, 0, 2]
    outs = [torch.empty(n, dtype=dtype) for n in sizes]
    starts = [0, 7, 0, 0, 0, 11]
    hashed_round_fn(11, steps, ids, offsets)(values, outs, list(enumerate(starts)))
    for k, part in enumerate(values.split(sizes)):
        key = rounding_key(11, steps[k], ids[k])
        expected = stochastic_round_hashed(part, dtype, key, offsets[k] + starts[k],
                                           compiled=False)
        assert torch.equal(outs[k].view(torch.int16), expected.view(torch.int16)), k
