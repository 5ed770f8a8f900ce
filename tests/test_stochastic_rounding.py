"""Stochastic rounding: exact neighbours, unbiasedness, special values, reproducibility."""

from __future__ import annotations

import pytest
import torch

from popbert.optimizers import round_to_dtype, stochastic_round
from popbert.optimizers.stochastic_rounding import _exact_bernoulli

HALF = [torch.float16, torch.bfloat16]
N_DRAWS = 1_000_000


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


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("kind", ["unit", "small", "subnormal", "large"])
def test_unbiased_over_a_million_draws_and_rtn_is_biased(dtype: torch.dtype, kind: str) -> None:
    gen = torch.Generator().manual_seed(17)
    values = _range_values(dtype, kind, 1000, gen)
    x = values.repeat(N_DRAWS // values.numel() + 1)[:N_DRAWS]
    ulp = _ulp(x, dtype)
    assert bool((ulp > 0).all())
    sr = stochastic_round(x, dtype, torch.Generator().manual_seed(1))
    # Error of the magnitude, in ulps, so signs and ranges weigh the same.
    err = (sr.double().abs() - x.double().abs()) / ulp
    mean, stderr = float(err.mean()), float(err.std()) / N_DRAWS**0.5
    assert abs(mean) <= 3 * stderr, (mean, stderr)
    rtn_err = (x.to(dtype).double().abs() - x.double().abs()) / ulp
    assert float(rtn_err.mean()) < -30 * stderr  # frac in (0.05, 0.45): always toward zero


@pytest.mark.parametrize("dtype", HALF)
def test_every_result_is_one_of_the_two_neighbours(dtype: torch.dtype) -> None:
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
    sr = stochastic_round(x, dtype, torch.Generator().manual_seed(2))
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
        w_rtn = round_to_dtype(w_rtn.float() + update, torch.float16, stochastic=False)
    assert bool((w_rtn == 1.0).all())
    # Per weight a random walk with variance <= steps * ulp^2 / 4: std of the mean ~ 1.7e-4 / 2.
    assert abs(float(w_sr.double().mean()) - (1.0 + steps * update)) < 1e-3


@pytest.mark.parametrize("dtype", HALF)
def test_representable_values_are_unchanged(dtype: torch.dtype) -> None:
    patterns = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    every = patterns.view(dtype)  # every bit pattern of the format
    every = every[~torch.isnan(every)]
    out = stochastic_round(every.float(), dtype, torch.Generator().manual_seed(3))
    assert torch.equal(out.view(torch.int16), every.view(torch.int16))  # bit-exact, -0.0 kept


@pytest.mark.parametrize("dtype", HALF)
def test_nan_and_inf(dtype: torch.dtype) -> None:
    payload_nan = torch.tensor([0x7F800001, 0x7FFFFFFF, -1, 0x7FC00000], dtype=torch.int32)
    x = torch.cat([payload_nan.view(torch.float32), torch.tensor([float("inf"), -float("inf")])])
    x = x.repeat(1000)
    out = stochastic_round(x, dtype, torch.Generator().manual_seed(4)).float().view(-1, 6)
    assert bool(torch.isnan(out[:, :4]).all())
    assert bool((out[:, 4] == float("inf")).all()) and bool((out[:, 5] == -float("inf")).all())


@pytest.mark.parametrize("dtype", HALF)
def test_overflow_rounds_to_max_or_inf_in_proportion(dtype: torch.dtype) -> None:
    finfo = torch.finfo(dtype)
    top = torch.tensor(finfo.max, dtype=dtype)
    ulp = float(top.float()) - float(torch.nextafter(top, torch.tensor(0.0, dtype=dtype)))
    # One ulp above max would be 2**(emax + 1): treat it as infinity's place on the grid.
    beyond = torch.tensor([finfo.max + 0.25 * ulp], dtype=torch.float64).float()
    x = beyond.repeat(200_000)
    out = stochastic_round(x, dtype, torch.Generator().manual_seed(6)).float()
    assert bool(((out == finfo.max) | (out == float("inf"))).all())
    frac_inf = float((out == float("inf")).double().mean())
    p = (float(beyond) - finfo.max) / ulp
    assert abs(frac_inf - p) < 4 * (p * (1 - p) / x.numel()) ** 0.5
    if dtype == torch.float16:  # FP32 has finite values a whole ulp beyond FP16's max
        far = torch.tensor([65536.0, 1e5, -7e4])
        assert stochastic_round(far, dtype).float().tolist() == [
            float("inf"),
            float("inf"),
            -float("inf"),
        ]


def test_fp16_below_smallest_subnormal_and_fp32_subnormals() -> None:
    """|x| < 2**-24 rounds to 0 or 2**-24 with probability |x| / 2**-24 (the exact path)."""
    values = torch.tensor([2.0**-26, -(2.0**-25) * 1.5, 1e-40, 3.0 * 2.0**-30]).float()
    x = values.repeat(250_000)
    out = stochastic_round(x, torch.float16, torch.Generator().manual_seed(8)).double()
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


@pytest.mark.parametrize("dtype", HALF)
def test_non_contiguous_input_matches_contiguous(dtype: torch.dtype) -> None:
    x = torch.randn(48, 40, generator=torch.Generator().manual_seed(10)) * 1e-3
    x[3, 5] = float("nan")
    x[7, 1] = 3e-6  # FP16 subnormal lane
    xt = x.t()
    assert not xt.is_contiguous()
    a = stochastic_round(xt, dtype, torch.Generator().manual_seed(4))
    b = stochastic_round(xt.contiguous(), dtype, torch.Generator().manual_seed(4))
    assert torch.equal(a.float().nan_to_num(7.0), b.float().nan_to_num(7.0))
    assert bool(torch.isnan(a[5, 3]))
