"""Inputs of extreme shape stay linear (issue 31 item 4): every `prepare-data` stage's time
grows linearly with its input whatever its shape — one line of megabytes, one enormous
document, one sentence of a million tokens, a paragraph for pysbd, hundreds of thousands of
one-word lines, many tiny files in a glob.

Each shape runs the real stages at n and 4n, in this process, one worker, and compares CPU
seconds (`time.process_time`: this process's threads only, so a loaded machine slows the
clock on the wall, not this one): linear work takes about 4x, a quadratic step 16x, and the
bound is 8x. Sizes are chosen so that the quadratic steps this file was written against took
10x-13x (a 4 MB sentence: 19 s of CPU, against 1.8 s at 1 MB). Where a step's cost is
countable it is counted instead: the characters a sentence splitter is given, the listings
and tokenizer builds of a stage over many files. Rates at realistic sizes:
benchmarks/extreme_shapes.py, benchmarks/RESULTS_data.md.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from popbert.cli.main import main
from popbert.data import bundled_corpus_path
from popbert.data.instances import truncate_seq_pair
from popbert.data.sentences import windowed_sentences
from popbert.data.tokenization import bundled_vocab_path

LINEAR_BOUND = 8.0  # 4x the input: linear ~4x, quadratic ~16x
MB = 1_000_000


def corpus_text() -> tuple[list[str], list[str]]:
    """(sentences, words without punctuation) of the bundled Wikipedia text."""
    text = bundled_corpus_path().read_text(encoding="utf-8")
    sentences = [s for s in text.splitlines() if s.strip()]
    return sentences, re.sub(r"[^\w\s]", "", text.lower()).split()


SENTENCES, WORDS = corpus_text()


def prose(chars: int, start: int = 0) -> str:
    """Real sentences back to back from the `start`-th on, about `chars` characters."""
    out, size, i = [], 0, start
    while size < chars:
        sentence = SENTENCES[i % len(SENTENCES)]
        out.append(sentence)
        size += len(sentence) + 1
        i += 1
    return " ".join(out)


def words(count: int, joiner: str) -> str:
    return joiner.join(WORDS[i % len(WORDS)] for i in range(count))


def stage(*argv: str) -> float:
    """CPU seconds of one `popbert prepare-data` call (it must succeed)."""
    started = time.process_time()
    assert main(["prepare-data", *map(str, argv)]) == 0
    return time.process_time() - started


def instances_args(source: Path, out: Path) -> list:
    return ["instances", "--input", source, "--vocab", bundled_vocab_path(),
            "--sequence-length", 128, "--max-predictions", 20, "--dupe-factor", 1,
            "--workers", 1, "-o", out]


def assert_linear(name: str, run: Callable[[int, str], float], n: int) -> None:
    """`run(size, tag)` at n and 4n takes less than LINEAR_BOUND times longer at 4n. Once
    more, interleaved, before failing: a linear stage fails twice only if something else
    steals this process's CPU time (caches, frequency) for 2x, which it does not."""
    ratios = []
    for attempt in range(2):
        small = run(n, f"{attempt}-small")
        large = run(4 * n, f"{attempt}-large")
        ratios.append(large / max(small, 1e-3))
        if ratios[-1] < LINEAR_BOUND:
            return
    pytest.fail(f"{name}: 4x the input took {ratios[0]:.1f}x and {ratios[1]:.1f}x the CPU time "
                f"(linear ~4x, quadratic ~16x)")


