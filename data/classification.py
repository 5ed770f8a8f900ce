"""Sentence and sentence-pair classification data (GLUE/CLUE style: SST-2, MRPC, ...).

A file is TSV, CSV or JSON lines (by its suffix: .tsv, .csv, .jsonl/.json) with a header
naming one or two text columns and a label column. Without `text_column` the first of
`sentence`, `text`, `sentence1`, `question`, `question1`, `premise` present is used, and then
`sentence2`, `question2` or `hypothesis` (if present) is the second text. Labels are strings
(JSON numbers and booleans are written out as text), mapped to class ids by a label list: the
one given, else the training file's labels sorted (numerically when they are all integers).

TSV files are read without quote processing (GLUE's TSVs contain bare quotes). Every problem is
a one-line DataError naming the file (and line, column or label).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from popbert.data.errors import DataError
from popbert.data.rows import TEXT_FORMATS, read_rows
from popbert.data.tokenization import TextTokenizer

log = logging.getLogger(__name__)

TEXT_COLUMNS = ("sentence", "text", "sentence1", "question", "question1", "premise")
PAIR_COLUMNS = ("sentence2", "question2", "hypothesis")
LABEL_COLUMN = "label"
FORMATS = TEXT_FORMATS


@dataclass
class ClassificationData:
    """The rows of one file: first texts, optional second texts, labels (None if unlabelled)."""

    path: Path
    texts: list[str]
    pairs: list[str] | None
    labels: list[str] | None
    lines: list[int]  # line number of each row, for error messages
    unlabelled: int = 0  # rows left out for having no label (`read_classification_file`)
    # The end a row too long for the model loses: "right" (its last tokens, Google's rule) or
    # "left" (its first: TEI's `truncation_direction: Left`, HF's `truncation_side`).
    truncation_side: str = "right"

    def __len__(self) -> int:
        return len(self.texts)


def _rows(path: Path) -> tuple[list[str], list[tuple[int, dict[str, object]]]]:
    """(column names, [(line, row)]) of a TSV/CSV/JSONL file."""
    return read_rows(path, "classification rows (.tsv, .csv, .jsonl)", FORMATS)


def _choose(columns: Sequence[str], wanted: str | None, defaults: Sequence[str], path: Path,
            what: str, required: bool) -> str | None:
    if wanted is not None:
        if wanted not in columns:
            raise DataError(f"{path}: no {what} column {wanted!r} (columns: "
                            f"{', '.join(columns)})")
        return wanted
    for name in defaults:
        if name in columns:
            return name
    if required:
        raise DataError(f"{path}: no {what} column; name one with --text-column (columns: "
                        f"{', '.join(columns)})")
    return None


def _as_text(value: object) -> str:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def read_classification_file(path: Path, text_column: str | None = None,
                             pair_column: str | None = None, label_column: str = LABEL_COLUMN,
                             require_labels: bool = True,
                             strict: bool = False) -> ClassificationData:
    """Read one file; a missing column or text cell is a DataError naming it.

    With `require_labels` (training and evaluation files) a row without a label (an empty
    cell, a JSON null or a missing key) cannot be learnt or scored: such rows are left out,
    counted (`unlabelled`) and said once in a warning naming the file and the first lines,
    or under `strict` (`data.strict`) refused in one line. A file whose every row lacks a
    label is a DataError either way. Without `require_labels` (prediction) every row stays.
    """
    path = Path(path)
    columns, rows = _rows(path)
    if not rows:
        raise DataError(f"{path}: no rows")
    first = _choose(columns, text_column, TEXT_COLUMNS, path, "text", True)
    second = _choose(columns, pair_column, PAIR_COLUMNS if text_column is None else (), path,
                     "text pair", False)
    has_labels = label_column in columns
    if require_labels and not has_labels:
        raise DataError(f"{path}: no label column {label_column!r} (columns: "
                        f"{', '.join(columns)}); name it with --label-column")
    texts, pairs, labels, lines = [], [], [], []
    unlabelled: list[int] = []
    for number, row in rows:
        label = row.get(label_column)
        if require_labels and has_labels and (label is None or not _as_text(label).strip()):
            unlabelled.append(number)
            continue
        for column in (first, second, label_column if has_labels else None):
            if column is not None and (column not in row or row[column] is None):
                raise DataError(f"{path}:{number}: missing value in column {column!r}")
        texts.append(_as_text(row[first]))
        if second is not None:
            pairs.append(_as_text(row[second]))
        if has_labels:
            labels.append(_as_text(row[label_column]).strip())
        lines.append(number)
    if unlabelled:
        shown = ", ".join(map(str, unlabelled[:5])) + (", ..." if len(unlabelled) > 5 else "")
        message = (f"{path}: {len(unlabelled):,} of {len(rows):,} rows have no label in column "
                   f"{label_column!r} (line{'s' if len(unlabelled) > 1 else ''} {shown})")
        if not texts:
            raise DataError(f"{message}: no labelled rows")
        if strict:
            raise DataError(f"{message}; refused (strict)")
        log.warning("%s: left out", message)
    return ClassificationData(path, texts, pairs if second is not None else None,
                              labels if has_labels else None, lines, len(unlabelled))


def label_list(data: ClassificationData) -> list[str]:
    """The distinct labels of a training file, sorted (numerically if all are integers)."""
    if data.labels is None:
        raise DataError(f"{data.path}: no labels")
    distinct = set(data.labels)
    try:
        names = sorted(distinct, key=int)
    except ValueError:
        names = sorted(distinct)
    if len(names) < 2:
        raise DataError(f"{data.path}: only one label ({names[0]!r}); classification needs at "
                        "least two")
    return names


def label_ids(data: ClassificationData, labels: Sequence[str]) -> np.ndarray:
    """Class id of every row; a label outside `labels` is a DataError with its line."""
    if data.labels is None:
        raise DataError(f"{data.path}: no labels")
    index = {name: i for i, name in enumerate(labels)}
    ids = np.empty(len(data.labels), np.int64)
    for row, (label, line) in enumerate(zip(data.labels, data.lines)):
        if label not in index:
            raise DataError(f"{data.path}:{line}: unknown label {label!r} (labels: "
                            f"{', '.join(labels)})")
        ids[row] = index[label]
    return ids


def label_scores(data: ClassificationData, column: str = LABEL_COLUMN) -> np.ndarray:
    """The label column as numbers (a regression target, e.g. STS-B's 0-5 similarity), float32;
    a value that is not a finite number is a DataError naming its line."""
    if data.labels is None:
        raise DataError(f"{data.path}: no labels")
    scores = np.empty(len(data.labels), np.float32)
    for row, (label, line) in enumerate(zip(data.labels, data.lines)):
        try:
            value = float(label)
        except ValueError:
            value = float("nan")
        if not np.isfinite(value):
            raise DataError(f"{data.path}:{line}: score {label!r} in column {column!r} is not a "
                            "finite number (--regression trains on numbers)")
        scores[row] = value
    return scores


def _ranks(values: np.ndarray) -> np.ndarray:
    """1-based ranks, ties given their average rank (as Spearman's correlation wants)."""
    order = np.argsort(values, kind="stable")
    sorted_values = values[order]
    ranks = np.empty(len(values), np.float64)
    start = 0
    for end in range(1, len(values) + 1):
        if end == len(values) or sorted_values[end] != sorted_values[start]:
            ranks[order[start:end]] = (start + end + 1) / 2
            start = end
    return ranks


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a - a.mean(), b - b.mean()
    denominator = np.sqrt((a * a).sum() * (b * b).sum())
    return float((a * b).sum() / denominator) if denominator > 0 else 0.0


def regression_metrics(predictions: np.ndarray, targets: np.ndarray) -> dict[str, float]:
    """Pearson's and Spearman's correlations of predicted and gold scores (GLUE's STS-B
    metrics; 0 where either side is constant) and the mean squared error."""
    predictions = np.asarray(predictions, np.float64)
    targets = np.asarray(targets, np.float64)
    if len(targets) == 0:
        raise DataError("no examples to evaluate")
    return {"pearson": _pearson(predictions, targets),
            "spearman": _pearson(_ranks(predictions), _ranks(targets)),
            "mse": float(np.mean((predictions - targets) ** 2))}


def _truncate_pair(a: list[int], b: list[int], max_tokens: int, side: str = "right") -> None:
    """Google's run_classifier rule: drop the last token of the longer text until it fits (the
    first, `side="left"`)."""
    if side not in ("right", "left"):
        raise ValueError(f"truncation side {side!r}: expected 'right' or 'left'")
    end = -1 if side == "right" else 0
    while len(a) + len(b) > max_tokens:
        (a if len(a) > len(b) else b).pop(end)


def encode_classification(data: ClassificationData, tokenizer: TextTokenizer,
                          max_seq_length: int) -> dict[str, np.ndarray]:
    """[CLS] a [SEP] (b [SEP]) padded to `max_seq_length`: input_ids, segment_ids, input_mask."""
    return encode_classification_counted(data, tokenizer, max_seq_length)[0]


def encode_classification_counted(data: ClassificationData, tokenizer: TextTokenizer,
                                  max_seq_length: int) -> tuple[dict[str, np.ndarray], int]:
    """`encode_classification`'s arrays and how many rows were truncated to fit: rows whose
    text (with its pair) had more word pieces than `max_seq_length` leaves beside the special
    tokens."""
    specials = 3 if data.pairs is not None else 2
    if max_seq_length <= specials:
        raise DataError(f"--max-seq-length must exceed {specials}, got {max_seq_length}")
    firsts = tokenizer.encode_batch(data.texts)
    seconds = tokenizer.encode_batch(data.pairs) if data.pairs is not None else None
    n = len(firsts)
    arrays = {name: np.zeros((n, max_seq_length), np.int64)
              for name in ("input_ids", "segment_ids", "input_mask")}
    arrays["input_ids"][:] = tokenizer.pad_id
    truncated = 0
    for row, a in enumerate(firsts):
        a = list(a)
        b = list(seconds[row]) if seconds is not None else []
        if len(a) + len(b) > max_seq_length - specials:
            truncated += 1
            _truncate_pair(a, b, max_seq_length - specials, data.truncation_side)
        ids = [tokenizer.cls_id, *a, tokenizer.sep_id]
        segments = [0] * len(ids)
        if seconds is not None:
            ids += [*b, tokenizer.sep_id]
            segments += [1] * (len(b) + 1)
        arrays["input_ids"][row, :len(ids)] = ids
        arrays["segment_ids"][row, :len(ids)] = segments
        arrays["input_mask"][row, :len(ids)] = 1
    if truncated:
        log.info("%s: truncated %d of %d rows to %d tokens", data.path, truncated, n,
                 max_seq_length)
    return arrays, truncated


def classification_metrics(predictions: np.ndarray, labels: np.ndarray, num_labels: int
                           ) -> dict[str, float]:
    """Accuracy, and F1: of class 1 with two classes (GLUE's MRPC/QQP convention), else the
    macro average over classes."""
    predictions, labels = np.asarray(predictions), np.asarray(labels)
    if len(labels) == 0:
        raise DataError("no examples to evaluate")
    scores = []
    for c in range(num_labels):
        tp = int(np.sum((predictions == c) & (labels == c)))
        fp = int(np.sum((predictions == c) & (labels != c)))
        fn = int(np.sum((predictions != c) & (labels == c)))
        scores.append(2 * tp / (2 * tp + fp + fn) if tp else 0.0)
    f1 = scores[1] if num_labels == 2 else float(np.mean(scores))
    return {"accuracy": float(np.mean(predictions == labels)), "f1": float(f1)}


__all__ = ["ClassificationData", "classification_metrics", "encode_classification",
           "encode_classification_counted", "label_ids", "label_list", "label_scores",
           "read_classification_file", "regression_metrics"]
