"""Learning-rate schedules: values at key steps, cosine against torch's schedulers, WSD against
the papers' description, piecewise lists, scaling rule, set_lr, and the schedule a run builds."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import popbert
from popbert.optimizers import (
    Lamb,
    linear_scaling_rule,
    make_schedule,
    parse_piecewise,
    set_lr,
    warmup_decay,
    wsd_decay_start,
)
from popbert.train.factories import lr_schedule


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
        make_schedule("exponential", peak_lr=1.0, total_steps=10)
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


# ---------------------------------------------------------------------------------------------
# Cosine and warmup-stable-decay (WSD)

PEAK, START, END = 1e-3, 1e-7, 1e-7
# torch's schedulers compute each step's rate from the previous step's (their "chainable" form),
# so rounding accumulates over the steps: over 1000 steps it reaches ~2e-14 relative. Ours is the
# closed form. 1e-12 leaves room for that and still catches any change of formula: a decay
# window off by one step moves the rate by ~1e-3 relative. (abs=0 throughout: pytest.approx's
# default absolute 1e-12 would be a 1e-9 relative tolerance at rates of 1e-3.)
TORCH_REL = 1e-12


def torch_warmup_cosine(peak: float, start: float, end: float, warmup: int, total: int
                        ) -> list[float]:
    """The rate at steps 0..total from LinearLR warmup, then CosineAnnealingLR to eta_min=end."""
    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([param], lr=peak)
    warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=start / peak, end_factor=1.0,
                                             total_iters=warmup)
    cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total - warmup, eta_min=end)
    chained = torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[warmup])
    rates = []
    for _ in range(total + 1):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()
        chained.step()
    return rates


@pytest.mark.parametrize(("warmup", "total"), [(37, 1000), (1, 50), (100, 101)])
def test_cosine_matches_torch_schedulers_at_every_step(warmup: int, total: int) -> None:
    ours = make_schedule("cosine", peak_lr=PEAK, total_steps=total, warmup_steps=warmup,
                         warmup_start_lr=START, end_lr=END)
    expected = torch_warmup_cosine(PEAK, START, END, warmup, total)
    rates = [ours(step) for step in range(total + 1)]
    assert rates == pytest.approx(expected, rel=TORCH_REL, abs=0)
    assert ours(warmup) == PEAK and ours(total) == END and ours(total + 500) == END
    # Negative control: a cosine one step longer than ours does not pass the same comparison.
    longer = torch_warmup_cosine(PEAK, START, END, warmup, total + 1)[: total + 1]
    assert rates != pytest.approx(longer, rel=TORCH_REL, abs=0)


def test_cosine_halfway_and_without_warmup() -> None:
    sched = make_schedule("cosine", peak_lr=1.0, total_steps=100, end_lr=0.0)
    assert sched(0) == 1.0 and sched(50) == pytest.approx(0.5) and sched(100) == 0.0
    values = [sched(step) for step in range(101)]
    assert all(a > b for a, b in zip(values, values[1:]))


def wsd_reference(step: int, *, peak: float, total: int, warmup: int, start: float, end: float,
                  fraction: float, decay_start: int | None = None) -> float:
    """WSD as the papers describe it: linear warmup, the peak held, then a linear decay to `end`
    over the final `fraction` of the steps (but not into the warmup). Written independently of
    popbert's arithmetic."""
    if decay_start is None:
        decay_start = max(warmup, total - round(fraction * total))
    if step < warmup:
        return start + step * (peak - start) / warmup
    if step < decay_start:
        return peak
    if step >= total:
        return end
    return peak + (end - peak) * (step - decay_start) / (total - decay_start)


WSD_CASES = [(1000, 50, 0.2), (1000, 0, 0.1), (300, 30, 0.3), (100, 90, 0.5), (7, 2, 0.25)]