# ------------------------------------------------------------------------------ fast
def test_truncating_a_pair_is_linear_and_unchanged():
    def google(a: list[int], b: list[int], limit: int, rng: random.Random) -> None:
        while len(a) + len(b) > limit:  # Google's loop, quadratic from the front
            trunc = a if len(a) > len(b) else b
            if rng.random() < 0.5:
                del trunc[0]
            else:
                trunc.pop()

    draw = random.Random(0)
    for trial in range(300):
        a = list(range(draw.randint(0, 300)))
        b = list(range(1000, 1000 + draw.randint(0, 300)))
        limit = draw.randint(1, 200)
        expected_a, expected_b, excess = a[:], b[:], max(0, len(a) + len(b) - limit)
        ours, theirs = random.Random(trial), random.Random(trial)
        google(expected_a, expected_b, limit, ours)
        assert truncate_seq_pair(a, b, limit, theirs) == excess
        assert (a, b) == (expected_a, expected_b) and ours.random() == theirs.random()

    def run(n: int, tag: str) -> float:
        started = time.process_time()
        truncate_seq_pair(list(range(n)), list(range(n)), 125, random.Random(1))
        return time.process_time() - started

    assert_linear("truncate_seq_pair", run, 500_000)


def test_a_splitter_is_given_each_character_a_bounded_number_of_times():
    """pysbd is quadratic in its input: `windowed_sentences` gives it windows, and counts
    here show each character is given about once (deterministic, no clock)."""
    text = prose(200_000)
    given: list[int] = []

    def spans(piece: str) -> list[tuple[str, int]]:  # sentences end at ". "
        given.append(len(piece))
        starts = [0] + [m.end() for m in re.finditer(r"\. ", piece)]
        return [(piece[s:e], s) for s, e in zip(starts, [*starts[1:], len(piece)]) if e > s]

    sentences = windowed_sentences(text, spans, 10_000)
    assert "".join(sentences) == text
    assert max(given) <= 10_000 and sum(given) < 1.1 * len(text)
    given.clear()
    unbroken = words(40_000, " ")  # one "sentence": cut at a space a window at a time
    pieces = windowed_sentences(unbroken, spans, 10_000)
    assert "".join(pieces) == unbroken and sum(given) < 1.1 * len(unbroken)
    assert all(len(p) <= 10_000 for p in pieces)


# ------------------------------------------------------------------------------ stages
@pytest.mark.e2e
def test_one_line_of_megabytes(tmp_path):
    """One document on one line (plain text, a document a line): sentences, vocab and
    instances; the single paragraph goes to nupunkt whole."""
    def run(megabytes: int, tag: str) -> float:
        work = tmp_path / tag
        work.mkdir()
        (work / "line.txt").write_text(prose(megabytes * MB) + "\n", encoding="utf-8")
        seconds = stage("sentences", "--input", work / "line.txt", "-o", work / "sentences",
                        "--workers", 1)
        seconds += stage("vocab", "--input", work / "sentences", "-o", work / "vocab.txt",
                         "--vocab-size", 2000)
        return seconds + stage(*instances_args(work / "sentences", work / "instances"))

    assert_linear("one line of prose", run, 1)


