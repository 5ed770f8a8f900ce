"""Token classification data (NER, CoNLL-2003 style): tagged words, windows, labels, entity F1.

A file is CoNLL (`.conll`, `.txt`, `.tsv`, `.bio`, `.iob`: one word a line, the word in the
first column and its tag in the last, blank lines between sentences, `-DOCSTART-` lines
skipped) or JSON lines (`.jsonl`, `.json`: `{"tokens": [...], "tags": [...]}` a line). Tags in
IOB1, IOB2, BIOES (or IO) are normalised to IOB2 on reading, so training, evaluation and
prediction see one scheme whatever the file spoke; the conversion follows conlleval's chunking
(what seqeval's default mode reads), so a converted file scores exactly as the original.

Words are tokenized one by one (pre-split input); a sentence longer than a model row goes into
overlapping windows and each word is labelled and decoded in exactly one of them, the one where
it has the most context (SQuAD's rule). `entity_metrics` is conlleval's / seqeval's entity F1.
Pure Python and numpy (no torch): serving decodes with the same functions. Every problem with a
file is a one-line DataError naming the file and line.
"""

from __future__ import annotations

import logging
import re
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from popbert.atomic import atomic_write_text
from popbert.data.errors import DataError
from popbert.data.rows import json_lines
from popbert.data.tokenization import TextTokenizer
from popbert.textfile import read_text

log = logging.getLogger(__name__)

__all__ = [
    "IGNORE_INDEX",
    "SCHEMES",
    "TaggedData",
    "TaggedSentence",
    "Window",
    "decode_tags",
    "encode_tagged",
    "entity_metrics",
    "label_list",
    "read_tagged",
    "write_conll",
]

FORMATS = {".conll": "conll", ".txt": "conll", ".tsv": "conll", ".bio": "conll",
           ".iob": "conll", ".jsonl": "jsonl", ".json": "jsonl"}
SCHEMES = ("IOB1", "IOB2", "BIOES", "IO")
# Other spellings of a scheme's name a user may give.
SCHEME_ALIASES = {"IOBES": "BIOES", "BIO": "IOB2", "IOB": "IOB2"}
# The prefixes each scheme's tags may carry (besides "O").
SCHEME_PREFIXES = {"IOB1": "BI", "IOB2": "BI", "BIOES": "BIES", "IO": "I"}
DOCSTART = "-DOCSTART-"
# The label id the loss ignores (torch's CrossEntropyLoss default, transformers' convention).
IGNORE_INDEX = -100
TAG = re.compile(r"([BIES])-(\S+)\Z")


@dataclass
class TaggedSentence:
    """One sentence: its words, their tags (None for prediction input) and where it is."""

    words: list[str]
    tags: list[str] | None
    line: int  # the line of its first word (CoNLL) or its row (JSONL), for messages
    columns: list[list[str]] | None = None  # CoNLL: every column of each word's line

    def word_line(self, index: int) -> int:
        """The line of word `index`: CoNLL words are one a line, a JSONL row holds them all."""
        return self.line + index if self.columns is not None else self.line


@dataclass
class TaggedData:
    """The sentences of one file, tags in IOB2 (`scheme`); `source_scheme` is the file's."""

    path: Path
    sentences: list[TaggedSentence]
    scheme: str
    source_scheme: str

    def __len__(self) -> int:
        return len(self.sentences)

    @property
    def has_tags(self) -> bool:
        """Whether the sentences carry tags (training and evaluation files do)."""
        return bool(self.sentences) and self.sentences[0].tags is not None


# ----------------------------------------------------------------------------------------------
# Reading


def _cells(line: str) -> list[str]:
    """A CoNLL line's columns: tab-separated when it has a tab (words may hold spaces), else
    split on any whitespace."""
    if "\t" in line:
        return [cell.strip() for cell in line.rstrip().split("\t")]
    return line.split()