@pytest.mark.parametrize(("total", "warmup", "fraction"), WSD_CASES)
def test_wsd_matches_the_papers_description(total: int, warmup: int, fraction: float) -> None:
    ours = make_schedule("wsd", peak_lr=PEAK, total_steps=total, warmup_steps=warmup,
                         warmup_start_lr=START, end_lr=END, decay_fraction=fraction)
    steps = range(total + 20)
    reference = dict(peak=PEAK, total=total, warmup=warmup, start=START, end=END,
                     fraction=fraction)
    # Both are closed forms; they differ only in how the same terms are grouped (a few ulps).
    got = [ours(step) for step in steps]
    expected = [wsd_reference(step, **reference) for step in steps]
    assert got == pytest.approx(expected, rel=1e-12, abs=0)
    # Negative control: the same shape with its decay starting one step later does not pass.
    late = wsd_decay_start(total, warmup, fraction) + 1
    assert got != pytest.approx(
        [wsd_reference(step, **reference, decay_start=late) for step in steps], rel=1e-12, abs=0)


@pytest.mark.parametrize(("total", "warmup", "fraction"), WSD_CASES)
def test_wsd_pieces(total: int, warmup: int, fraction: float) -> None:
    sched = make_schedule("wsd", peak_lr=PEAK, total_steps=total, warmup_steps=warmup,
                          warmup_start_lr=START, end_lr=END, decay_fraction=fraction)
    decay_start = wsd_decay_start(total, warmup, fraction)
    assert warmup <= decay_start < total
    warm = [sched(step) for step in range(warmup + 1)]
    stable = [sched(step) for step in range(warmup, decay_start + 1)]
    decay = [sched(step) for step in range(decay_start, total + 1)]
    assert all(a < b for a, b in zip(warm, warm[1:]))  # rising to the peak
    assert stable == [PEAK] * len(stable)  # exactly the peak, up to the first decayed step
    assert all(a > b for a, b in zip(decay, decay[1:]))  # falling to end_lr
    assert sched(total) == END and sched(total + 1000) == END  # the last step is end_lr


def test_wsd_decay_start() -> None:
    assert wsd_decay_start(1000) == 800  # the default: the final 20%
    assert wsd_decay_start(1000, 50, 0.1) == 900
    assert wsd_decay_start(10, 0, 0.3) == 7  # 0.3 * 10 is 3.0000000000000004: rounded
    assert wsd_decay_start(100, 90, 0.5) == 90  # never inside the warmup
    assert wsd_decay_start(100, 30, 1.0) == 30
    for bad in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="decay_fraction"):
            wsd_decay_start(100, 0, bad)
        with pytest.raises(ValueError, match="decay_fraction"):
            make_schedule("wsd", peak_lr=1.0, total_steps=100, decay_fraction=bad)
    # The other shapes ignore decay_fraction.
    make_schedule("linear", peak_lr=1.0, total_steps=100, decay_fraction=0.0)


@pytest.mark.parametrize(("total", "warmup"), [(1000, 100), (1000, 0), (10, 10), (53, 7)])
def test_wsd_that_decays_over_everything_is_the_linear_decay(total: int, warmup: int) -> None:
    options = dict(peak_lr=PEAK, total_steps=total, warmup_steps=warmup, warmup_start_lr=START,
                   end_lr=END)
    wsd = make_schedule("wsd", decay_fraction=1.0, **options)
    linear = make_schedule("linear", **options)
    assert [wsd(step) for step in range(total + 20)] == [linear(step) for step in range(total + 20)]


def test_wsd_stable_phase_does_not_depend_on_the_length() -> None:
    """Why WSD suits runs whose length is not known up front: until the decay starts, a longer
    run (resumed with a larger training.steps) has given exactly the same rates."""
    short = make_schedule("wsd", peak_lr=PEAK, total_steps=1000, warmup_steps=100, end_lr=END)
    long = make_schedule("wsd", peak_lr=PEAK, total_steps=5000, warmup_steps=100, end_lr=END)
    assert [short(step) for step in range(800)] == [long(step) for step in range(800)]
    cosine = [make_schedule("cosine", peak_lr=PEAK, total_steps=total, warmup_steps=100)
              for total in (1000, 5000)]
    assert cosine[0](400) != cosine[1](400)  # a cosine is laid over the whole length


