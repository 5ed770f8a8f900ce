"""Every reader of a user's file, fed seeded corruptions of a valid one, either reads it or
says what is wrong in one line naming the file: a `PopbertError` (what the CLI prints as one
line with exit status 2), never another exception (which the CLI would print as a traceback).

The corruptions are the ones files really get: a line cut short, a character or a delimiter
deleted or doubled, bytes that are not UTF-8, a NUL, a byte-order mark, an empty line where a
row was, a field's value swapped for a number, `NaN`, `null`, a list or a string holding a lone
surrogate escape (`\\ud800`: valid JSON, not Unicode), the file truncated, an empty file. Each
reader gets 60 of them (seeded), from its own fixture in `tests/fixtures`.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from popbert.config import load_config
from popbert.data.classification import read_classification_file
from popbert.data.embedding_pairs import read_pairs
from popbert.data.retrieval import read_beir
from popbert.data.squad import evaluate_files, read_squad
from popbert.data.token_classification import read_tagged
from popbert.data.tokenization import bundled_vocab_path, load_tokenizer
from popbert.errors import PopbertError
from popbert.serve.predict import read_texts
from popbert.serve.rerank import read_candidates
from popbert.sweep.spec import load_spec

FIXTURES = Path(__file__).parent.parent / "fixtures"
MUTATIONS = 60


def _corrupt(data: bytes, rng: np.random.Generator) -> bytes:
    """One corruption of `data` (see the module's docstring)."""
    kind = int(rng.integers(10))
    at = int(rng.integers(len(data) + 1))
    if kind == 0:  # cut short
        return data[:at]
    if kind == 1:  # a character deleted
        return data[:at] + data[at + 1:]
    if kind == 2:  # a delimiter doubled or dropped
        delimiter = bytes([data[at]]) if at < len(data) and data[at] in b"\t,:{}[]\"" else b"\t"
        return data[:at] + delimiter * int(rng.integers(0, 3)) + data[at + 1:]
    if kind == 3:  # not UTF-8
        return data[:at] + b"\xff\xfe\xc3" + data[at:]
    if kind == 4:
        return data[:at] + b"\x00" + data[at:]
    if kind == 5:
        return b"\xef\xbb\xbf" + data
    if kind == 6:  # a line emptied
        lines = data.split(b"\n")
        lines[int(rng.integers(len(lines)))] = b""
        return b"\n".join(lines)
    if kind == 7:  # a JSON value swapped for another kind
        swap = [b"1e400", b"NaN", b"null", b"[]", b"{}", b"-1", b"true", b"\"\"",
                b"\"a \\ud800 lone surrogate\""]
        for quote in (b"\": \"", b"\":\""):
            start = data.find(quote, at)
            if start >= 0:
                end = data.find(b"\"", start + len(quote))
                if end > 0:
                    return (data[:start + len(quote) - 1] + swap[int(rng.integers(len(swap)))]
                            + data[end + 1:])
        return data.replace(b"\t", b"\tNaN\t", 1)
    if kind == 8:
        return b""
    return data[:at] + b"\n\n\n" + data[at:]  # blank lines in the middle


def _fixture_copies(source: Path, tmp_path: Path, seed: int):
    rng = np.random.default_rng(seed)
    data = source.read_bytes()
    for index in range(MUTATIONS):
        target = tmp_path / f"{index}-{source.name}"
        target.write_bytes(_corrupt(data, rng))
        yield target


def _read_or_one_line(read, path: Path, names: str) -> bool:
    """Whether `read(path)` read it; a refusal must be one line containing `names`."""
    try:
        read(path)
    except PopbertError as error:
        message = str(error)
        assert message and "\n" not in message.strip(), (path.read_bytes()[:300], message)
        assert names in message, (names, message)
        return False
    return True


def _jsonl_of(source: Path, target: Path) -> Path:
    """The TSV `source` as JSON lines (classification's other format)."""
    header, *rows = source.read_text().splitlines()
    target.write_text("".join(json.dumps(dict(zip(header.split("\t"), row.split("\t")))) + "\n"
                              for row in rows))
    return target


def _csv_of(source: Path, target: Path) -> Path:
    import csv

    with target.open("w", newline="") as handle:
        csv.writer(handle).writerows(line.split("\t") for line in source.read_text().splitlines())
    return target


def _rerank_rows(target: Path) -> Path:
    """A `predict rerank` file: each retrieval fixture query with three leads."""
    queries = [json.loads(line)["text"] for line in
               (FIXTURES / "retrieval" / "queries.jsonl").read_text().splitlines()][:5]
    leads = [json.loads(line)["text"] for line in
             (FIXTURES / "retrieval" / "corpus.jsonl").read_text().splitlines()][:3]
    target.write_text("".join(json.dumps({"query": q, "candidates": [
        {"id": f"d{i}", "text": t} for i, t in enumerate(leads)]}) + "\n" for q in queries))
    return target


def _texts(target: Path) -> Path:
    target.write_text("".join(json.loads(line)["text"] + "\n" for line in
                              (FIXTURES / "retrieval" / "corpus.jsonl").read_text().splitlines()))
    return target


def _tokenizer_json(target: Path) -> Path:
    from tokenizers import BertWordPieceTokenizer

    BertWordPieceTokenizer(str(bundled_vocab_path())).save(str(target))
    return target


def _vocab(target: Path) -> Path:
    target.write_bytes(bundled_vocab_path().read_bytes()[:20_000])  # [PAD] ... a few words
    return target


def _squad_predictions(target: Path) -> Path:
    """`popbert evaluate squad`'s predictions: each sample question's first gold answer."""
    _, dataset = read_squad(FIXTURES / "squad" / "squad-v1.1-sample.json")
    target.write_text(json.dumps({qa["id"]: qa["answers"][0]["text"]
                                  for article in dataset["data"]
                                  for paragraph in article["paragraphs"]
                                  for qa in paragraph["qas"]}, indent=1))
    return target


def _sweep(target: Path) -> Path:
    """A W&B-format sweep file of a pre-training job (`popbert sweep create`)."""
    target.write_text("job: pretrain\nconfig: tiny\nmethod: bayes\nseed: 3\n"
                      "metric:\n  name: loss\n  goal: minimize\n"
                      "set:\n  training.steps: 12\n  model.num_layers: 1\n"
                      "parameters:\n"
                      "  optimizer.lr:\n    distribution: log_uniform_values\n"
                      "    min: 1.0e-4\n    max: 1.0e-2\n"
                      "  optimizer.warmup_steps:\n    values: [0, 2, 4]\n"
                      "early_terminate:\n  type: hyperband\n  min_iter: 2\n")
    return target


SENTIMENT = FIXTURES / "classification" / "sentiment.tsv"
PRESETS = Path(load_config.__code__.co_filename).parent / "presets"
# name: (the valid file, made in a directory if need be; its reader)
READERS = {
    "classification-tsv": (lambda d: SENTIMENT, read_classification_file),
    "classification-jsonl": (lambda d: _jsonl_of(SENTIMENT, d / "rows.jsonl"),
                             read_classification_file),
    "classification-csv": (lambda d: _csv_of(SENTIMENT, d / "rows.csv"),
                           read_classification_file),
    "relatedness": (lambda d: FIXTURES / "classification" / "relatedness.tsv",
                    read_classification_file),
    "embedding-pairs": (lambda d: FIXTURES / "embedding" / "triplets.jsonl", read_pairs),
    "conll": (lambda d: FIXTURES / "ner" / "sample.conll", read_tagged),
    "squad": (lambda d: FIXTURES / "squad" / "squad-v1.1-sample.json", read_squad),
    "squad-predictions": (lambda d: _squad_predictions(d / "predictions.json"),
                          lambda p: evaluate_files(FIXTURES / "squad" / "squad-v1.1-sample.json",
                                                   p)),
    "rerank-candidates": (lambda d: _rerank_rows(d / "candidates.jsonl"), read_candidates),
    "texts": (lambda d: _texts(d / "texts.txt"), read_texts),
    "config-yaml": (lambda d: PRESETS / "finetune-classification.yaml", load_config),
    "sweep-yaml": (lambda d: _sweep(d / "sweep.yaml"), load_spec),
    "tokenizer-json": (lambda d: _tokenizer_json(d / "tokenizer.json"),
                       lambda p: load_tokenizer(p).encode_batch(["a test sentence"])),
    "vocab-txt": (lambda d: _vocab(d / "vocab.txt"),
                  lambda p: load_tokenizer(p).encode_batch(["a test sentence"])),
}


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_corrupted_file_is_read_or_one_line_naming_it(name: str, tmp_path: Path) -> None:
    make, read = READERS[name]
    (tmp_path / "source").mkdir()
    source = make(tmp_path / "source")
    read(source)  # the valid file is read
    read_back = [_read_or_one_line(read, path, path.name)
                 for path in _fixture_copies(source, tmp_path, seed=sorted(READERS).index(name))]
    assert 0 < sum(read_back) < MUTATIONS  # both ways were taken: the fuzz reached past checks


@pytest.mark.parametrize("part", ["corpus.jsonl", "queries.jsonl", "qrels/test.tsv"])
def test_a_corrupted_beir_directory_is_read_or_one_line_naming_it(part: str,
                                                                  tmp_path: Path) -> None:
    source = FIXTURES / "retrieval"
    rng = np.random.default_rng(7)
    read_back = []
    for index in range(MUTATIONS):
        directory = tmp_path / str(index)
        for file in ("corpus.jsonl", "queries.jsonl", "qrels/test.tsv"):
            (directory / file).parent.mkdir(parents=True, exist_ok=True)
            data = (source / file).read_bytes()
            (directory / file).write_bytes(_corrupt(data, rng) if file == part else data)
        read_back.append(_read_or_one_line(read_beir, directory, str(directory)))
    assert 0 < sum(read_back) < MUTATIONS



LONE = "\\ud800"  # as a JSON file writes it: a valid escape of half a surrogate pair
SURROGATE_FILES = {  # name: (file name, its content with one lone surrogate, reader)
    "classification-jsonl": ("rows.jsonl", '{"text": "a good film", "label": "1"}\n'
                             f'{{"text": "a {LONE} film", "label": "0"}}\n',
                             read_classification_file),
    "embedding-pairs": ("pairs.jsonl", f'{{"anchor": "a", "positive": "b {LONE}"}}\n',
                        read_pairs),
    "tagged-jsonl": ("tags.jsonl", f'{{"tokens": ["Ada", "{LONE}"], "tags": ["B-PER", "O"]}}\n',
                     read_tagged),
    "rerank-candidates": ("candidates.jsonl",
                          f'{{"query": "q", "candidates": ["a", "b{LONE}"]}}\n',
                          read_candidates),
    "squad": ("squad.json", '{"version": "1.1", "data": [{"title": "t", "paragraphs": [{'
              f'"context": "Ada wrote{LONE}.", "qas": [{{"id": "1", "question": "Who?", '
              '"answers": [{"text": "Ada", "answer_start": 0}]}]}]}]}', read_squad),
}


@pytest.mark.parametrize("name", sorted(SURROGATE_FILES))
def test_a_lone_surrogate_in_a_json_file_is_one_line_naming_it(name: str,
                                                               tmp_path: Path) -> None:
    """JSON's escapes can write half a surrogate pair, which is no Unicode text: no tokenizer
    reads it (it was a TypeError from `tokenizers`, a traceback, at the first batch)."""
    file_name, content, read = SURROGATE_FILES[name]
    path = tmp_path / file_name
    path.write_text(content)
    with pytest.raises(PopbertError, match=r"a JSON string is not Unicode text \(a lone "
                                           r"surrogate \\ud800 at character \d+\)") as info:
        read(path)
    assert str(path) in str(info.value)


def test_a_lone_surrogate_in_a_pretraining_corpus_is_one_line(tmp_path: Path) -> None:
    from popbert.data.documents import plan_units, read_unit

    path = tmp_path / "corpus.jsonl"
    path.write_text('{"text": "Fine text."}\n' + f'{{"text": "Half {LONE} a pair."}}\n')
    [unit] = plan_units([path])
    with pytest.raises(PopbertError, match="the JSON line at byte 23: a JSON string is not "
                                           "Unicode text"):
        list(read_unit(unit))


def test_a_surrogate_pair_is_text() -> None:
    """Both halves together (an emoji, as ASCII-only JSON writes it) are one character."""
    from popbert.textfile import lone_surrogate

    text = '{"text": "smile \\ud83d\\ude00"}'
    assert lone_surrogate(text, json.loads(text)) is None
