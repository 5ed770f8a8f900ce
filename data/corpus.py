"""Read Google-format text corpora into tokenized documents.

Google BERT's input format (what `create_pretraining_data.py` reads): plain UTF-8 text, one
sentence per line, a blank line between documents. Documents matter because next-sentence pairs
are drawn from within one document and random "next" segments from another.
"""

from __future__ import annotations

import glob
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from popbert.data import storage
from popbert.data.errors import DataError
from popbert.data.instances import check_long_sentences, long_sentences
from popbert.data.storage import Location
from popbert.data.tokenization import TextTokenizer
from popbert.textfile import decode

log = logging.getLogger(__name__)

PathsLike = str | os.PathLike | Sequence[str | os.PathLike]

# Sentences per encode_batch call: big enough for the Rust side to parallelise, small enough to
# bound memory on multi-GB dumps.
ENCODE_CHUNK = 8192
#: Above this share of `[UNK]` tokens a vocabulary does not fit its corpus (another language,
#: casing or domain): the most expensive silent mistake in pre-training, so it is warned about,
#: and refused under `data.strict` / `--strict`. A fitting WordPiece vocabulary maps well under
#: 1% of Wikipedia's tokens to `[UNK]`; byte-level BPE never does.
UNKNOWN_SHARE_LIMIT = 0.02


def expand_input_files(input_files: PathsLike) -> list[Location]:
    """Expand paths, comma-separated lists and glob patterns into a sorted, de-duplicated list.

    Sorting makes the document order, and so every seeded result, independent of file-system
    listing order. A pattern matching nothing is an error: a silent empty corpus wastes a run.
    URLs (`s3://bucket/shards/part-*.h5`) are listed on their storage and stay text
    (`popbert.data.storage`); local paths become `Path`s.
    """
    if isinstance(input_files, (str, os.PathLike)):
        items: list[str] = [p for p in os.fspath(input_files).split(",") if p]
    else:
        items = [os.fspath(p) for p in input_files]
    files: list[Location] = []
    for item in items:
        if storage.is_url(item):
            files.extend(storage.expand(item))
            continue
        item = os.fspath(storage.location(item))
        if glob.has_magic(item):
            matches = sorted(glob.glob(item))
            if not matches:
                raise DataError(f"{item}: no input files match this pattern")
            directory = next((m for m in matches if os.path.isdir(m)), None)
            if directory is not None:  # read as a file it would fail mid-stage
                raise DataError(f"{item}: matches the directory {directory}; a glob must "
                                f"match files only")
            files.extend(Path(m) for m in matches)
        else:
            path = Path(item)
            if not path.is_file():
                found = "a directory, not a file" if path.is_dir() else "input file not found"
                raise DataError(f"{path}: {found}")
            files.append(path)
    seen: set[Location] = set()
    unique = []
    for f in files:
        key = f.resolve() if isinstance(f, Path) else f
        if key not in seen:
            seen.add(key)
            unique.append(f)
    if not unique:
        raise DataError("no input files given")
    return unique


def name_files(files: Sequence[str | os.PathLike]) -> str:
    """How a one-line error names its input: the file itself, or the first few of many."""
    if len(files) == 1:
        return os.fspath(files[0])
    shown = ", ".join(os.fspath(f) for f in files[:3])
    return f"{shown}{', ...' if len(files) > 3 else ''} ({len(files)} files)"


def has_text(path: str | os.PathLike) -> bool:
    """Whether a text file has a non-blank line; reads only up to the first one, so checking a
    multi-GB corpus costs nothing while an empty file is caught before any work."""
    with storage.open_input(storage.location(path), "r", encoding="utf-8",
                            errors="replace") as f:
        return any(line.strip() for line in f)


def read_text_documents(input_files: PathsLike) -> list[list[str]]:
    """Documents as lists of sentence strings; blank lines split documents, empties dropped.

    A new file always starts a new document, as in Google's reader.
    """
    documents: list[list[str]] = []
    for path in expand_input_files(input_files):
        current: list[str] = []
        offset = 0
        with storage.open_input(path, "rb") as f:
            for raw in f:
                line = decode(raw, path, "text, one sentence a line", offset=offset,
                              error=DataError).strip()
                offset += len(raw)
                if line:
                    current.append(line)
                elif current:
                    documents.append(current)
                    current = []
        if current:
            documents.append(current)
    return documents


def tokenize_documents(documents: Iterable[Sequence[str]], tokenizer: TextTokenizer,
                       chunk_size: int = ENCODE_CHUNK) -> list[list[list[int]]]:
    """Tokenize documents of sentences in large batches; sentences with no tokens are dropped."""
    documents = [list(d) for d in documents]
    flat = [s for d in documents for s in d]
    ids: list[list[int]] = []
    for start in range(0, len(flat), chunk_size):
        ids.extend(tokenizer.encode_batch(flat[start:start + chunk_size]))
    out: list[list[list[int]]] = []
    pos = 0
    for doc in documents:
        sentences = [s for s in ids[pos:pos + len(doc)] if s]
        pos += len(doc)
        if sentences:
            out.append(sentences)
    return out


