"""Phase 1 → phase 2 on the tiny preset: `popbert pretrain --init-from` at a longer sequence.

Phase 2 starts from the phase-1 checkpoint's weights only: every weight is carried over (the
position table is already sized for the longer sequence), the optimizer and the learning-rate
schedule start fresh, and the graph is rebuilt at the new sequence length.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
import safetensors.numpy
import torch

from popbert.builders.bert import build_bert
from popbert.cli import main as cli
from popbert.config import load_config

pytestmark = pytest.mark.e2e

# The tiny preset made smaller still (1 layer, hidden 64) so both phases take seconds.
TINY = ["--config", "tiny", "--set", "model.num_layers=1", "--set", "model.hidden_size=64",
        "--set", "model.intermediate_size=128", "--set", "execution.micro_batch_size=16",
        "--set", "execution.device=cpu", "--set", "training.log_every=1"]
PHASE1 = [*TINY, "--set", "model.sequence_length=64", "--set",
          "model.max_predictions_per_seq=10", "--set", "training.steps=24", "--set",
          "optimizer.lr=0.003", "--set", "optimizer.warmup_steps=4"]
# A vanishing learning rate: after its steps, phase 2's weights are still phase 1's.
PHASE2 = [*TINY, "--set", "model.sequence_length=128", "--set",
          "model.max_predictions_per_seq=20", "--set", "training.steps=2", "--set",
          "optimizer.lr=1e-9", "--set", "optimizer.warmup_steps=0", "--set",
          "optimizer.decay=none", "--set",
          "optimizer.weight_decay=0.0"]


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_phase_two_continues_from_phase_one_at_a_longer_sequence(tmp_path: Path) -> None:
    phase1, phase2 = tmp_path / "phase1", tmp_path / "phase2"
    assert cli.main(["pretrain", *PHASE1, "--output-dir", str(phase1)]) == 0
    assert cli.main(["pretrain", *PHASE2, "--init-from", str(phase1),
                     "--output-dir", str(phase2)]) == 0

    before = safetensors.numpy.load_file(
        str(phase1 / "checkpoints" / "step-000024" / "weights.safetensors"))
    after = safetensors.numpy.load_file(
        str(phase2 / "checkpoints" / "step-000002" / "weights.safetensors"))
    assert before.keys() == after.keys()
    for name in before:  # every weight carried over (lr 1e-9: moved by ~2e-9 at most)
        np.testing.assert_allclose(after[name], before[name], rtol=0, atol=1e-6, err_msg=name)

    cfg2 = load_config("tiny", [PHASE2[i + 1] for i in range(2, len(PHASE2), 2)])
    fresh = {t.name: onnx.numpy_helper.to_array(t)
             for t in build_bert(cfg2.model, seed=cfg2.training.seed).model().graph.initializer}
    assert np.abs(after["Embedding/Positional_Dict"] - fresh["Embedding/Positional_Dict"]
                  ).max() > 0.01, "phase 2 did not start from phase 1's weights"

    graph = onnx.load(str(phase2 / "model.onnx"), load_external_data=False)
    dims = [d.dim_value for d in graph.graph.input[0].type.tensor_type.shape.dim]
    assert dims[1] == 128
    assert after["Embedding/Positional_Dict"].shape == (128, 64)

    # Fresh optimizer: its state counts phase 2's 2 steps, not 24 + 2.
    optimizer = torch.load(phase2 / "checkpoints" / "step-000002" / "optimizer.pt",
                           weights_only=True)
    steps = {float(s["step"]) for s in optimizer["state"].values() if "step" in s}
    assert steps == {2.0}, steps
    # Fresh schedule: phase 2 logs its own steps 1, 2 at its own (constant) learning rate.
    second = records(phase2)
    assert [r["step"] for r in second] == [1, 2]
    assert all(r["lr"] == pytest.approx(1e-9) for r in second)
    # What phase 1 learned carries over to the longer sequences: phase 2's first loss is far
    # below phase 1's first (a random model's ln(8192) ≈ 9.0).
    first = records(phase1)
    assert second[0]["mlm_loss"] < first[0]["mlm_loss"] - 0.5, (first[0], second[0])

    # The phase-2 checkpoint leaves as a Hugging Face BertForPreTraining, keys exactly right.
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers
    assert cli.main(["export-hf", "--checkpoint", str(phase2), "--output-dir",
                     str(tmp_path / "hf")]) == 0
    model, info = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "hf"),
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert model.config.max_position_embeddings == 128 and model.config.vocab_size == 8192
    np.testing.assert_array_equal(
        model.bert.embeddings.position_embeddings.weight.detach().numpy(),
        after["Embedding/Positional_Dict"])
