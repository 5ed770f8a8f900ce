"""ModernBERT checkpoints in and out: `popbert import-hf` / `popbert export-hf`.

A directory as people download it (config.json with `model_type: modernbert`, model.safetensors
saved by `save_pretrained` with random weights — no hub is reachable — and a byte-level BPE
tokenizer.json with BERT's special tokens, trained on the bundled corpus) goes through import
and export: the weights come back bit for bit, `transformers` loads the export as the same class
with no missing or unexpected keys and computes the same logits, and its AutoTokenizer gives
popbert's ids. Options popbert does not build are one line naming the field.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch
from modernbert_helpers import hf_model

from popbert.cli.main import main
from popbert.data.tokenization import bundled_corpus_path, load_tokenizer
from popbert.data.vocab import train_bpe

os.environ["HF_HUB_OFFLINE"] = "1"
import transformers  # noqa: E402  (after HF_HUB_OFFLINE: never reach for the network)

VOCAB = 1000


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    train_bpe([bundled_corpus_path()], path, vocab_size=VOCAB)
    return path


def save_hf(cls_name: str, directory: Path, bpe: Path, **overrides) -> Path:
    """A ModernBERT directory as downloaded: config, safetensors, tokenizer.json."""
    model = hf_model(cls_name, vocab_size=VOCAB, pad_token_id=0, cls_token_id=2,
                     sep_token_id=3, bos_token_id=2, eos_token_id=3, **overrides)
    model.save_pretrained(directory)
    shutil.copyfile(bpe, directory / "tokenizer.json")
    return directory


def logits(model_dir: Path, cls_name: str, ids: np.ndarray, mask: np.ndarray) -> np.ndarray:
    model = getattr(transformers, cls_name).from_pretrained(str(model_dir),
                                                            attn_implementation="eager").eval()
    with torch.no_grad():
        return model(input_ids=torch.from_numpy(ids),
                     attention_mask=torch.from_numpy(mask)).logits.numpy()


@pytest.mark.parametrize("cls_name, auto", [
    ("ModernBertForMaskedLM", transformers.AutoModelForMaskedLM),
    ("ModernBertForSequenceClassification", transformers.AutoModelForSequenceClassification),
])
def test_import_then_export_is_bit_identical_and_loads_in_transformers(
        tmp_path: Path, bpe: Path, cls_name: str, auto) -> None:
    extra = ({"num_labels": 3, "id2label": {0: "arts", 1: "science", 2: "sport"},
              "label2id": {"arts": 0, "science": 1, "sport": 2}}
             if "Classification" in cls_name else {})
    source = save_hf(cls_name, tmp_path / "hf", bpe, **extra)
    assert main(["import-hf", "--model", str(source), "--output-dir",
                 str(tmp_path / "imported")]) == 0
    report = json.loads((tmp_path / "imported" / "import.json").read_text())
    assert report["architecture"] == cls_name and not report["ignored"]
    assert (tmp_path / "imported" / "tokenizer.json").is_file()
    assert main(["export-hf", "--checkpoint", str(tmp_path / "imported"), "--output-dir",
                 str(tmp_path / "exported")]) == 0

    theirs = safetensors.numpy.load_file(str(source / "model.safetensors"))
    ours = safetensors.numpy.load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert ours.keys() == theirs.keys()
    for key, value in theirs.items():
        assert np.array_equal(ours[key], value), key

    loaded, info = auto.from_pretrained(str(tmp_path / "exported"), output_loading_info=True)
    assert type(loaded).__name__ == cls_name
    assert not info["missing_keys"] and not info["unexpected_keys"]
    if extra:
        assert loaded.config.id2label == {0: "arts", 1: "science", 2: "sport"}
    rng = np.random.default_rng(0)
    ids = rng.integers(5, VOCAB, (2, 20))
    mask = np.ones_like(ids)
    mask[1, 12:] = 0
    np.testing.assert_array_equal(logits(tmp_path / "exported", cls_name, ids, mask),
                                  logits(source, cls_name, ids, mask))

    hf_tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "exported"))
    text = "Notre Dame's Grotto is a Marian place of prayer."
    ours_tok = load_tokenizer(tmp_path / "exported" / "tokenizer.json")
    assert hf_tokenizer(text)["input_ids"] == [ours_tok.cls_id, *ours_tok.encode(text),
                                               ours_tok.sep_id]


@pytest.mark.parametrize("field, value, expected", [
    ("hidden_activation", "silu", "hidden_activation is 'silu'"),
    ("classifier_pooling", "max", "classifier_pooling is 'max'"),
    ("rope_scaling", {"rope_type": "linear", "factor": 2.0}, "rope_scaling"),
    ("layer_types", ["sliding_attention"] * 4, "layer_types"),
    ("tie_word_embeddings", False, "tie_word_embeddings"),
    ("vocab_size", 500, "1000 entries but config.json vocab_size is 500"),
])
def test_options_popbert_does_not_build_are_one_line(tmp_path: Path, bpe: Path,
                                                     capsys: pytest.CaptureFixture[str],
                                                     field: str, value, expected: str) -> None:
    source = save_hf("ModernBertForMaskedLM", tmp_path / "hf", bpe)
    config = json.loads((source / "config.json").read_text())
    config[field] = value
    (source / "config.json").write_text(json.dumps(config))
    capsys.readouterr()
    assert main(["import-hf", "--model", str(source), "--output-dir",
                 str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and expected in err[0], err
    assert "Traceback" not in err[0] and not (tmp_path / "out").exists()


def test_the_hub_spelling_of_the_config_is_read(tmp_path: Path, bpe: Path) -> None:
    """ModernBERT-base's config.json on the Hub predates `layer_types`/`rope_parameters`:
    `global_attn_every_n_layers` and `*_rope_theta` are read the same way."""
    source = save_hf("ModernBertForMaskedLM", tmp_path / "hf", bpe)
    config = json.loads((source / "config.json").read_text())
    for key in ("layer_types", "rope_parameters"):
        config.pop(key)
    config.update(global_attn_every_n_layers=2, global_rope_theta=5000.0,
                  local_rope_theta=700.0)
    (source / "config.json").write_text(json.dumps(config))
    assert main(["import-hf", "--model", str(source), "--output-dir",
                 str(tmp_path / "imported")]) == 0
    imported = (tmp_path / "imported" / "config.yaml").read_text()
    for line in ("global_attn_every_n_layers: 2", "global_rope_theta: 5000.0",
                 "local_rope_theta: 700.0", "architecture: modernbert"):
        assert line in imported


def test_export_hf_architecture_takes_the_checkpoints_family_classes(
        tmp_path: Path, bpe: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`--architecture` names a class of the checkpoint's family: ModernBertForMaskedLM is
    written and loads in transformers as that class; a BERT class is one line naming
    ModernBERT's classes, exit 2, nothing written."""
    source = save_hf("ModernBertForMaskedLM", tmp_path / "hf", bpe)
    imported = tmp_path / "imported"
    assert main(["import-hf", "--model", str(source), "--output-dir", str(imported)]) == 0
    capsys.readouterr()
    assert main(["export-hf", "--checkpoint", str(imported), "--output-dir",
                 str(tmp_path / "wrong"), "--architecture", "BertForMaskedLM"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    assert "ModernBERT" in err[0] and "'BertForMaskedLM'" in err[0], err
    for name in ("ModernBertModel", "ModernBertForMaskedLM", "ModernBertForQuestionAnswering",
                 "ModernBertForSequenceClassification"):
        assert name in err[0], err
    assert not (tmp_path / "wrong").exists()

    assert main(["export-hf", "--checkpoint", str(imported), "--output-dir",
                 str(tmp_path / "exported"), "--architecture", "ModernBertForMaskedLM"]) == 0
    loaded, info = transformers.AutoModelForMaskedLM.from_pretrained(
        str(tmp_path / "exported"), output_loading_info=True)
    assert type(loaded).__name__ == "ModernBertForMaskedLM"
    assert not info["missing_keys"] and not info["unexpected_keys"]
    ids = np.random.default_rng(1).integers(5, VOCAB, (1, 16))
    mask = np.ones_like(ids)
    np.testing.assert_array_equal(
        logits(tmp_path / "exported", "ModernBertForMaskedLM", ids, mask),
        logits(source, "ModernBertForMaskedLM", ids, mask))