def _read_conll(path: Path, text: str, require_tags: bool) -> list[TaggedSentence]:
    sentences: list[TaggedSentence] = []
    rows: list[list[str]] = []
    start = 0
    tagged: tuple[bool, int] | None = None  # whether the file has tags, and the line that said

    def close() -> None:
        nonlocal rows, tagged
        if not rows:
            return
        has_tags = len(rows[0]) > 1
        if tagged is None:
            tagged = (has_tags, start)
        elif tagged[0] != has_tags:
            raise DataError(f"{path}:{start}: {len(rows[0])} column"
                            f"{'s' if has_tags else ''}, but line {tagged[1]} has "
                            f"{'a tag column' if tagged[0] else 'only the word'}; a file is "
                            "tagged throughout or not at all")
        if not has_tags and require_tags:
            raise DataError(f"{path}:{start}: one column (a word without a tag); expected the "
                            "word first and its tag last")
        sentences.append(TaggedSentence([row[0] for row in rows],
                                        [row[-1] for row in rows] if has_tags else None,
                                        start, rows))
        rows = []

    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            close()
            continue
        cells = _cells(line)
        if cells[0] == DOCSTART:
            close()
            continue
        if not rows:
            start = number
        elif len(cells) != len(rows[0]):
            raise DataError(f"{path}:{number}: {len(cells)} columns, but the sentence's first "
                            f"word (line {start}) has {len(rows[0])}")
        if not cells[0]:
            raise DataError(f"{path}:{number}: empty word (the first column is blank)")
        if any(not cell for cell in cells[1:]):
            raise DataError(f"{path}:{number}: an empty column")
        rows.append(cells)
    close()
    return sentences


def _read_jsonl(path: Path, text: str, require_tags: bool) -> list[TaggedSentence]:
    sentences: list[TaggedSentence] = []
    tagged: tuple[bool, int] | None = None
    for number, row in json_lines(path, text):
        words = row.get("tokens")
        if not isinstance(words, list) or not all(isinstance(w, str) for w in words):
            raise DataError(f"{path}:{number}: expected \"tokens\": a list of strings")
        tags = row.get("tags")
        if tags is not None and (not isinstance(tags, list)
                                 or not all(isinstance(t, str) for t in tags)):
            raise DataError(f"{path}:{number}: expected \"tags\": a list of strings")
        if tags is None and require_tags:
            raise DataError(f"{path}:{number}: no \"tags\" (a training or evaluation file "
                            "tags every word)")
        if tags is not None and len(tags) != len(words):
            raise DataError(f"{path}:{number}: {len(words)} tokens but {len(tags)} tags")
        for index, word in enumerate(words):
            if not word.strip():
                raise DataError(f"{path}:{number}: token {index} is empty")
        if not words:
            continue
        if tagged is None:
            tagged = (tags is not None, number)
        elif tagged[0] != (tags is not None):
            raise DataError(f"{path}:{number}: {'has' if tags is not None else 'no'} \"tags\", "
                            f"but line {tagged[1]} {'has' if tagged[0] else 'has none'}; a "
                            "file is tagged throughout or not at all")
        sentences.append(TaggedSentence(list(words), list(tags) if tags is not None else None,
                                        number))
    return sentences


def _scheme_name(name: str, path: Path) -> str:
    upper = name.strip().upper()
    upper = SCHEME_ALIASES.get(upper, upper)
    if upper not in SCHEMES:
        raise DataError(f"{path}: unknown tag scheme {name!r} (expected one of "
                        f"{', '.join(SCHEMES)})")
    return upper


def _check_tags(data: TaggedData, scheme: str | None) -> None:
    """Every tag is O or P-type; with a scheme named, P is one of that scheme's prefixes."""
    allowed = SCHEME_PREFIXES[scheme] if scheme is not None else "BIES"
    for sentence in data.sentences:
        for index, tag in enumerate(sentence.tags or ()):
            if tag == "O":
                continue
            match = TAG.match(tag)
            if match is None:
                raise DataError(f"{data.path}:{sentence.word_line(index)}: tag {tag!r} is not "
                                "O, B-type, I-type, E-type or S-type")
            if match.group(1) not in allowed:
                raise DataError(f"{data.path}:{sentence.word_line(index)}: tag {tag!r} is not "
                                f"{scheme} (its tags are O and "
                                f"{', '.join(p + '-type' for p in allowed)})")


def _starts_with_inside(tags: Sequence[str]) -> bool:
    """An I- tag that begins an entity (first, after O, or after another type): IOB1's mark."""
    previous = "O"
    for tag in tags:
        if tag.startswith("I-") and (previous == "O" or previous[2:] != tag[2:]):
            return True
        previous = tag
    return False


