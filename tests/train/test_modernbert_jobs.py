"""ModernBERT through popbert's whole jobs, with a BPE tokenizer.json made from the bundled corpus.

Pre-training (the `fast` preset, a ModernBERT, at small shapes: MLM only, 30% masking), the
context-extension phase 2 (a longer sequence and a new global rotary theta from the phase-1
checkpoint, as ModernBERT's 1,024 → 8,192 step), fine-tuning for classification and SQuAD, the
INT8 export's accuracy guard and `popbert predict`: every step the BERT family goes through.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from checkpoint_helpers import final_step_weights, run_records

from popbert.cli.main import main
from popbert.config import load_config
from popbert.data.tokenization import bundled_corpus_path
from popbert.data.vocab import train_bpe

FIXTURES = Path(__file__).parent.parent / "fixtures"
SENTIMENT = FIXTURES / "classification" / "sentiment.tsv"
SQUAD = FIXTURES / "squad" / "squad-v1.1-sample.json"
VOCAB = 1000


def tiny(tokenizer: Path) -> list[str]:
    settings = {"model.num_layers": 3, "model.hidden_size": 32, "model.num_heads": 2,
                "model.intermediate_size": 48, "model.max_position_embeddings": 128,
                "model.vocab_size": VOCAB, "model.modernbert.local_attention": 16,
                "data.vocab_file": str(tokenizer), "execution.micro_batch_size": 8,
                "execution.device": "cpu", "execution.compute_dtype": "float32",
                "training.log_every": 1, "training.time_budget": "null",
                "training.eval_points": 0}
    return ["--config", "fast",
            *[a for key, value in settings.items() for a in ("--set", f"{key}={value}")]]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    train_bpe([bundled_corpus_path()], path, vocab_size=VOCAB)
    return path


@pytest.fixture(scope="module")
def phase1(tmp_path_factory: pytest.TempPathFactory, tokenizer: Path) -> Path:
    run = tmp_path_factory.mktemp("modernbert") / "phase1"
    assert main(["pretrain", *tiny(tokenizer), "--set", "model.sequence_length=64",
                 "--set", "model.max_predictions_per_seq=19", "--set", "training.steps=16",
                 "--set", "optimizer.lr=0.005", "--set", "optimizer.warmup_steps=2",
                 "--output-dir", str(run)]) == 0
    return run


@pytest.mark.e2e
def test_pretraining_learns_and_exports(phase1: Path) -> None:
    cfg = load_config(phase1 / "config.yaml")
    assert cfg.model.architecture == "modernbert" and not cfg.model.next_sentence_prediction
    assert cfg.data.masked_lm_prob == 0.30
    losses = [r["mlm_loss"] for r in run_records(phase1)]
    assert len(losses) == 16 and losses[-1] < losses[0] - 0.5, losses
    assert (phase1 / "model.inference.onnx").is_file() and (phase1 / "metrics.png").is_file()
    assert "Layer1/MLP/Wi/W" in final_step_weights(phase1)


@pytest.mark.e2e
def test_context_extension_phase_two_with_a_new_global_theta(phase1: Path, tokenizer: Path,
                                                             tmp_path: Path) -> None:
    """Phase 2 from phase 1's weights at twice the sequence and a larger global theta: rotary
    tables are constants, so every weight carries over (lr 1e-9) and the run trains."""
    phase2 = tmp_path / "phase2"
    assert main(["pretrain", *tiny(tokenizer), "--set", "model.sequence_length=128",
                 "--set", "model.max_predictions_per_seq=38",
                 "--set", "model.modernbert.global_rope_theta=640000.0",
                 "--set", "training.steps=2", "--set", "optimizer.lr=1e-9",
                 "--set", "optimizer.warmup_steps=0", "--set", "optimizer.decay=none",
                 "--set", "optimizer.weight_decay=0.0", "--init-from", str(phase1),
                 "--output-dir", str(phase2)]) == 0
    before, after = final_step_weights(phase1), final_step_weights(phase2)
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_allclose(after[name], before[name], rtol=0, atol=1e-6, err_msg=name)
    cfg = load_config(phase2 / "config.yaml").model
    assert cfg.sequence_length == 128 and cfg.modernbert.global_rope_theta == 640000.0
    assert all(np.isfinite(r["loss"]) for r in run_records(phase2))


@pytest.mark.e2e
def test_classification_fine_tuning_int8_guard_and_predict(phase1: Path, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str]
                                                           ) -> None:
    run = tmp_path / "sst"
    assert main(["finetune", "classify", "--checkpoint", str(phase1), "--train",
                 str(SENTIMENT), "--output-dir", str(run), "--max-seq-length", "32",
                 "--epochs", "16", "--batch-size", "8", "--lr", "3e-3",
                 "--warmup-proportion", "0", "--log-every", "1"]) == 0
    cfg = load_config(run / "config.yaml").model
    assert cfg.architecture == "modernbert" and cfg.task.name == "classification"
    assert cfg.task.hf_architecture == "ModernBertForSequenceClassification"
    assert (run / "tokenizer.json").is_file()
    losses = [r["loss"] for r in run_records(run)]
    assert np.mean(losses[-3:]) < np.mean(losses[:3]), losses
    assert "Pooler/Head/Dense/W" in final_step_weights(run)

    capsys.readouterr()
    model = tmp_path / "int8.onnx"
    assert main(["export", "--checkpoint", str(run), "--task", "classification", "--output",
                 str(model), "--quantize", "int8", "--eval", str(SENTIMENT),
                 "--max-accuracy-drop", "100"]) == 0
    assert "accuracy" in capsys.readouterr().err
    # A guard no export can meet refuses and writes nothing.
    refused = tmp_path / "refused.onnx"
    assert main(["export", "--checkpoint", str(run), "--task", "classification", "--output",
                 str(refused), "--quantize", "int8", "--eval", str(SENTIMENT),
                 "--max-accuracy-drop", "-1"]) == 2
    assert not refused.exists()

    output = tmp_path / "labels.jsonl"
    assert main(["predict", "classify", "--model", str(model), "--data", str(SENTIMENT),
                 "--output", str(output)]) == 0
    rows = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(rows) == 16 and {r["label"] for r in rows} <= {"0", "1"}


@pytest.mark.e2e
def test_squad_fine_tuning_with_a_bpe_tokenizer(phase1: Path, tmp_path: Path) -> None:
    """SQuAD windows from byte-level BPE offsets: predictions are spans of the context."""
    run = tmp_path / "squad"
    assert main(["finetune", "squad", "--checkpoint", str(phase1), "--train", str(SQUAD),
                 "--predict", str(SQUAD), "--output-dir", str(run), "--max-seq-length", "64",
                 "--doc-stride", "32", "--max-query-length", "16", "--epochs", "2",
                 "--batch-size", "8", "--lr", "3e-3", "--warmup-proportion", "0",
                 "--log-every", "1"]) == 0
    assert load_config(run / "config.yaml").model.task.hf_architecture == \
        "ModernBertForQuestionAnswering"
    predictions = json.loads((run / "predictions.json").read_text())
    contexts = " ".join(p["context"] for a in json.loads(SQUAD.read_text())["data"]
                        for p in a["paragraphs"])
    assert len(predictions) == 5
    assert all(answer.strip() in contexts for answer in predictions.values())
    model = tmp_path / "squad.onnx"
    assert main(["export", "--checkpoint", str(run), "--task", "squad", "--output",
                 str(model)]) == 0


@pytest.mark.e2e
def test_packed_shards_train_a_modernbert(tokenizer: Path, tmp_path: Path) -> None:
    """`prepare-data instances` + `pack` with the BPE tokenizer, then packed pre-training: rows
    of several sequences, attention within each (the NSP labels the shards carry are unread)."""
    corpus = str(bundled_corpus_path())
    assert main(["prepare-data", "instances", "--input", corpus, "--vocab", str(tokenizer),
                 "--output-dir", str(tmp_path / "instances"), "--sequence-length", "64",
                 "--max-predictions", "10", "--dupe-factor", "1"]) == 0
    assert main(["prepare-data", "pack", "--input", str(tmp_path / "instances"),
                 "--output-dir", str(tmp_path / "packed")]) == 0
    run = tmp_path / "run"
    assert main(["pretrain", *tiny(tokenizer), "--set", "model.packed=true",
                 "--set", "data.dynamic_masking=false",
                 "--set", f"data.input_files=[{tmp_path / 'packed'}/part-*.h5]",
                 "--set", "model.sequence_length=64", "--set", "model.max_predictions_per_seq=12",
                 "--set", "model.max_sequences_per_pack=3", "--set", "training.steps=4",
                 "--output-dir", str(run)]) == 0
    assert len(run_records(run)) == 4 and (run / "model.inference.onnx").is_file()
