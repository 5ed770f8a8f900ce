"""Weights holding NaN or Inf are refused where they are read, naming the tensors in one line:
by every command that loads a checkpoint's weights, and by `popbert import-hf` — instead of a
run that trains them until "training diverged" blames the learning rate."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.cli.main import main
from popbert.config import dump_config, load_config
from popbert.graph.annotations import trainable_initializers
from popbert.io.checkpoint import Checkpoint, check_finite, non_finite_weights, save_checkpoint

FIXTURES = Path(__file__).parent.parent / "fixtures"
SENTIMENT = FIXTURES / "classification" / "sentiment.tsv"
SMALL = ["model.hidden_size=32", "model.num_heads=2", "model.intermediate_size=48",
         "model.num_layers=2", "model.sequence_length=32", "model.max_position_embeddings=64",
         "model.max_predictions_per_seq=5", "execution.micro_batch_size=4",
         "execution.device=cpu", "training.steps=2", "training.log_every=1"]
BAD = ("Layer1/FF/1/W", "CLS/MLM/Bias")


def damaged_checkpoint(directory: Path) -> Path:
    """A tiny BERT pre-training checkpoint (optimizer and RNG files too, so it can be resumed)
    with a NaN in one weight and an Inf in another."""
    cfg = load_config("tiny", SMALL)
    model = build_bert(cfg.model, task="pretraining", seed=0).model()
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    weights = {n: torch.from_numpy(values[n].copy()) for n in trainable_initializers(model)}
    weights[BAD[0]][0, 3] = float("nan")
    weights[BAD[1]][7] = float("-inf")
    step = directory / "checkpoints" / "step-000001"
    save_checkpoint(step, Checkpoint(step=1, weights=weights), dump_config(cfg))
    return directory


@pytest.fixture(scope="module")
def damaged(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return damaged_checkpoint(tmp_path_factory.mktemp("damaged") / "run")


@pytest.fixture(autouse=True)
def quiet(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)


def error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("popbert: error: ")]
    assert len(errors) == 1 and "Traceback" not in err, err
    return errors[0]


# Every command that reads a popbert checkpoint's weights, by the flag naming it.
COMMANDS = {
    "pretrain --init-from": lambda ckpt, out: ["pretrain", "--config", "tiny",
                                               *[a for k in SMALL for a in ("--set", k)],
                                               "--init-from", str(ckpt), "--output-dir",
                                               str(out)],
    "pretrain --resume": lambda ckpt, out: ["pretrain", "--resume", str(ckpt)],
    "finetune classify --checkpoint": lambda ckpt, out: [
        "finetune", "classify", "--checkpoint", str(ckpt), "--train", str(SENTIMENT),
        "--max-seq-length", "32", "--output-dir", str(out)],
    "export --checkpoint": lambda ckpt, out: ["export", "--checkpoint", str(ckpt), "--task",
                                              "encoder", "--output", str(out / "m.onnx")],
    "export-hf --checkpoint": lambda ckpt, out: ["export-hf", "--checkpoint", str(ckpt),
                                                 "--output-dir", str(out)],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_load_names_the_tensors_that_are_not_finite(command: str, damaged: Path,
                                                          tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]
                                                          ) -> None:
    out = tmp_path / "out"
    step = damaged / "checkpoints" / "step-000001"
    if command == "pretrain --resume":  # a full checkpoint: the files a resume reads too
        resumable = tmp_path / "resumable"
        os.makedirs(resumable / "checkpoints")
        copy = resumable / "checkpoints" / step.name
        os.makedirs(copy)
        for f in step.iterdir():
            (copy / f.name).write_bytes(f.read_bytes())
        torch.save({}, copy / "optimizer.pt")
        torch.save({}, copy / "rng.pt")
        (resumable / "config.yaml").write_bytes((step / "config.yaml").read_bytes())
        damaged = resumable
    before = sorted(p.name for p in damaged.rglob("*"))
    assert main(COMMANDS[command](damaged, out)) == 2
    line = error_line(capsys)
    assert "not finite (NaN or Inf)" in line and "2 of " in line, line
    assert all(name in line for name in BAD), line
    assert "weights.safetensors" in line
    assert not out.exists()  # nothing written
    assert sorted(p.name for p in damaged.rglob("*")) == before


def test_import_hf_names_the_tensor(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    os.environ["HF_HUB_OFFLINE"] = "1"
    import transformers

    source = tmp_path / "hf"
    model = transformers.BertModel(transformers.BertConfig(
        vocab_size=120, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=64, max_position_embeddings=48))
    with torch.no_grad():
        model.encoder.layer[1].output.dense.weight[2, 2] = float("inf")
    model.save_pretrained(str(source), safe_serialization=True)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(115)]
    (source / "vocab.txt").write_text("\n".join(tokens) + "\n")
    out = tmp_path / "ckpt"
    assert main(["import-hf", "--model", str(source), "--output-dir", str(out)]) == 2
    line = error_line(capsys)
    assert "model.safetensors" in line and "encoder.layer.1.output.dense.weight" in line, line
    assert "1 of " in line and not out.exists()


def test_the_check_reads_every_float_tensor_and_only_those() -> None:
    weights = {"a": torch.zeros(3), "b": np.array([1.0, np.nan], np.float32),
               "c": torch.tensor([1, 2]), "d": torch.tensor([float("inf")], dtype=torch.bfloat16),
               "e": np.arange(3)}
    assert non_finite_weights(weights) == ["b", "d"]
    check_finite({"a": torch.ones(2)}, "x")  # finite: nothing said
    with pytest.raises(ValueError, match=r"^w: 1 of 1 weight tensors are not finite"):
        check_finite({"z": torch.tensor([float("nan")])}, "w", ValueError)