def _detect(sentences: Sequence[TaggedSentence]) -> str:
    tags = [s.tags or [] for s in sentences]
    if any(t[:2] in ("S-", "E-") for sentence in tags for t in sentence):
        return "BIOES"
    if any(_starts_with_inside(sentence) for sentence in tags):
        return "IOB1"
    return "IOB2"


def _to_iob2(tags: Sequence[str]) -> list[str]:
    """IOB2 tags with the entities conlleval reads in `tags` (any scheme): B- on each entity's
    first word, I- on the rest."""
    out = ["O"] * len(tags)
    for type_, start, end in _chunks(list(tags)):
        out[start] = f"B-{type_}"
        for i in range(start + 1, end + 1):
            out[i] = f"I-{type_}"
    return out


def read_tagged(path: Path, scheme: str | None = None, require_tags: bool = True) -> TaggedData:
    """Read a CoNLL or JSONL file and normalise its tags to IOB2.

    `scheme` (IOB1, IOB2, BIOES, IO) is the file's; None detects it: any S-/E- tag means
    BIOES, an I- tag beginning an entity IOB1, else IOB2. Entities are read with conlleval's
    rules, so an ill-formed I-x after O in an "IOB2" file becomes B-x (said once in a warning).
    Without `require_tags` (prediction input) a CoNLL file of words alone or JSONL rows without
    "tags" read with tags None.
    """
    path = Path(path)
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: unknown format {path.suffix!r}; expected one of "
                        f"{', '.join(sorted(FORMATS))}")
    given = _scheme_name(scheme, path) if scheme is not None else None
    text = read_text(path, "tagged words (CoNLL columns or JSON lines of tokens and tags)",
                     error=DataError)
    reader = _read_conll if kind == "conll" else _read_jsonl
    sentences = reader(path, text, require_tags)
    if not sentences:
        raise DataError(f"{path}: no sentences")
    data = TaggedData(path, sentences, "IOB2", given or "IOB2")
    if not data.has_tags:
        return data
    _check_tags(data, given)
    data.source_scheme = given or _detect(sentences)
    repaired = 0
    for sentence in sentences:
        assert sentence.tags is not None
        normal = _to_iob2(sentence.tags)
        if data.source_scheme == "IOB2" and normal != sentence.tags:
            repaired += 1
        sentence.tags = normal
    if repaired:
        log.warning("%s: %d sentences have an entity starting with I- (not IOB2); read as B- "
                    "as conlleval does", path, repaired)
    return data


# ----------------------------------------------------------------------------------------------
# Labels and model inputs


def label_list(data: TaggedData) -> list[str]:
    """"O", then B-type and I-type of every entity type in the data, sorted by type.

    Both tags of a type are listed even if the data has only one of them: a model may predict
    either, and `label_all_subtokens` labels a B- word's later pieces I-.
    """
    if not data.has_tags:
        raise DataError(f"{data.path}: no tags")
    types = {tag[2:] for s in data.sentences for tag in s.tags or () if tag != "O"}
    if not types:
        raise DataError(f"{data.path}: every tag is 'O'; there are no entities to learn")
    return ["O"] + [f"{prefix}-{t}" for t in sorted(types) for prefix in "BI"]


@dataclass(eq=False)
class Window:
    """What one row of `encode_tagged`'s arrays holds, so predictions map back to words.

    `word_ids[p]` is the sentence word at row position p (-1 for [CLS], [SEP] and padding),
    `first_piece[p]` whether p is that word's first piece, `owned` the words this window
    labels and `decode_tags` reads (each word is owned by exactly one window), `scored[p]`
    whether p is an owned word's first piece (where its label and prediction sit).
    """

    sentence: int  # index in `TaggedData.sentences`
    first_word: int
    last_word: int
    word_ids: np.ndarray  # int64 [max_seq_length]
    first_piece: np.ndarray  # bool [max_seq_length]
    scored: np.ndarray  # bool [max_seq_length]
    owned: list[int]