def test_cosine_and_wsd_are_pure_functions_of_the_step() -> None:
    for kind in ("cosine", "wsd"):
        sched = make_schedule(kind, peak_lr=1e-3, total_steps=100, warmup_steps=10)
        forward = [sched(step) for step in range(120)]
        assert forward == [sched(step) for step in reversed(range(120))][::-1]


# ---------------------------------------------------------------------------------------------
# The schedule a run builds from its config

# A tiny BERT on the bundled corpus: a step takes a fraction of a second on 2 CPU cores.
SMALL_RUN = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
             "model.intermediate_size=64", "model.sequence_length=32",
             "model.max_position_embeddings=32", "model.max_predictions_per_seq=5",
             "execution.micro_batch_size=8", "execution.device=cpu", "training.log_every=1"]


def test_the_config_chooses_cosine_and_wsd() -> None:
    options = ["optimizer.lr=2e-3", "optimizer.warmup_steps=10", "optimizer.end_lr=0",
               "optimizer.warmup_start_lr=0", "training.steps=100"]
    wsd = lr_schedule(popbert.load_config(
        "tiny", [*options, "optimizer.decay=wsd", "optimizer.decay_fraction=0.3"]))
    reference = dict(peak=2e-3, total=100, warmup=10, start=0.0, end=0.0, fraction=0.3)
    assert [wsd(step) for step in range(100)] == pytest.approx(
        [wsd_reference(step, **reference) for step in range(100)], rel=1e-12, abs=0)
    assert wsd(69) == 2e-3 > wsd(71)  # decays over the final 30 steps
    cosine = lr_schedule(popbert.load_config("tiny", [*options, "optimizer.decay=cosine"]))
    assert cosine(10) == 2e-3 and cosine(55) == pytest.approx(1e-3) and cosine(100) == 0.0
    # A run shorter than its warmup warms up over the whole run, as with the other decays.
    short = lr_schedule(popbert.load_config(
        "tiny", [*options, "training.steps=5", "optimizer.decay=wsd"]))
    assert [short(step) for step in range(6)] == pytest.approx([0, 4e-4, 8e-4, 1.2e-3, 1.6e-3, 0])


def test_a_short_wsd_run_trains_at_the_schedules_rates(tmp_path: Path) -> None:
    steps, warmup, fraction = 10, 2, 0.3  # warmup 0-1, stable 2-6, decay 7-10
    cfg = popbert.load_config("tiny", [
        *SMALL_RUN, f"training.steps={steps}", f"optimizer.warmup_steps={warmup}",
        "optimizer.lr=1e-3", "optimizer.warmup_start_lr=0", "optimizer.end_lr=1e-5",
        "optimizer.decay=wsd", f"optimizer.decay_fraction={fraction}"])
    with popbert.Trainer.from_config(cfg, tmp_path / "run") as trainer:
        trainer.train()
        final_rate = trainer.session.optimizer.param_groups[0]["lr"]
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text()
               .splitlines()]
    reference = dict(peak=1e-3, total=steps, warmup=warmup, start=0.0, end=1e-5,
                     fraction=fraction)
    expected = [wsd_reference(step, **reference) for step in range(steps)]
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["lr"] for r in records] == pytest.approx(expected, rel=1e-12, abs=0)
    assert final_rate == pytest.approx(expected[-1], rel=1e-12, abs=0)  # what the optimizer used
    saved = popbert.load_config(tmp_path / "run" / "config.yaml")
    assert saved.optimizer.decay == "wsd" and saved.optimizer.decay_fraction == fraction
