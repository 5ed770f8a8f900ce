"""Half-precision weights with stochastic rounding train as well as FP32 weights.

A few hundred seeded CPU steps of a small BERT on the bundled corpus; the loss of the FP16-weight
run (FP32 moments, stochastic rounding, no master copy) must stay within 2% of the FP32 run's at
the same step. The comparison averages the last 20 steps on both sides, so one noisy batch does
not decide it.
"""

from __future__ import annotations

import numpy as np
import pytest
from precision_run import train_losses

pytestmark = pytest.mark.e2e

STEPS = 200


def tail(losses: list[float]) -> float:
    return float(np.mean(losses[-20:]))


def test_fp16_weights_with_stochastic_rounding_match_fp32_within_2_percent() -> None:
    fp32 = train_losses("float32", stochastic_rounding=False, steps=STEPS)
    fp16 = train_losses("float16", stochastic_rounding=True, steps=STEPS)
    assert tail(fp32) < fp32[0] - 1.0, "the FP32 run itself must learn"
    assert abs(tail(fp16) - tail(fp32)) / tail(fp32) < 0.02, (tail(fp16), tail(fp32))