def _word_pieces(data: TaggedData, tokenizer: TextTokenizer, capacity: int
                 ) -> list[list[list[int]]]:
    """Each sentence's words as piece ids, tokenized one word at a time."""
    words = [word for sentence in data.sentences for word in sentence.words]
    encoded = tokenizer.encode_batch(words)
    empty = long = 0
    pieces: list[list[list[int]]] = []
    at = 0
    for sentence in data.sentences:
        row = []
        for ids in encoded[at:at + len(sentence.words)]:
            ids = list(ids)
            if not ids:  # control or zero-width characters alone: still a word to tag
                empty += 1
                ids = [tokenizer.unk_id]
            if len(ids) > capacity:
                long += 1
                ids = ids[:capacity]
            row.append(ids)
        pieces.append(row)
        at += len(sentence.words)
    if empty:
        log.info("%s: %d words tokenize to nothing; each is read as [UNK]", data.path, empty)
    if long:
        log.warning("%s: %d words have more pieces than a row holds (%d); their later pieces "
                    "are cut (the first, which carries the tag, stays)", data.path, long,
                    capacity)
    return pieces


def _spans(lengths: Sequence[int], capacity: int, stride: int) -> list[tuple[int, int]]:
    """(first word, last word) of each window: at most `capacity` pieces, starting at a word,
    each next start the last word boundary at most `stride` pieces after the previous one."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    n = len(lengths)
    spans = []
    first = 0
    while True:
        last = first
        while last + 1 < n and offsets[last + 2] - offsets[first] <= capacity:
            last += 1
        spans.append((first, last))
        if last == n - 1:
            return spans
        target = offsets[first] + stride
        following = first + 1
        while following + 1 <= last + 1 and offsets[following + 1] <= target:
            following += 1
        # Far enough on that the next window reaches a word this one lacks (no window repeats).
        while offsets[last + 2] - offsets[following] > capacity:
            following += 1
        first = following


def _owners(lengths: Sequence[int], spans: Sequence[tuple[int, int]]) -> list[int]:
    """The window each word is labelled in: the one where the fewer pieces on its nearer side is
    largest, plus a hundredth of the window's length (SQuAD's maximum-context score); the
    earlier window on a tie."""
    offsets = np.concatenate([[0], np.cumsum(lengths)]).tolist()
    best = [-1] * len(lengths)
    score = [float("-inf")] * len(lengths)
    for k, (first, last) in enumerate(spans):
        begin, end = offsets[first], offsets[last + 1]
        for w in range(first, last + 1):
            s = min(offsets[w] - begin, end - offsets[w + 1]) + 0.01 * (end - begin)
            if s > score[w]:
                best[w], score[w] = k, s
    return best


def _label_index(data: TaggedData, labels: Sequence[str], all_subtokens: bool
                 ) -> dict[str, int]:
    index = {name: i for i, name in enumerate(labels)}
    for sentence in data.sentences:
        for w, tag in enumerate(sentence.tags or ()):
            if tag not in index:
                raise DataError(f"{data.path}:{sentence.word_line(w)}: tag {tag!r} is not one "
                                f"of the model's labels (a tag training never saw; labels: "
                                f"{', '.join(labels)})")
            if all_subtokens and tag.startswith("B-") and "I-" + tag[2:] not in index:
                raise DataError(f"{data.path}:{sentence.word_line(w)}: labelling every piece "
                                f"of {tag!r} needs the label 'I-{tag[2:]}', not among the "
                                f"model's ({', '.join(labels)})")
    return index


def encode_tagged(data: TaggedData, tokenizer: TextTokenizer, labels: list[str] | None,
                  max_seq_length: int, stride: int | None = None,
                  label_all_subtokens: bool = False
                  ) -> tuple[dict[str, np.ndarray], list[Window]]:
    """[CLS] pieces [SEP] rows padded to `max_seq_length` and the `Window` of each row.

    Arrays: input_ids, segment_ids, input_mask and (with `labels` and a tagged file) labels: a
    word's label id on its first piece and IGNORE_INDEX elsewhere, or on every piece with
    `label_all_subtokens` (a B-x word's later pieces I-x, as transformers' example does). A
    sentence of more pieces than a row holds is never cut: it spans overlapping windows that
    start at words, `stride` pieces apart (default half a window), and each word is labelled
    in one window only (`_owners`), -100 in the others.
    """
    capacity = max_seq_length - 2
    if capacity < 1:
        raise DataError(f"--max-seq-length must exceed 2, got {max_seq_length}")
    if stride is None:
        stride = max(1, capacity // 2)
    if not 1 <= stride <= capacity:
        raise DataError(f"stride must be from 1 to max_seq_length - 2 ({capacity}), got {stride}")
    with_labels = labels is not None and data.has_tags
    index = _label_index(data, labels, label_all_subtokens) if with_labels else {}
    pieces = _word_pieces(data, tokenizer, capacity)

    spans = []
    for words in pieces:
        lengths = [len(ids) for ids in words]
        sentence_spans = _spans(lengths, capacity, stride)
        spans.append((sentence_spans, _owners(lengths, sentence_spans)))
    n = sum(len(sentence_spans) for sentence_spans, _ in spans)
    arrays = {name: np.zeros((n, max_seq_length), np.int64)
              for name in ("input_ids", "segment_ids", "input_mask")}
    arrays["input_ids"][:] = tokenizer.pad_id
    if with_labels:
        arrays["labels"] = np.full((n, max_seq_length), IGNORE_INDEX, np.int64)
    windows: list[Window] = []
    for s, (sentence, words, (sentence_spans, owners)) in enumerate(
            zip(data.sentences, pieces, spans)):
        for k, (first, last) in enumerate(sentence_spans):
            row = len(windows)
            window = Window(s, first, last, np.full(max_seq_length, -1, np.int64),
                            np.zeros(max_seq_length, bool), np.zeros(max_seq_length, bool),
                            [w for w in range(first, last + 1) if owners[w] == k])
            arrays["input_ids"][row, 0] = tokenizer.cls_id
            at = 1
            for w in range(first, last + 1):
                ids = words[w]
                end = at + len(ids)
                arrays["input_ids"][row, at:end] = ids
                window.word_ids[at:end] = w
                window.first_piece[at] = True
                if owners[w] == k:
                    window.scored[at] = True
                    if with_labels:
                        tag = sentence.tags[w]
                        arrays["labels"][row, at] = index[tag]
                        if label_all_subtokens:
                            later = "I-" + tag[2:] if tag.startswith("B-") else tag
                            arrays["labels"][row, at + 1:end] = index[later]
                at = end
            arrays["input_ids"][row, at] = tokenizer.sep_id
            arrays["input_mask"][row, :at + 1] = 1
            windows.append(window)
    split = sum(len(sentence_spans) > 1 for sentence_spans, _ in spans)
    if split:
        log.info("%s: %d of %d sentences are longer than %d pieces and span overlapping "
                 "windows (%d rows in all)", data.path, split, len(data.sentences), capacity, n)
    return arrays, windows


def decode_tags(data: TaggedData, windows: list[Window], predictions: np.ndarray,
                labels: list[str]) -> list[list[str]]:
    """Each sentence's IOB2 tags, one a word: the predicted label id at the word's first piece
    in the window that owns it (`predictions`: [rows, max_seq_length] ids, row i of window i)."""
    predictions = np.asarray(predictions)
    width = len(windows[0].word_ids) if windows else None
    if predictions.ndim != 2 or predictions.shape[0] != len(windows) or (
            windows and predictions.shape[1] != width):
        raise DataError(f"{data.path}: predictions of shape {predictions.shape} for "
                        f"{len(windows)} windows (expected [windows, max_seq_length])")
    tags: list[list[str | None]] = [[None] * len(s.words) for s in data.sentences]
    for row, window in enumerate(windows):
        scored = window.scored
        ids = predictions[row][scored]
        if ids.size and (ids.min() < 0 or ids.max() >= len(labels)):
            raise DataError(f"{data.path}: predicted label id {int(ids.max())} outside the "
                            f"{len(labels)} labels")
        sentence = tags[window.sentence]
        for w, i in zip(window.word_ids[scored].tolist(), ids.tolist()):
            sentence[w] = labels[i]
    for s, sentence in enumerate(tags):
        if None in sentence:
            raise DataError(f"{data.path}:{data.sentences[s].line}: no window predicts word "
                            f"{sentence.index(None)} of this sentence (windows of another "
                            "file?)")
    return tags  # type: ignore[return-value]


# ----------------------------------------------------------------------------------------------
# Entities and scores


def _end_of_chunk(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    """conlleval's (and seqeval's) rule: an entity ended between the previous word and this."""
    if prev_tag in ("E", "S"):
        return True
    if prev_tag in ("B", "I") and tag in ("B", "S", "O"):
        return True
    return prev_tag not in ("O", ".") and prev_type != type_


def _start_of_chunk(prev_tag: str, tag: str, prev_type: str, type_: str) -> bool:
    """conlleval's (and seqeval's) rule: an entity starts at this word."""
    if tag in ("B", "S"):
        return True
    if prev_tag in ("E", "S", "O") and tag in ("E", "I"):
        return True
    return tag not in ("O", ".") and prev_type != type_


def _chunks(tags: list[str]) -> list[tuple[str, int, int]]:
    """(type, first, last) of each entity, read as seqeval's `get_entities` reads them."""
    prev_tag, prev_type, begin = "O", "", 0
    chunks = []
    for i, chunk in enumerate([*tags, "O"]):
        if not chunk:
            raise DataError(f"an empty tag at position {i}")
        tag = chunk[0]
        type_ = chunk[1:].split("-", maxsplit=1)[-1] or "_"
        if _end_of_chunk(prev_tag, tag, prev_type, type_):
            chunks.append((prev_type, begin, i - 1))
        if _start_of_chunk(prev_tag, tag, prev_type, type_):
            begin = i
        prev_tag, prev_type = tag, type_
    return chunks


