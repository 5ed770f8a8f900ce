"""Stage `sentences`: documents → Google's input format (one sentence per line, a blank line
between documents), one output part per work unit: an input file, or with a part size a byte
range or run of row groups of one (`popbert.data.documents`: the `extract` stage's parts, JSON
lines with any text field, Parquet, one document per line).

Sentence splitters that need no download: `nupunkt` (Punkt with its model shipped in the wheel;
the default, ~50x faster than pysbd on Wikipedia prose) or `pysbd` (rule-based; what the bundled
corpus was made with). Each paragraph is split on its own, so a sentence never spans paragraphs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable

from popbert.data import storage
from popbert.data.corpus import name_files
from popbert.data.documents import Unit, plan_units, read_unit
from popbert.data.errors import DataError
from popbert.data.stages import StageDir, atomic_output, part_name, run_units, workers_label
from popbert.data.storage import Location

log = logging.getLogger(__name__)

SPLITTERS = ("nupunkt", "pysbd")
SENTENCES_SUFFIX = "txt"
DEFAULT_MIN_SENTENCES = 2
#: pysbd's time grows with the square of a paragraph's length (40 KB: 2 s, 200 KB: 33 s; a
#: one-line document of megabytes would take hours), so a longer paragraph is segmented a
#: window of this many characters at a time (`windowed_sentences`).
PYSBD_WINDOW = 10_000

Splitter = Callable[[str], list[str]]


def make_splitter(name: str = "nupunkt") -> Splitter:
    """A function paragraph → sentences (whitespace collapsed, empties dropped)."""
    if name == "nupunkt":
        try:
            import nupunkt
        except ImportError:
            raise DataError("sentence splitter 'nupunkt' is not installed: "
                            "pip install 'popbert[data]'") from None

        def raw(text: str) -> list[str]:
            return nupunkt.sent_tokenize(text)
    elif name == "pysbd":
        try:
            import pysbd
        except ImportError:
            raise DataError("sentence splitter 'pysbd' is not installed: "
                            "pip install 'popbert[data]'") from None
        segmenter = pysbd.Segmenter(language="en", clean=False, char_span=True)

        def spans(text: str) -> list[tuple[str, int]]:
            return [(span.sent, span.start) for span in segmenter.segment(text)]

        def raw(text: str) -> list[str]:
            return windowed_sentences(text, spans, PYSBD_WINDOW)
    else:
        raise DataError(f"unknown sentence splitter {name!r}; choose one of {', '.join(SPLITTERS)}")

    def split(paragraph: str) -> list[str]:
        return [s for s in (" ".join(x.split()) for x in raw(paragraph)) if s]

    return split


def windowed_sentences(text: str, spans: Callable[[str], list[tuple[str, int]]],
                       window: int) -> list[str]:
    """The sentences `spans` (text → (sentence, start offset) pairs) finds in `text`, asked of
    at most `window` characters at a time, so a splitter whose time is quadratic in its input
    stays linear in a paragraph's length. A text that fits is asked whole (the same result).
    Otherwise each window's last sentence, which the window may cut, is left for the next
    window to start with, so every boundary is decided with the sentence after it in view. A
    single sentence longer than a window is cut at its last space (it is longer than any
    sequence holds: the instances stage says so when a piece still is)."""
    if len(text) <= window:
        return [sentence for sentence, _ in spans(text)]
    sentences: list[str] = []
    position = 0
    while position < len(text):
        piece = text[position:position + window]
        found = spans(piece)
        if position + window >= len(text):
            sentences.extend(sentence for sentence, _ in found)
            break
        if len(found) > 1 and found[-1][1] > 0:
            sentences.extend(sentence for sentence, _ in found[:-1])
            position += found[-1][1]
        else:
            cut = piece.rfind(" ")
            cut = cut if cut >= window // 2 else window
            sentences.append(piece[:cut])
            position += cut
    return sentences


def document_sentences(text: str, split: Splitter) -> list[str]:
    """Sentences of one article whose paragraphs are separated by newlines."""
    sentences: list[str] = []
    for paragraph in text.split("\n"):
        if paragraph.strip():
            sentences.extend(split(paragraph))
    return sentences


def write_documents(documents: Iterable[list[str]], path: Location) -> tuple[int, int]:
    """Google format, atomically; returns (documents, sentences) written."""
    docs = sents = 0
    with atomic_output(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for sentences in documents:
            if docs:
                f.write("\n")
            f.write("\n".join(sentences))
            f.write("\n")
            docs += 1
            sents += len(sentences)
    return docs, sents


def no_text(empty: int, articles: int, where: str, text_field: str) -> str:
    """How a stage says that `empty` of `articles` documents have no text."""
    return (f"{where}: {empty:,} of {articles:,} documents have no text (null or blank in the "
            f"text field {text_field!r})")


def split_part(unit: Unit, out_path: str, splitter: str, min_sentences: int,
               strict: bool = False) -> dict:
    """One unit of documents → one sentence part; returns counts. Documents without text are
    counted and left out, or under `strict` refused before the part is written."""
    split = make_splitter(splitter)
    articles = chars = dropped = empty = 0

    def documents() -> Iterable[list[str]]:
        nonlocal articles, chars, dropped, empty
        for text in read_unit(unit):
            articles += 1
            if not text:  # a null or blank text, in any format (`read_unit`)
                empty += 1
                continue
            sentences = document_sentences(text, split)
            if len(sentences) < min_sentences:
                dropped += 1
                continue
            chars += sum(len(s) for s in sentences)
            yield sentences
        if strict and empty:  # inside the write: the part is not published
            raise DataError(f"{no_text(empty, articles, unit.path, unit.text_field)}; "
                            f"refused (strict)")

    docs, sents = write_documents(documents(), storage.location(out_path))
    return {"articles": articles, "documents": docs, "sentences": sents, "chars": chars,
            "dropped": dropped, "empty": empty}


def split_sentences(input_parts: list[Location], output_dir: str | os.PathLike, workers: int = 1,
                    splitter: str = "nupunkt",
                    min_sentences: int = DEFAULT_MIN_SENTENCES, *, fmt: str | None = None,
                    text_field: str = "text", part_bytes: int | None = None,
                    strict: bool = False) -> dict:
    """Stage `sentences`: documents → `output_dir/part-*.txt`; returns the record.

    `input_parts`: the `extract` stage's parts or any corpus files `popbert.data.documents`
    reads (`fmt` None: told by each file's suffix), cut into units of about `part_bytes` (None:
    a unit per file). Parts may come out empty (every article filtered out), but a stage
    without any document is a DataError naming the input, with no completion marker and no
    directory left behind. Documents without text (a null or blank text field, in any format)
    are counted and said once, or under `strict` refused, leaving nothing this run made.
    """
    make_splitter(splitter)  # fail fast on an unknown or missing splitter
    if min_sentences < 1:
        raise DataError(f"min_sentences must be >= 1, got {min_sentences}")
    if not input_parts:
        raise DataError("no extracted parts to split into sentences")
    units = plan_units(input_parts, fmt, text_field, part_bytes)  # checks Parquet columns
    params = {"splitter": splitter, "min_sentences": min_sentences,
              "inputs": [storage.name_of(p) for p in input_parts]}
    if (fmt, text_field, part_bytes) != (None, "text", None):  # older records stay valid
        params.update(format=fmt, text_field=text_field, part_bytes=part_bytes)
    stage = StageDir(output_dir, "sentences", params).open()
    if stage.complete:
        log.info("%s: sentences already complete", stage.path)
        return stage.success()
    done = {storage.name_of(p) for p in stage.parts(SENTENCES_SUFFIX)}
    jobs = [(unit, str(storage.join(stage.path, part_name(i, SENTENCES_SUFFIX))), splitter,
             min_sentences, strict)
            for i, unit in enumerate(units) if part_name(i, SENTENCES_SUFFIX) not in done]
    log.info("splitting %d parts into sentences (%s, %s; %d already done)",
             len(jobs), splitter, workers_label(workers), len(units) - len(jobs))
    try:
        results = run_units(split_part, jobs, workers, desc="sentences", total=len(jobs))
    except DataError as exc:  # bad input found mid-stage: leave nothing this run made
        raise stage.abandon(str(exc)) from None
    # A part without documents is an empty file (parts written by an earlier run count too).
    articles = sum(r["articles"] for r in results)
    empty = sum(r["empty"] for r in results)
    if not any(storage.size(part) for part in stage.parts(SENTENCES_SUFFIX)):
        if articles and empty == articles:
            detail = (f"none of its {articles:,} has text (null or blank in the text field "
                      f"{text_field!r}, --text-field)")
        elif articles:
            detail = (f"all {articles - empty} articles have fewer than {min_sentences} "
                      f"sentences (--min-sentences)")
        elif len(jobs) == len(units):
            detail = "the input holds no documents"
        else:  # only parts an earlier run wrote (empty): their article counts are gone
            detail = f"no article has {min_sentences} or more sentences (--min-sentences)"
        raise stage.abandon(f"{name_files(input_parts)}: empty corpus: no documents: {detail}")
    if empty:  # every format alike (`documents.read_unit`), said once for the stage
        log.warning("%s: left out", no_text(empty, articles, name_files(input_parts),
                                            text_field))
    dropped = sum(r["dropped"] for r in results)
    if dropped:  # cut on purpose, and said: NSP pairs need two sentences of one document
        log.info("sentences: %d of %d articles dropped with fewer than %d sentences "
                 "(--min-sentences)", dropped, sum(r["articles"] for r in results),
                 min_sentences)
    stats = {"parts": len(units), "parts_skipped": len(units) - len(jobs),
             "documents_written_now": sum(r["documents"] for r in results),
             "sentences_written_now": sum(r["sentences"] for r in results),
             "documents_dropped_short_now": dropped,
             "documents_without_text_now": empty}
    return stage.finish([storage.name_of(p) for p in stage.parts(SENTENCES_SUFFIX)], stats)
