"""Recomputation: the graph's checkpoint annotations become activation-checkpointing regions.

A 4-layer BERT on one device (`layers_per_ipu=[4]`, `recompute=True`) has checkpoints after
layers 0, 1 and 2: regions [embeddings + layer 0], [layer 1], [layer 2] are recomputed in the
backward pass, [layer 3 + heads] is not (its backward follows its forward at once). Same
weights, lower peak memory (measured and printed).
"""

from __future__ import annotations

import pytest
import torch
from bert_helpers import one_thread, padded_batch, small_config  # noqa: F401 (one_thread: autouse)
from memory_helpers import PeakMemory

from popbert.builders.bert import build_bert
from popbert.graph.annotations import is_checkpoint
from popbert.optimizers import AdamW, param_groups_by_name
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import InferenceSession, TrainingSession

CONFIG = small_config(num_layers=4, layers_per_ipu=[4], recompute=True, sequence_length=64,
                      max_position_embeddings=64, hidden_dropout=0.1, attention_dropout=0.1)


def checkpoint_count(module) -> int:
    """Number of checkpoint nodes in a lowered graph."""
    return sum(is_checkpoint(n) for n in module.graph.nodes)


def adamw(named):
    return AdamW(param_groups_by_name(named, 0.01), lr=2e-3, seed=0)


def session(**options) -> TrainingSession:
    torch.manual_seed(0)
    return TrainingSession(build_bert(CONFIG, seed=2).model(), "loss", adamw,
                           SessionOptions(gradient_accumulation=2, **options))


def train_and_measure(**options) -> tuple[dict[str, torch.Tensor], int, TrainingSession]:
    s = session(**options)
    torch.manual_seed(1)  # dropout masks: recomputation must replay them exactly
    s.run(padded_batch(CONFIG, 16, seed=0))
    with PeakMemory() as memory:
        s.run(padded_batch(CONFIG, 16, seed=1))
    for step in range(2, 4):
        s.run(padded_batch(CONFIG, 16, seed=step))
    return s.weights(), memory.peak_bytes, s


def test_recompute_gives_the_same_weights_with_less_memory() -> None:
    assert checkpoint_count(session().module) == 3
    plain, plain_peak, _ = train_and_measure()
    recomputed, peak, s = train_and_measure(recompute=True)
    regions = sorted(s.program.partitions.values(), key=lambda p: p.region)
    assert [p.recompute for p in regions] == [True, True, True, False]
    print(f"peak memory of a training step: {plain_peak / 1e6:.2f} MB without recomputation, "
          f"{peak / 1e6:.2f} MB with ({peak / plain_peak:.0%})")
    assert peak < 0.8 * plain_peak
    for name in plain:  # same ops on the same values, dropout masks included: identical
        torch.testing.assert_close(recomputed[name], plain[name], rtol=0, atol=0)


def test_recompute_composes_with_pipelining() -> None:
    plain, _, _ = train_and_measure()
    both, _, s = train_and_measure(recompute=True, pipeline=True)
    assert all(p.recompute for p in s.program.partitions.values() if p.stage == 0)
    # Pipelining adds the embeddings' gradients (tied word embedding, positions) in another
    # order: FP32 rounding, carried through 4 AdamW steps. Measured worst, relative to the
    # tensor's largest weight: 1.1e-5 on an AVX-512 Intel Xeon (Embedding/Positional_Dict),
    # below 1e-5 on AMD EPYC; 3e-5 leaves margin for other kernels and stays far below a wrong
    # schedule (the last step fed the previous step's batch moves every tensor by 2.3e-3 of its
    # largest weight or more, measured).
    for name in plain:
        error = float((both[name] - plain[name]).abs().max() / plain[name].abs().max())
        assert error < 3e-5, (name, error)


def test_a_graph_without_checkpoints_cannot_recompute() -> None:
    model = build_bert(small_config()).model()
    with pytest.raises(ValueError, match="checkpoint annotations"):
        TrainingSession(model, "loss", adamw, SessionOptions(recompute=True))
    # Inference never recomputes: the option is ignored there.
    assert InferenceSession(model, SessionOptions(recompute=True)).program is None


def test_config_without_checkpoints_is_a_one_line_error(tmp_path, capsys) -> None:
    from popbert.cli.main import main

    code = main(["pretrain", "--set", "execution.recompute=true", "--output-dir",
                 str(tmp_path / "out")])
    assert code == 2
    message = capsys.readouterr().err.strip()
    assert message.startswith("popbert: error:") and "\n" not in message
    assert "execution.recompute" in message and "model.recompute" in message
    assert not (tmp_path / "out").exists()


def test_peak_memory_counts_live_tensors_once() -> None:
    with PeakMemory() as memory:
        a = torch.zeros(1000)  # 4000 bytes
        view = a[10:]  # same storage: not counted again
        b = torch.ones(500)  # 2000 bytes
        del a, view, b
        c = torch.zeros(250)  # 1000 bytes, after the others were freed
        del c
    assert memory.peak_bytes == 6000
