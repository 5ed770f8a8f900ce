"""Sentence(-pair) classification: reading TSV/CSV/JSONL, label errors, metrics, training.

The committed fixture is tests/fixtures/classification/sentiment.tsv (SST-2 layout, see its
README); the training test fine-tunes the real MiniLM checkpoint on it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from popbert.cli import main as cli
from popbert.data.classification import (
    ClassificationData,
    classification_metrics,
    encode_classification,
    label_ids,
    label_list,
    read_classification_file,
)
from popbert.data.errors import DataError
from popbert.data.tokenization import WordPieceTokenizer

FIXTURE = Path(__file__).parent.parent / "fixtures" / "classification" / "sentiment.tsv"


def test_tsv_fixture_reads_with_default_columns() -> None:
    data = read_classification_file(FIXTURE)
    assert len(data) == 16 and data.pairs is None
    assert data.texts[0] == "a wonderful , moving film with superb acting"
    assert label_list(data) == ["0", "1"]
    assert label_ids(data, ["0", "1"]).tolist() == [1, 0] * 8
    assert data.lines[:2] == [2, 3]


def test_pairs_in_csv_and_jsonl(tmp_path: Path) -> None:
    csv_file = tmp_path / "pairs.csv"
    csv_file.write_text('id,sentence1,sentence2,label\n'
                        '1,"He said ""yes"", then left.",He agreed and went away.,equivalent\n'
                        '2,"A, B and C",Nothing alike,not_equivalent\n')
    data = read_classification_file(csv_file)
    assert data.texts == ['He said "yes", then left.', "A, B and C"]
    assert data.pairs == ["He agreed and went away.", "Nothing alike"]
    assert label_list(data) == ["equivalent", "not_equivalent"]

    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text('{"premise": "p1", "hypothesis": "h1", "label": 2}\n\n'
                     '{"premise": "p2", "hypothesis": "h2", "label": 10}\n'
                     '{"premise": "p3", "hypothesis": "h3", "label": 0}\n')
    data = read_classification_file(jsonl)
    assert data.pairs == ["h1", "h2", "h3"] and data.lines == [1, 3, 4]
    assert label_list(data) == ["0", "2", "10"]  # numeric order, not "0", "10", "2"

    mrpc = tmp_path / "mrpc.tsv"  # GLUE's MRPC layout: bare quotes, columns named by hand
    mrpc.write_text('Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n'
                    '1\t1\t2\tHe said "no".\tHe refused.\n')
    data = read_classification_file(mrpc, text_column="#1 String", pair_column="#2 String",
                                    label_column="Quality")
    assert data.texts == ['He said "no".'] and data.pairs == ["He refused."]
    assert data.labels == ["1"]


def test_encoding_pairs_and_truncation() -> None:
    tokenizer = WordPieceTokenizer()
    data = read_classification_file(FIXTURE)
    data.pairs = ["a short second text"] * len(data)
    arrays = encode_classification(data, tokenizer, max_seq_length=12)
    first = tokenizer.encode(data.texts[0])
    second = tokenizer.encode("a short second text")
    assert len(first) + len(second) + 3 > 12
    ids, segments, mask = (arrays[k][0] for k in ("input_ids", "segment_ids", "input_mask"))
    assert mask.sum() == 12
    # Google's rule: drop tokens from the end of the longer text until the pair fits.
    a, b = list(first), list(second)
    while len(a) + len(b) > 9:
        (a if len(a) > len(b) else b).pop()
    assert ids.tolist() == [tokenizer.cls_id, *a, tokenizer.sep_id, *b, tokenizer.sep_id]
    assert segments.tolist() == [0] * (len(a) + 2) + [1] * (len(b) + 1)


def test_left_truncation_keeps_the_ends_as_hugging_faces_tokenizer_does(tmp_path: Path
                                                                         ) -> None:
    """`truncation_side="left"` (TEI's `truncation_direction: Left`) against transformers'
    BertTokenizerFast on the same vocabulary with `truncation_side="left"`: a text, and a pair
    whose long second text is the one cut (where Google's rule and HF's longest-first agree)."""
    from transformers import BertTokenizerFast

    from popbert.data.tokenization import bundled_vocab_path

    (tmp_path / "vocab.txt").write_bytes(bundled_vocab_path().read_bytes())
    hf = BertTokenizerFast.from_pretrained(str(tmp_path), do_lower_case=True,
                                           truncation_side="left")
    text = ("The committee met on Tuesday to discuss the new budget, and after a long debate "
            "the members voted to approve the plan for the coming year")
    data = ClassificationData(Path("rows"), [text, "short"], None, None, [1, 2],
                              truncation_side="left")
    arrays = encode_classification(data, WordPieceTokenizer(), max_seq_length=12)
    expected = hf(text, max_length=12, truncation=True)["input_ids"]
    assert arrays["input_ids"][0].tolist() == expected
    pairs = ClassificationData(Path("rows"), ["who voted"], [text], None, [1],
                               truncation_side="left")
    arrays = encode_classification(pairs, WordPieceTokenizer(), max_seq_length=16)
    expected = hf("who voted", text, max_length=16, truncation="longest_first")
    assert arrays["input_ids"][0].tolist() == expected["input_ids"]
    assert arrays["segment_ids"][0].tolist() == expected["token_type_ids"]


def test_label_and_column_errors_name_the_problem(tmp_path: Path) -> None:
    dev = tmp_path / "dev.tsv"
    dev.write_text("sentence\tlabel\nfine\t1\nodd\t2\n")
    with pytest.raises(DataError, match=r"dev.tsv:3: unknown label '2' \(labels: 0, 1\)"):
        label_ids(read_classification_file(dev), ["0", "1"])
    with pytest.raises(DataError, match=r"no label column 'gold' \(columns: sentence, label\)"):
        read_classification_file(dev, label_column="gold")
    with pytest.raises(DataError, match=r"no text column 'review'"):
        read_classification_file(dev, text_column="review")
    unnamed = tmp_path / "unnamed.tsv"
    unnamed.write_text("body\tlabel\nx\t1\n")
    with pytest.raises(DataError, match="no text column; name one with --text-column"):
        read_classification_file(unnamed)
    ragged = tmp_path / "ragged.tsv"
    ragged.write_text("sentence\tlabel\nok\t1\nmissing a label\n")
    with pytest.raises(DataError, match=r"ragged.tsv:3: 1 fields, the header has 2"):
        read_classification_file(ragged)
    one = tmp_path / "one.jsonl"
    one.write_text('{"text": "a", "label": "x"}\n{"text": "b"}\n')
    with pytest.raises(DataError, match=r"one.jsonl: 1 of 2 rows have no label in column "
                                        r"'label' \(line 2\); refused \(strict\)"):
        read_classification_file(one, strict=True)  # without strict: left out, said once
    one.write_text('{"text": "a", "label": "x"}\n{"label": "y"}\n')
    with pytest.raises(DataError, match=r"one.jsonl:2: missing value in column 'text'"):
        read_classification_file(one)
    with pytest.raises(DataError, match="unknown format '.txt'"):
        read_classification_file(tmp_path / "data.txt")
    single = tmp_path / "single.tsv"
    single.write_text("sentence\tlabel\na\tpos\nb\tpos\n")
    with pytest.raises(DataError, match="only one label"):
        label_list(read_classification_file(single))


def test_metrics() -> None:
    predictions = np.array([1, 1, 0, 0, 1, 0])
    labels = np.array([1, 0, 0, 1, 1, 0])
    metrics = classification_metrics(predictions, labels, 2)
    assert metrics["accuracy"] == pytest.approx(4 / 6)
    assert metrics["f1"] == pytest.approx(2 * 2 / (2 * 2 + 1 + 1))  # class 1: tp 2, fp 1, fn 1
    three = classification_metrics(np.array([0, 1, 2, 2]), np.array([0, 1, 1, 2]), 3)
    assert three["f1"] == pytest.approx((1.0 + 2 / 3 + 2 / 3) / 3)  # macro average


def test_cli_label_errors_are_one_line(tmp_path: Path,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from popbert.config import dump_config, load_config
    from popbert.io.checkpoint import Checkpoint, save_checkpoint

    checkpoint = tmp_path / "ckpt"  # the data is checked before any weight is needed
    save_checkpoint(checkpoint, Checkpoint(step=0, weights={}), dump_config(load_config("tiny")))
    missing = tmp_path / "nolabel.tsv"
    missing.write_text("sentence\nhello\n")
    for argv, fragment in [
        (["--train", str(missing)], "no label column 'label'"),
        (["--train", str(FIXTURE), "--labels", "pos,neg"], "unknown label '1'"),
    ]:
        code = cli.main(["finetune", "classify", "--checkpoint", str(checkpoint),
                         "--output-dir", str(tmp_path / "out"), *argv])
        lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
        assert code == 2, lines
        assert len(lines) == 1 and fragment in lines[0], lines
        assert not (tmp_path / "out").exists()


@pytest.mark.e2e
def test_finetuning_minilm_on_the_fixture_reports_accuracy(
        tmp_path: Path, minilm_imported: Path, caplog: pytest.LogCaptureFixture) -> None:
    imported, run = minilm_imported, tmp_path / "sst"
    caplog.set_level("WARNING", logger="popbert")
    assert cli.main(["finetune", "classify", "--checkpoint", str(imported), "--train",
                     str(FIXTURE), "--output-dir", str(run), "--max-seq-length", "32",
                     "--epochs", "4", "--batch-size", "8", "--lr", "1e-4",
                     "--warmup-proportion", "0", "--dropout", "0", "--log-every", "1"]) == 0
    results = json.loads((run / "eval_results.json").read_text())
    assert results["examples"] == 16
    assert results["accuracy"] == 1.0 and results["f1"] == 1.0
    losses = [json.loads(line)["loss"] for line in
              (run / "metrics.jsonl").read_text().splitlines()]
    assert len(losses) == 8 and losses[-1] < losses[0]
    predictions = [json.loads(line) for line in
                   (run / "eval_predictions.jsonl").read_text().splitlines()]
    assert [p["label"] for p in predictions] == ["1", "0"] * 8
    assert "collapsed" not in caplog.text  # both classes predicted: no warning
    from popbert.config import load_config

    task = load_config(run / "config.yaml").model.task
    assert task.name == "classification" and task.labels == ["0", "1"]
    # The fine-tuned model leaves as a Hugging Face classifier that predicts the same.
    out = tmp_path / "hf"
    assert cli.main(["export-hf", "--checkpoint", str(run), "--output-dir", str(out)]) == 0
    import os

    os.environ["HF_HUB_OFFLINE"] = "1"
    import torch
    import transformers

    model, info = transformers.BertForSequenceClassification.from_pretrained(
        str(out), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    tokenizer = transformers.BertTokenizer.from_pretrained(str(out))
    texts = read_classification_file(FIXTURE).texts
    with torch.no_grad():
        logits = model.eval()(**tokenizer(texts, padding=True, return_tensors="pt")).logits
    assert [model.config.id2label[int(i)] for i in logits.argmax(-1)] == ["1", "0"] * 8


@pytest.mark.e2e
def test_a_classifier_collapsed_to_one_class_is_warned_about(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A real collapsed run: a model pre-trained for 2 steps, fine-tuned for one epoch,
    predicts one class for every row; accuracy (0.5, the class's share) would hide it."""
    assert cli.main(["pretrain", "--set", "model.num_layers=1", "--set", "model.hidden_size=32",
                     "--set", "model.num_heads=2", "--set", "model.intermediate_size=64",
                     "--set", "training.steps=2", "-o", str(tmp_path / "pre")]) == 0
    caplog.clear()
    with caplog.at_level("WARNING", logger="popbert"):
        assert cli.main(["finetune", "classify", "--checkpoint", str(tmp_path / "pre"),
                         "--train", str(FIXTURE), "-o", str(tmp_path / "run"), "--epochs", "1",
                         "--batch-size", "8", "--max-seq-length", "32", "--lr", "1e-3"]) == 0
    predicted = {json.loads(line)["label"] for line in
                 (tmp_path / "run" / "eval_predictions.jsonl").read_text().splitlines()}
    assert len(predicted) == 1
    (label,) = predicted
    assert (f"all 16 predictions are {label!r} while the file holds 2 classes: the classifier "
            f"collapsed to one class") in caplog.text

