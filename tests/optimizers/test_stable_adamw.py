"""StableAdamW against a reference written from its description, and in a real run.

The reference is Wortsman et al. 2023 ("Stable and low-precision training for large-scale
vision-language models", Algorithm 2, AdamW with AdaFactor-style update clipping), as ModernBERT
trains: per tensor and step, m and v as AdamW's, v_hat = v / (1 - b2^t),
RMS_t = sqrt(mean(g^2 / max(v_hat, eps^2))), lr_t = lr / max(1, RMS_t), then AdamW's decoupled
update with lr_t (weight decay included). Written plainly, one tensor at a time, in float64.
Tolerance 1e-6 relative over 30 steps: popbert computes in FP32 with foreach kernels.
"""

from __future__ import annotations

import math

import pytest
import torch

from popbert.config import load_config
from popbert.errors import ConfigError
from popbert.optimizers import AdamW, StableAdamW


def reference_step(w, g, m, v, t, lr, b1, b2, eps, wd):
    """One StableAdamW step on float64 tensors, returning (w, m, v, lr_t)."""
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    m_hat, v_hat = m / (1 - b1**t), v / (1 - b2**t)
    rms = math.sqrt(float((g * g / torch.clamp(v_hat, min=eps * eps)).mean()))
    lr_t = lr / max(1.0, rms)
    w = w * (1 - lr_t * wd) - lr_t * m_hat / (torch.sqrt(v_hat) + eps)
    return w, m, v, lr_t


def test_matches_the_reference_and_clips_a_spike() -> None:
    torch.manual_seed(0)
    shapes = [(64, 48), (48,), (7, 5, 3)]
    weights = [torch.randn(s) for s in shapes]
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    lr, b1, b2, eps, wd = 1e-2, 0.9, 0.98, 1e-6, 0.1
    optimizer = StableAdamW(params, lr=lr, betas=(b1, b2), eps=eps, weight_decay=wd)
    ref = [(w.double(), torch.zeros_like(w, dtype=torch.float64),
            torch.zeros_like(w, dtype=torch.float64)) for w in weights]
    clipped = []
    for t in range(1, 31):
        grads = [torch.randn(s) * (50.0 if t == 20 and i == 0 else 1.0)  # a spike at step 20
                 for i, s in enumerate(shapes)]
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
        new_ref = []
        for (w, m, v), g in zip(ref, grads):
            w, m, v, lr_t = reference_step(w, g.double(), m, v, t, lr, b1, b2, eps, wd)
            new_ref.append((w, m, v))
            clipped.append((t, lr_t < lr))
        ref = new_ref
        for p, (w, _, _) in zip(params, ref):
            torch.testing.assert_close(p.detach().double(), w, rtol=1e-6, atol=1e-7)
    # Early steps (v_hat still tiny against g^2) and the spike are clipped; quiet ones are not.
    assert (20, True) in clipped and any(not hit for t, hit in clipped if t > 25)


def test_when_no_rms_exceeds_one_it_is_adamw() -> None:
    """When no tensor's RMS exceeds 1, StableAdamW is AdamW exactly."""
    torch.manual_seed(1)
    a = torch.nn.Parameter(torch.randn(32, 16))
    b = torch.nn.Parameter(a.detach().clone())
    stable = StableAdamW([a], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    plain = AdamW([b], lr=1e-3, betas=(0.9, 0.999), weight_decay=0.0)
    for p in (a, b):
        p.grad = torch.full_like(p, 0.5)  # constant gradients: RMS_t = 1 at every step
    stable.step()
    plain.step()
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_config_choice_and_its_one_refusal() -> None:
    cfg = load_config("fast", ["optimizer.name=stableadamw"])
    assert cfg.optimizer.name == "stableadamw"
    with pytest.raises(ConfigError, match="whole tensor"):
        load_config("fast", ["optimizer.name=stableadamw",
                                        "execution.replicated_tensor_sharding=true"])
