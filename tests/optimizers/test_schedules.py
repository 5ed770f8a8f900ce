"""Learning-rate schedules: values at key steps, piecewise lists, scaling rule, set_lr."""

from __future__ import annotations

import pytest
import torch

from popbert.optimizers import (
    Lamb,
    linear_scaling_rule,
    make_schedule,
    parse_piecewise,
    set_lr,
    warmup_decay,
)


def test_linear_warmup_then_linear_decay_graphcore_style() -> None:
    peak, start, end = 6e-3, 1e-7, 1e-7
    sched = make_schedule(
        "linear",
        peak_lr=peak,
        total_steps=7038,
        warmup_steps=2000,
        warmup_start_lr=start,
        end_lr=end,
    )
    assert sched(0) == pytest.approx(start)
    assert sched(1000) == pytest.approx((start + peak) / 2)
    assert sched(2000) == pytest.approx(peak)
    assert sched(2000 + 2519) == pytest.approx(end + (peak - end) * 0.5)
    assert sched(7038) == pytest.approx(end)
    assert sched(10_000) == pytest.approx(end)
    assert sched(1999) < sched(2000) > sched(2001)


def test_polynomial_decay_and_constant() -> None:
    poly = make_schedule("poly", peak_lr=1.0, total_steps=110, warmup_steps=10, power=2.0)
    assert poly(10) == pytest.approx(1.0)
    assert poly(60) == pytest.approx(0.25)
    assert poly(110) == 0.0
    const = make_schedule("constant", peak_lr=2e-4, warmup_steps=4)
    assert [const(s) for s in (0, 2, 4, 10**6)] == pytest.approx([0.0, 1e-4, 2e-4, 2e-4])
    no_warmup = make_schedule("linear", peak_lr=1e-3, total_steps=10)
    assert no_warmup(0) == pytest.approx(1e-3) and no_warmup(5) == pytest.approx(5e-4)


def test_schedules_are_pure_functions_of_the_step() -> None:
    sched = make_schedule("linear", peak_lr=1e-3, total_steps=100, warmup_steps=10)
    forward = [sched(s) for s in range(100)]
    backward = [sched(s) for s in reversed(range(100))][::-1]
    assert forward == backward  # resume at any step gives the same value, bit for bit


def test_piecewise_string_and_dict() -> None:
    from_str = make_schedule("piecewise", piecewise="0:1e-4, 1000:5e-5,3000:1e-5")
    from_dict = make_schedule("piecewise", piecewise={"3000": 1e-5, 0: 1e-4, 1000: 5e-5})
    for step, lr in [(0, 1e-4), (999, 1e-4), (1000, 5e-5), (2999, 5e-5), (3000, 1e-5), (9e9, 1e-5)]:
        assert from_str(int(step)) == lr and from_dict(int(step)) == lr
    assert list(parse_piecewise("0:1,10:2")) == [0, 10]
    with pytest.raises(ValueError):
        parse_piecewise("100:1e-4")  # must start at step 0
    with pytest.raises(ValueError):
        parse_piecewise("0=1e-4")
    with pytest.raises(ValueError):
        make_schedule("piecewise")


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError):
        make_schedule("cosine", peak_lr=1.0, total_steps=10)
    with pytest.raises(ValueError):
        make_schedule("linear", peak_lr=1.0)
    with pytest.raises(ValueError):
        make_schedule("linear", peak_lr=1.0, total_steps=5, warmup_steps=10)
    with pytest.raises(ValueError):
        warmup_decay(-1, peak_lr=1.0, total_steps=10)


def test_linear_scaling_rule() -> None:
    assert linear_scaling_rule(1e-4, 256, 1024) == pytest.approx(4e-4)
    assert linear_scaling_rule(6e-3, 65536, 16384) == pytest.approx(1.5e-3)
    with pytest.raises(ValueError):
        linear_scaling_rule(1e-4, 0, 8)


def test_set_lr_applies_group_scales() -> None:
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    opt = Lamb([{"params": [a]}, {"params": [b], "lr_scale": 0.1}], lr=0.0)
    sched = make_schedule("linear", peak_lr=1e-3, total_steps=100, warmup_steps=10)
    assert set_lr(opt, sched, 10) == pytest.approx(1e-3)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-3, 1e-4])
    assert set_lr(opt, 5e-4) == 5e-4 and opt.param_groups[1]["lr"] == pytest.approx(5e-5)
    with pytest.raises(ValueError):
        set_lr(opt, sched)
