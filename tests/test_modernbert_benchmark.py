"""`benchmarks/modernbert_step.py` runs end to end on a tiny shape, and its loss check (popbert's
first-step loss against `transformers.ModernBertForMaskedLM`'s) passes on every row set, the
trimmed ones included. Nothing here depends on how fast the machine is: no time is asserted."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "modernbert_step.py"


def _load():
    spec = importlib.util.spec_from_file_location("benchmark_modernbert_step", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_runs_on_a_tiny_shape_and_the_losses_agree(capsys: pytest.CaptureFixture) -> None:
    bench = _load()
    results = bench.main(["--shapes", "tiny", "--steps", "1", "--warmup", "1",
                          "--threads", "1"])
    assert [r["rows"] for r in results] == list(bench.ROW_SETS)
    for result in results:
        losses = result["losses"]
        # Every side reported a loss; main() already raised if one differed by more than 1e-4.
        assert set(losses) == ({"popbert", "HF"} if result["rows"] == "full length"
                               else {"popbert", "HF", "HF, cut batch"})
        assert all(abs(v - losses["HF"]) <= 1e-4 * abs(losses["HF"]) for v in losses.values())
        assert losses["HF"] == pytest.approx(float(torch.log(torch.tensor(8192.0))), rel=0.05)
        assert result["popbert_s"] > 0 and result["hf_s"] > 0
        assert 8 <= result["popbert_width"] <= 128
    out = capsys.readouterr().out
    assert "flash-attention" in out  # the caveat is printed
    assert out.count("| L2 H64 A2 I96") == 3


def test_loss_check_fails_loudly_on_a_mismatch() -> None:
    bench = _load()

    def stepper(loss: float):
        step = bench.Stepper(lambda batch: torch.tensor(loss), [{}])
        step()
        return step

    agree = {"HF": stepper(9.0), "popbert": stepper(9.0 * (1 + 5e-5))}
    assert bench.check_losses(agree, "HF")["popbert"] == pytest.approx(9.0, rel=1e-4)
    with pytest.raises(RuntimeError, match="loss check failed"):
        bench.check_losses({"HF": stepper(9.0), "popbert": stepper(9.01)}, "HF")


def test_hf_labels_mark_only_the_used_slots() -> None:
    import numpy as np

    bench = _load()
    batch = {"input_ids": np.ones((2, 8), np.int64),
             "masked_lm_positions": np.array([[3, 5, 0], [1, 0, 0]]),
             "masked_lm_ids": np.array([[11, 12, 0], [13, 0, 0]])}
    labels = bench.hf_labels(batch)
    expected = np.full((2, 8), -100)
    expected[0, 3], expected[0, 5], expected[1, 1] = 11, 12, 13
    np.testing.assert_array_equal(labels, expected)  # an unused slot (label 0) labels nothing