@pytest.mark.e2e
def test_one_sentence_of_a_million_tokens(tmp_path):
    """A document of one unbroken sentence (no sentence ends): instance creation truncates
    it to a sequence; that truncation was quadratic (4 MB: 19 s against 1.8 s at 1 MB)."""
    def run(megabytes: int, tag: str) -> float:
        work = tmp_path / tag
        work.mkdir()
        (work / "sentence.txt").write_text(words(megabytes * MB // 6, " ") + "\n",
                                           encoding="utf-8")
        seconds = stage(*instances_args(work / "sentence.txt", work / "instances"))
        record = json.loads((work / "instances" / "_SUCCESS.json").read_text())
        assert record["stats"]["sentences_over_length_now"] == 1
        return seconds

    assert_linear("one unbroken sentence", run, 1)


@pytest.mark.e2e
def test_one_enormous_document_of_paragraphs(tmp_path):
    """One JSON line holding a document of many paragraphs: the sentences stage."""
    def run(megabytes: int, tag: str) -> float:
        work = tmp_path / tag
        work.mkdir()
        paragraphs = [prose(2000, 20 * i) for i in range(megabytes * MB // 2000)]
        (work / "doc.jsonl").write_text(json.dumps({"text": "\n".join(paragraphs)}) + "\n",
                                        encoding="utf-8")
        return stage("sentences", "--input", work / "doc.jsonl", "-o", work / "sentences",
                     "--workers", 1)

    assert_linear("one enormous document", run, 3)


@pytest.mark.e2e
def test_one_line_for_pysbd(tmp_path):
    """pysbd on one long paragraph was quadratic (160 KB: ~28 s); now windowed."""
    def run(kilobytes: int, tag: str) -> float:
        work = tmp_path / tag
        work.mkdir()
        (work / "line.txt").write_text(prose(kilobytes * 1000) + "\n", encoding="utf-8")
        return stage("sentences", "--input", work / "line.txt", "-o", work / "sentences",
                     "--splitter", "pysbd", "--workers", 1)

    assert_linear("one line for pysbd", run, 40)


@pytest.mark.e2e
def test_hundreds_of_thousands_of_one_word_lines(tmp_path):
    """As documents of one sentence (sentences stage, --min-sentences 1), and as one document
    of one-word sentences in Google's format (instances), and the vocabulary on them."""
    def run(lines: int, tag: str) -> float:
        work = tmp_path / tag
        work.mkdir()
        (work / "words.txt").write_text(words(lines, "\n") + "\n", encoding="utf-8")
        seconds = stage("sentences", "--input", work / "words.txt", "-o", work / "sentences",
                        "--min-sentences", 1, "--workers", 1)
        seconds += stage("vocab", "--input", work / "words.txt", "-o", work / "vocab.txt",
                         "--vocab-size", 2000)
        return seconds + stage(*instances_args(work / "words.txt", work / "instances"))

    assert_linear("one-word lines", run, 100_000)


@pytest.mark.e2e
def test_many_tiny_files_in_a_glob(tmp_path, monkeypatch):
    """A glob of n tiny files makes n parts in every stage: the time per file stays the
    same, the directory is listed a fixed number of times whatever n is, and the tokenizer
    is built once, not per part (it was: 15 ms of a part's 27)."""
    from popbert.data import prepare, storage

    listings: list[int] = []
    builds: list[str] = []
    list_parts, load = storage.list_parts, prepare.load_tokenizer

    def counted_list_parts(directory, pattern):
        listings.append(1)
        return list_parts(directory, pattern)

    def counted_load(path, *args):
        builds.append(str(path))
        return load(path, *args)

    monkeypatch.setattr(storage, "list_parts", counted_list_parts)
    monkeypatch.setattr(prepare, "load_tokenizer", counted_load)
    counts: dict[int, tuple[int, int]] = {}

    def run(files: int, tag: str) -> float:
        work = tmp_path / tag
        (work / "in").mkdir(parents=True)
        for i in range(files):
            (work / "in" / f"doc-{i:07d}.txt").write_text(
                f"{SENTENCES[2 * i % len(SENTENCES)]} {SENTENCES[(2 * i + 1) % len(SENTENCES)]}\n",
                encoding="utf-8")
        listings.clear()
        builds.clear()
        prepare._loaded_tokenizer.cache_clear()  # each run builds its own, once
        seconds = stage("sentences", "--input", work / "in" / "*.txt", "-o",
                        work / "sentences", "--workers", 1)
        seconds += stage("vocab", "--input", work / "sentences", "-o", work / "vocab.txt",
                         "--vocab-size", 2000)
        seconds += stage(*instances_args(work / "sentences", work / "instances"))
        record = json.loads((work / "instances" / "_SUCCESS.json").read_text())
        assert record["stats"]["parts"] == files
        counts[files] = (len(listings), len(builds))
        return seconds

    assert_linear("tiny files", run, 250)
    assert counts[250] == counts[1000], counts  # listings and tokenizer builds: not per file
    assert counts[1000][1] <= 2, counts
