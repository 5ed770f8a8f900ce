"""Nothing cut in silence (issue 31 item 3): what pairing truncates to fit a sequence, sentences
longer than a sequence holds, and classification rows without a label are counted, said once,
and refused under `--strict` / `data.strict: true` in one line. Known answers from text built
so that the counts follow from the algorithm: "the" is one token of the bundled vocabulary."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from popbert.cli.main import main
from popbert.data import DataError
from popbert.data.classification import read_classification_file
from popbert.data.loader import load_or_create_instances
from popbert.data.tokenization import bundled_vocab_path

SEQ = 128
HOLDS = SEQ - 3  # tokens of A and B in one [CLS] A [SEP] B [SEP]


def sentence(tokens: int) -> str:
    return " ".join(["the"] * tokens)


def write(path: Path, documents: list[list[str]]) -> Path:
    path.write_text("\n\n".join("\n".join(d) for d in documents) + "\n", encoding="utf-8")
    return path


def instances(tmp_path: Path, corpus: Path, out: str, *extra: str) -> int:
    return main(["prepare-data", "instances", "--input", str(corpus), "--vocab",
                 str(bundled_vocab_path()), "--sequence-length", str(SEQ), "--max-predictions",
                 "20", "--dupe-factor", "2", "--short-seq-prob", "0", "--workers", "1",
                 "-o", str(tmp_path / out), *extra])


def one_line_error(capsys: pytest.CaptureFixture[str]) -> str:
    captured = capsys.readouterr().err
    errors = [line for line in captured.splitlines() if line.startswith("popbert:")]
    assert len(errors) == 1 and "Traceback" not in captured, captured
    return errors[0]


def test_long_sentences_and_pair_truncation_are_counted_said_once_and_refused_when_strict(
        tmp_path, caplog, capsys):
    # 30 documents of one 200-token sentence: every document makes one pair per pass, its
    # sentence split at a random token. A real next pair (A and B halves) loses 200 - 125
    # tokens to truncation; a random next pair keeps the head as A, drops the tail (a split
    # sentence's tail is not put back) and truncates A plus a whole 200-token B to 125.
    long = 200
    corpus = write(tmp_path / "long.txt", [[sentence(long)]] * 30)
    with caplog.at_level(logging.INFO, logger="popbert"):
        assert instances(tmp_path, corpus, "warned") == 0
    stats = json.loads((tmp_path / "warned" / "_SUCCESS.json").read_text())["stats"]
    pairs, random_next = stats["instances_written_now"], stats["random_next_written_now"]
    assert pairs == 60 and 0 < random_next < 60
    assert stats["sentences_over_length_now"] == 30
    assert stats["pairs_truncated_now"] == 60
    assert (stats["tokens_truncated_now"] + stats["split_tail_tokens_dropped_now"]
            == (long - HOLDS) * pairs + long * random_next)
    assert stats["split_tail_tokens_dropped_now"] > 0
    warned = [r.getMessage() for r in caplog.records if "longer than a sequence" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith(f"{corpus}: 30 of 30 sentences are longer "
                                                     f"than a sequence holds ({HOLDS} tokens")
    assert f"the longest has {long}" in warned[0]
    said = [r.getMessage() for r in caplog.records if "pairs truncated" in r.getMessage()]
    assert len(said) == 1 and "60 of 60 pairs truncated to 125 tokens" in said[0], said

    capsys.readouterr()
    assert instances(tmp_path, corpus, "strict", "--strict") == 2
    error = one_line_error(capsys)
    assert "30 of 30 sentences are longer than a sequence holds" in error
    assert error.endswith("refused (strict)")
    assert not (tmp_path / "strict").exists()


def test_text_that_fits_cuts_nothing_and_passes_strict(tmp_path, caplog):
    # Documents of two 10-token sentences: a chunk never reaches the 125-token target, and a
    # random B (from a random sentence of another such document to its end) holds at most 20
    # tokens, so no pair is truncated; only split sentences' tails are left out.
    corpus = write(tmp_path / "fits.txt", [[sentence(10), sentence(10)]] * 30)
    with caplog.at_level(logging.INFO, logger="popbert"):
        assert instances(tmp_path, corpus, "fits", "--strict") == 0
    stats = json.loads((tmp_path / "fits" / "_SUCCESS.json").read_text())["stats"]
    assert stats["sentences_over_length_now"] == 0
    assert stats["pairs_truncated_now"] == 0 and stats["tokens_truncated_now"] == 0
    assert "WARNING" not in caplog.text
    assert f"0 of {stats['instances_written_now']} pairs truncated" in caplog.text


def test_pretraining_on_text_counts_long_sentences_and_strict_refuses_them(tmp_path, caplog,
                                                                          capsys):
    corpus = write(tmp_path / "corpus.txt",
                   [[sentence(10), sentence(300)], [sentence(10), sentence(10)]] * 5)
    cache = tmp_path / "cache"
    with caplog.at_level(logging.INFO, logger="popbert"):
        load_or_create_instances([str(corpus)], None, SEQ, 20, 1, cache_dir=cache)
    assert caplog.text.count("5 of 20 sentences are longer than a sequence holds") == 1
    assert caplog.text.count("pairs truncated") == 1
    with pytest.raises(DataError, match=r"5 of 20 sentences are longer.*refused \(strict\)"):
        load_or_create_instances([str(corpus)], None, SEQ, 20, 1, cache_dir=cache, strict=True)
    assert main(["pretrain", "--set", f"data.input_files=['{corpus}']", "--set",
                 "data.strict=true", "-o", str(tmp_path / "run")]) == 2
    error = one_line_error(capsys)
    assert "longer than a sequence holds" in error and error.endswith("refused (strict)")
    assert not (tmp_path / "run").exists()


def test_classification_rows_without_a_label_are_left_out_said_once_or_refused(
        tmp_path, caplog, capsys):
    train = tmp_path / "train.tsv"
    train.write_text("sentence\tlabel\ngood\t1\nbad\t0\nunsure\t\nfine\t1\nmeh\t \nawful\t0\n")
    with caplog.at_level(logging.WARNING, logger="popbert"):
        data = read_classification_file(train)
    assert data.texts == ["good", "bad", "fine", "awful"] and data.labels == ["1", "0", "1", "0"]
    assert data.unlabelled == 2 and data.lines == [2, 3, 5, 7]
    assert len(caplog.records) == 1
    assert caplog.records[0].getMessage() == (
        f"{train}: 2 of 6 rows have no label in column 'label' (lines 4, 6): left out")
    jsonl = tmp_path / "train.jsonl"  # JSON: a null or a missing key is no label either
    jsonl.write_text('{"text": "a", "label": 0}\n{"text": "b", "label": null}\n'
                     '{"text": "c"}\n{"text": "d", "label": false}\n')
    data = read_classification_file(jsonl)
    assert data.labels == ["0", "false"] and data.unlabelled == 2
    with pytest.raises(DataError, match=r"2 of 4 rows have no label .*refused \(strict\)"):
        read_classification_file(jsonl, strict=True)
    none = tmp_path / "none.tsv"
    none.write_text("sentence\tlabel\na\t\nb\t\n")
    with pytest.raises(DataError, match="no labelled rows"):
        read_classification_file(none)

    from popbert.config import dump_config, load_config
    from popbert.io.checkpoint import Checkpoint, save_checkpoint

    checkpoint = tmp_path / "ckpt"  # the data is checked before any weight is needed
    save_checkpoint(checkpoint, Checkpoint(step=0, weights={}), dump_config(load_config("tiny")))
    capsys.readouterr()
    assert main(["finetune", "classify", "--checkpoint", str(checkpoint), "--train", str(train),
                 "--set", "data.strict=true", "--output-dir", str(tmp_path / "out")]) == 2
    error = one_line_error(capsys)
    assert "2 of 6 rows have no label" in error and error.endswith("refused (strict)")
    assert not (tmp_path / "out").exists()