def _entities(sentences: Sequence[Sequence[str]]) -> dict[str, set[tuple[int, int]]]:
    """Entities by type, positions in the sentences joined with an "O" after each (seqeval's)."""
    flat: list[str] = []
    for sentence in sentences:
        flat.extend(sentence)
        flat.append("O")
    found: dict[str, set[tuple[int, int]]] = defaultdict(set)
    for type_, start, end in _chunks(flat):
        found[type_].add((start, end))
    return found


def _scores(correct: int, predicted: int, true: int) -> tuple[float, float, float]:
    precision = correct / predicted if predicted else 0.0
    recall = correct / true if true else 0.0
    f1 = 2.0 * precision * recall / (precision + recall) if precision + recall else 0.0
    return precision, recall, f1


def entity_metrics(gold: list[list[str]], predicted: list[list[str]]) -> dict[str, Any]:
    """Entity precision, recall and F1, micro over all entities and per type (with the type's
    gold count, `support`): an entity counts when its type, start and end all match. Equal to
    seqeval's default (conlleval) mode, whose chunking this repeats rather than imports."""
    if len(gold) != len(predicted) or any(len(g) != len(p) for g, p in zip(gold, predicted)):
        raise DataError(f"gold and predicted tags differ in shape: {len(gold)} and "
                        f"{len(predicted)} sentences, or a sentence's lengths differ")
    true_entities, predicted_entities = _entities(gold), _entities(predicted)
    per_type: dict[str, dict[str, float | int]] = {}
    totals = [0, 0, 0]
    for type_ in sorted(set(true_entities) | set(predicted_entities)):
        true, guessed = true_entities.get(type_, set()), predicted_entities.get(type_, set())
        counts = (len(true & guessed), len(guessed), len(true))
        totals = [a + b for a, b in zip(totals, counts)]
        precision, recall, f1 = _scores(*counts)
        per_type[type_] = {"precision": precision, "recall": recall, "f1": f1,
                           "support": len(true)}
    precision, recall, f1 = _scores(*totals)
    return {"precision": precision, "recall": recall, "f1": f1, "per_type": per_type}