def unknown_tokens(documents: Iterable[Sequence[Sequence[int]]],
                   tokenizer: TextTokenizer) -> tuple[int, int]:
    """(tokens that are `[UNK]`, all tokens) of tokenized documents."""
    unknown = total = 0
    for document in documents:
        for sentence in document:
            total += len(sentence)
            unknown += list(sentence).count(tokenizer.unk_id)
    return unknown, total


def check_unknown_share(unknown: int, total: int, where: str, strict: bool = False) -> float:
    """The share of `[UNK]` tokens; above `UNKNOWN_SHARE_LIMIT` a warning naming `where`, or
    under `strict` a DataError."""
    share = unknown / total if total else 0.0
    if share > UNKNOWN_SHARE_LIMIT:
        message = (f"{where}: {share:.1%} of its tokens are [UNK] ({unknown:,} of {total:,}, "
                   f"more than {UNKNOWN_SHARE_LIMIT:.0%}): the vocabulary does not fit this text "
                   f"(another language, casing or domain?)")
        if strict:
            raise DataError(f"{message}; refused (strict)")
        log.warning(message)
    return share


@dataclass
class TextCounts:
    """What a corpus (or one part of it) holds that instance creation cannot use whole: the
    one set of checks both data roads (text files, `prepare-data instances`) make.

    `unknown_tokens` of `tokens` are `[UNK]`; `long_sentences` of `sentences` are longer than
    a pair holds (`instances.long_sentences`; none with `next_sentence` off, whose rows run
    across sentences), the longest of `longest_sentence` tokens."""

    documents: int = 0
    sentences: int = 0
    tokens: int = 0
    unknown_tokens: int = 0
    long_sentences: int = 0
    longest_sentence: int = 0

    @classmethod
    def of(cls, documents: Sequence[Sequence[Sequence[int]]], tokenizer: TextTokenizer,
           sequence_length: int, next_sentence: bool = True) -> TextCounts:
        unknown, total = unknown_tokens(documents, tokenizer)
        long, longest = (long_sentences(documents, sequence_length) if next_sentence
                         else (0, 0))
        return cls(len(documents), sum(len(d) for d in documents), total, unknown, long,
                   longest)

    def add(self, other: TextCounts) -> None:
        for name, value in asdict(other).items():
            combine = max if name == "longest_sentence" else int.__add__
            setattr(self, name, combine(getattr(self, name), value))

    def check(self, where: str, sequence_length: int, strict: bool = False) -> float:
        """Say once what does not fit (`check_unknown_share`, then
        `instances.check_long_sentences`), or under `strict` refuse it (a DataError); returns
        the `[UNK]` share."""
        share = check_unknown_share(self.unknown_tokens, self.tokens, where, strict)
        check_long_sentences(self.long_sentences, self.longest_sentence, self.sentences,
                             sequence_length, where, strict)
        return share


def read_document_parts(input_files: PathsLike, tokenizer: TextTokenizer
                        ) -> list[list[list[list[int]]]]:
    """Google-format files -> per file, documents -> sentences -> token ids (no special
    tokens): a file is a part, as a sentence part is to `prepare-data instances`, so both
    roads make the same instances of it (`instances.create_corpus_arrays`).

    An empty corpus is a DataError naming the file(s): pointing a run at an empty or wrong file
    is a day-one mistake, and "no documents to create instances from" would not say which.
    Files without documents are said once (they make no instances)."""
    files = expand_input_files(input_files)
    texts = [read_text_documents([f]) for f in files]
    if not any(texts):
        raise DataError(f"{name_files(files)}: empty corpus: no text to make pre-training "
                        f"instances from (expected UTF-8 text, one sentence per line, a blank "
                        f"line between documents)")
    parts = [tokenize_documents(text, tokenizer) for text in texts]
    if not any(parts):
        raise DataError(f"{name_files(files)}: empty corpus: its text has no WordPiece tokens")
    empty = [f for f, part in zip(files, parts, strict=True) if not part]
    if empty:
        log.warning("%s: %d of %d files hold no documents; no instances from them",
                    name_files(empty), len(empty), len(files))
    return parts


def read_documents(input_files: PathsLike, tokenizer: TextTokenizer,
                   strict: bool = False) -> list[list[list[int]]]:
    """`read_document_parts`' documents, all files' in order; the share of `[UNK]` tokens is
    logged, and checked (`check_unknown_share`, `strict`)."""
    files = expand_input_files(input_files)
    documents = [d for part in read_document_parts(files, tokenizer) for d in part]
    unknown, total = unknown_tokens(documents, tokenizer)
    share = check_unknown_share(unknown, total, name_files(files), strict)
    log.info("read %d documents, %d sentences, %d tokens (%.2f%% [UNK])", len(documents),
             sum(len(d) for d in documents), total, 100 * share)
    return documents
