"""Hashed CPU dropout (popbert.lowering.dropout): the right share dropped, kept values scaled,
the backward the same mask, reproducible from torch's seed, compiled and eager alike."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import popbert.lowering.dropout as hashed


def test_the_threshold_is_p_of_the_unsigned_range() -> None:
    assert hashed.keep_threshold(0.0) == -(1 << 31)  # every hash reaches it
    assert hashed.keep_threshold(0.5) == 0
    assert hashed.keep_threshold(0.1) == round(0.1 * 2**32) - 2**31


def test_it_drops_p_of_the_elements_and_scales_the_rest() -> None:
    torch.manual_seed(0)
    x = torch.rand(1 << 20) + 0.5  # no zeros: a zero output means dropped
    y = hashed.dropout(x, 0.1)
    kept = y != 0
    # 6 standard deviations of a binomial share over 2**20 elements: 0.0018.
    assert abs(kept.float().mean().item() - 0.9) < 6 * (0.09 / x.numel()) ** 0.5
    assert torch.equal(y[kept], x[kept] * torch.tensor(1 / 0.9))


def test_the_backward_applies_the_forward_mask() -> None:
    torch.manual_seed(1)
    x = (torch.rand(64, 40, 48) + 0.5).requires_grad_()
    grad = torch.randn(64, 40, 48)
    y = hashed.dropout(x, 0.25)
    y.backward(grad)
    scale = torch.tensor(1 / 0.75)
    assert torch.equal(x.grad, torch.where(y != 0, grad * scale, 0.0))


def test_masks_follow_torch_seed_and_rng_state() -> None:
    x = torch.rand(50_000) + 0.5
    torch.manual_seed(7)
    first, second = hashed.dropout(x, 0.1), hashed.dropout(x, 0.1)
    assert not torch.equal(first != 0, second != 0)  # each call draws its own key
    torch.manual_seed(7)
    assert torch.equal(hashed.dropout(x, 0.1), first)
    state = torch.get_rng_state()  # what a checkpoint keeps
    after = hashed.dropout(x, 0.1)
    torch.set_rng_state(state)
    assert torch.equal(hashed.dropout(x, 0.1), after)


def test_two_calls_masks_are_independent() -> None:
    torch.manual_seed(3)
    x = torch.ones(1 << 20)
    a, b = hashed.dropout(x, 0.5) == 0, hashed.dropout(x, 0.5) == 0
    # Both dropped: 0.25 within 6 standard deviations (0.0025).
    assert abs((a & b).float().mean().item() - 0.25) < 6 * (0.1875 / x.numel()) ** 0.5


def test_compiled_and_eager_give_the_same_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    x = torch.rand(3, 128, 384) + 0.5  # above COMPILE_MIN_NUMEL: compiled where possible
    torch.manual_seed(11)
    compiled = hashed.dropout(x, 0.1)
    monkeypatch.setattr(hashed, "COMPILE_MIN_NUMEL", 1 << 40)
    torch.manual_seed(11)
    assert torch.equal(hashed.dropout(x, 0.1), compiled)


def test_a_non_contiguous_input_is_masked_in_its_own_layout() -> None:
    torch.manual_seed(5)
    x = (torch.rand(8, 16, 24) + 0.5).transpose(0, 2)
    y = hashed.dropout(x, 0.3)
    assert y.shape == x.shape
    assert torch.equal(y[y != 0], x[y != 0] * torch.tensor(1 / 0.7))


def test_half_inputs_keep_their_dtype() -> None:
    x = torch.ones(4096, dtype=torch.bfloat16)
    y = hashed.dropout(x, 0.1)
    assert y.dtype == torch.bfloat16
    assert set(y.unique().tolist()) <= {0.0, torch.tensor(1 / 0.9).bfloat16().item()}


def test_switched_off_it_is_torch_dropout(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hashed, "HASHED", False)
    x = torch.rand(10_000)
    torch.manual_seed(2)
    ours = hashed.dropout(x, 0.1)
    torch.manual_seed(2)
    assert torch.equal(ours, F.dropout(x, 0.1, True))


def test_p_zero_is_the_identity_and_p_one_drops_everything() -> None:
    x = torch.rand(100)
    assert hashed.dropout(x, 0.0) is x
    assert torch.equal(hashed.dropout(x, 1.0), torch.zeros(100))