# ----------------------------------------------------------------------------------------------
# Writing


def write_conll(path: Path, data: TaggedData, tags: list[list[str]]) -> None:
    """Each word's line (its columns as read, or the word) with its tag appended last, a blank
    line after each sentence, written atomically: conlleval reads it (word ... gold predicted)
    and `read_tagged` reads the appended tags back."""
    if len(tags) != len(data.sentences):
        raise DataError(f"{path}: {len(tags)} tag sequences for {len(data.sentences)} sentences")
    out: list[str] = []
    for sentence, sentence_tags in zip(data.sentences, tags):
        if len(sentence_tags) != len(sentence.words):
            raise DataError(f"{data.path}:{sentence.line}: {len(sentence_tags)} tags for "
                            f"{len(sentence.words)} words")
        for w, tag in enumerate(sentence_tags):
            cells = [*(sentence.columns[w] if sentence.columns is not None
                       else [sentence.words[w]]), tag]
            if any(not cell or "\n" in cell or "\t" in cell for cell in cells):
                raise DataError(f"{data.path}:{sentence.word_line(w)}: a word or tag that is "
                                "empty or holds a tab or line break cannot be written as CoNLL")
            spaced = any(any(c.isspace() for c in cell) for cell in cells)
            out.append(("\t" if spaced else " ").join(cells))
        out.append("")
    atomic_write_text(path, "\n".join(out) + ("\n" if out else ""))
