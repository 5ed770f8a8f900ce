"""Static and dynamic loss scaling: backoff, skipped steps, growth, checkpoints."""

from __future__ import annotations

import copy

import pytest
import torch

from popbert.optimizers import AdamW, Lamb, LossScaler, grads_have_overflow, unscale_grads_


def _model(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1)).to(
        dtype
    )


def _backward(model: torch.nn.Module, scaler: LossScaler, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    dtype = next(model.parameters()).dtype
    x = torch.randn(4, 6, generator=gen).to(dtype)
    loss = model(x).float().pow(2).mean()
    scaler.scale(loss).backward()


def test_dynamic_scaler_recovers_from_injected_inf_and_nan() -> None:
    model = _model()
    opt = Lamb(model.parameters(), lr=1e-2)
    scaler = LossScaler(2.0**10, growth_interval=3)
    history = []
    for step in range(12):
        opt.zero_grad()
        _backward(model, scaler, step)
        if step == 4:
            next(model.parameters()).grad[0, 0] = float("inf")
        if step == 5:
            list(model.parameters())[-1].grad[0] = float("nan")
        before = [p.detach().clone() for p in model.parameters()]
        scale_before = scaler.scale_value
        stepped = scaler.step(opt)
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        history.append((step, scale_before, stepped, unchanged))
    taken = {s: (stepped, unchanged) for s, _, stepped, unchanged in history}
    assert taken[4] == (False, True) and taken[5] == (False, True)
    assert all(taken[s] == (True, False) for s in range(12) if s not in (4, 5))
    scales = [scale for _, scale, _, _ in history]
    # grows after 3 clean steps (0-2), backs off twice, then grows again after steps 6-8
    assert scales[:4] == [1024.0, 1024.0, 1024.0, 2048.0]
    assert scales[4:7] == [2048.0, 1024.0, 512.0]
    assert scales[9:] == [1024.0, 1024.0, 1024.0]
    assert scaler.skipped_steps == 2 and scaler.steps == 12
    first = next(model.parameters())
    assert opt.state[first]["step"] == 10  # skipped steps leave the optimizer state alone
    assert all(bool(torch.isfinite(p).all()) for p in model.parameters())


def test_manual_loop_with_unscale() -> None:
    model = _model()
    ref = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = LossScaler(256.0)
    plain = LossScaler.static(1.0)
    for step in range(3):
        for m, o, s in ((model, opt, scaler), (ref, ref_opt, plain)):
            o.zero_grad()
            _backward(m, s, step)
        grads = [p.grad for p in model.parameters()]
        found_inf = grads_have_overflow(grads)
        unscale_grads_(grads, scaler.scale_value)
        assert found_inf is False
        opt.step()
        ref_opt.step()
        scaler.update(found_inf)
    for a, b in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-7)


def test_unscale_reports_overflow_and_step_skips_for_plain_torch_optimizers() -> None:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = LossScaler(8.0)
    _backward(model, scaler, 0)
    next(model.parameters()).grad.view(-1)[3] = -float("inf")
    before = [p.detach().clone() for p in model.parameters()]
    assert scaler.step(opt) is False
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert scaler.scale_value == 4.0 and scaler.skipped_steps == 1


def test_scale_never_drops_below_min_and_never_exceeds_max() -> None:
    scaler = LossScaler(4.0, growth_interval=1, max_scale=16.0)
    for _ in range(5):
        scaler.update(True)
    assert scaler.scale_value == 1.0 and scaler.skipped_steps == 5
    for _ in range(10):
        scaler.update(torch.tensor(False))
    assert scaler.scale_value == 16.0


def test_static_scaler_keeps_its_scale_and_counts_skips() -> None:
    scaler = LossScaler.static(512.0)
    scaler.update(True)
    for _ in range(5000):
        scaler.update(False)
    assert scaler.scale_value == 512.0
    assert scaler.skipped_steps == 1 and scaler.steps == 5001


def test_state_dict_round_trip() -> None:
    scaler = LossScaler(2.0**12, growth_interval=4, backoff_factor=0.25)
    for found in (False, False, True, False, False):
        scaler.update(found)
    restored = LossScaler()
    restored.load_state_dict(copy.deepcopy(scaler.state_dict()))
    for found in (False, False, False, True, False):
        scaler.update(found)
        restored.update(found)
        assert restored.state_dict() == scaler.state_dict()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"init_scale": 0.5},
        {"min_scale": 0.0},
        {"growth_factor": 1.0},
        {"backoff_factor": 1.0},
        {"growth_interval": 0},
        {"init_scale": 2.0**30},
    ],
)
def test_invalid_configurations(kwargs: dict) -> None:
    with pytest.raises(ValueError):
        LossScaler(**kwargs)


def test_fp16_grads_are_unscaled_inside_the_fp32_update() -> None:
    """A gradient of 2**-30 exists only scaled in FP16; the in-step unscale keeps it."""
    scaler = LossScaler.static(2.0**20)
    p_inside = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    p_inplace = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    scaled_grad = torch.full((4,), 2.0**-10, dtype=torch.float16)  # true grad 2**-30
    p_inside.grad = scaled_grad.clone()
    p_inplace.grad = scaled_grad.clone()
    opt = AdamW([p_inside], lr=1e-3, weight_decay=0.0, eps=1e-12)
    assert scaler.step(opt)
    assert opt.state[p_inside]["exp_avg"][0].item() == pytest.approx(0.1 * 2.0**-30)
    unscale_grads_([p_inplace.grad], scaler.scale_value)  # 2**-30 underflows FP16 (2**-24 min)
    assert torch.count_nonzero(p_inplace.grad) == 0


def test_grads_have_overflow_ignores_missing_and_empty_grads() -> None:
    grads = [None, torch.zeros(0), torch.ones(3, dtype=torch.bfloat16)]
    assert grads_have_overflow(grads) is False
    grads.append(torch.tensor([1.0, float("nan")]))
    assert grads_have_overflow(grads) is True
