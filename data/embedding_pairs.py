"""Training data for sentence embeddings, as sentence-transformers lays it out: rows of
(anchor, positive[, negatives...]) for in-batch negatives, or (text1, text2, score) for a scored
pair, in JSON lines, CSV/TSV or Parquet.

Columns are `anchor`, `positive` and `negative` by default (sentence-transformers' names); hard
negatives are the `negative` column, or `negative_1`, `negative_2`, ... (a JSON-lines
`negative` may also hold a list), and every row has as many. A scored pair is the anchor and
positive columns (`sentence1` and `sentence2` when the file has no `anchor` and `positive`, as
STS-B's files name them) and a numeric `score`. Every problem is one DataError naming the file,
line and column: a missing column, an empty text, a score that is not a number, rows with
different numbers of negatives.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from popbert.data.classification import ClassificationData, encode_classification_counted
from popbert.data.errors import DataError
from popbert.data.rows import FORMATS, Row, read_rows
from popbert.data.tokenization import TextTokenizer

# The columns a scored pair's texts default to when the file has no anchor and positive.
PAIR_DEFAULTS = {"anchor": "sentence1", "positive": "sentence2"}


@dataclass
class PairsData:
    """The rows of one pairs file: each row's texts (anchor, positive, negatives... or a scored
    pair's two), their scores (None: no score column), and the columns they came from."""

    path: Path
    texts: list[list[str]]
    scores: np.ndarray | None
    columns: list[str]
    lines: list[int]

    def __len__(self) -> int:
        return len(self.texts)

    @property
    def negatives(self) -> int:
        return len(self.columns) - 2


def _column(columns: list[str], wanted: str, role: str, flag: str, path: Path) -> str:
    """`wanted`; a default name the file lacks falls back to STS-B's (`PAIR_DEFAULTS`)."""
    if wanted in columns:
        return wanted
    if wanted == role and PAIR_DEFAULTS[role] in columns:
        return PAIR_DEFAULTS[role]
    raise DataError(f"{path}: no {role} column {wanted!r} (columns: "
                    f"{', '.join(columns) or 'none'}); name it with {flag}")


def _negative_columns(columns: list[str], negative: str) -> list[str]:
    """`negative` itself, then `negative_1`, `negative_2`, ... in number order."""
    numbered = sorted((int(m.group(1)), c) for c in columns
                      if (m := re.fullmatch(rf"{re.escape(negative)}_(\d+)", c)))
    return ([negative] if negative in columns else []) + [c for _, c in numbered]


def _text(value: object, path: Path, line: int, column: str) -> str:
    if not isinstance(value, str) or not value.strip():
        shown = "missing" if value is None else ("empty" if isinstance(value, str)
                                                 else f"not text ({value!r})")
        raise DataError(f"{path}:{line}: column {column!r} is {shown}; every row needs a "
                        f"non-empty {column}")
    return value


def _score(value: object, path: Path, line: int, column: str) -> float:
    try:
        score = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        score = math.nan
    if isinstance(value, bool) or not math.isfinite(score):
        raise DataError(f"{path}:{line}: column {column!r} is {value!r}; a scored pair's score "
                        "must be a number")
    return score


def read_pairs(path: Path, anchor_column: str = "anchor", positive_column: str = "positive",
               negative_column: str = "negative", score_column: str = "score",
               scored: bool | None = None) -> PairsData:
    """Read one pairs file. `scored`: True needs the score column (a scored-pair loss), False
    ignores it, None reads it when the file has one."""
    path = Path(path)
    columns, rows = read_rows(path, "embedding pairs (.jsonl, .csv, .tsv, .parquet)", FORMATS)
    if not rows:
        raise DataError(f"{path}: no rows")
    anchor = _column(columns, anchor_column, "anchor", "--anchor-column", path)
    positive = _column(columns, positive_column, "positive", "--positive-column", path)
    has_score = score_column in columns
    if scored and not has_score:
        raise DataError(f"{path}: no score column {score_column!r} (columns: "
                        f"{', '.join(columns)}); a scored-pair loss needs one (--score-column)")
    scored = has_score if scored is None else scored
    negatives = [] if scored else _negative_columns(columns, negative_column)
    texts: list[list[str]] = []
    scores: list[float] = []
    lines: list[int] = []
    listed: int | None = None  # the length of a JSON-lines `negative` list
    for line, row in rows:
        texts.append([_text(row.get(anchor), path, line, anchor),
                      _text(row.get(positive), path, line, positive),
                      *_negatives(row, negatives, path, line)])
        if negatives and isinstance(row.get(negatives[0]), list):
            listed = len(texts[-1]) - 2 if listed is None else listed
        if scored:
            scores.append(_score(row.get(score_column), path, line, score_column))
        lines.append(line)
        if len(texts[-1]) != len(texts[0]):
            raise DataError(f"{path}:{line}: {len(texts[-1]) - 2} negatives, line {lines[0]} "
                            f"has {len(texts[0]) - 2}; every row needs as many")
    names = [anchor, positive]
    names += ([f"{negatives[0]}[{i}]" for i in range(listed)] if listed is not None
              else negatives)
    return PairsData(path, texts, np.asarray(scores, np.float32) if scored else None, names,
                     lines)


def _negatives(row: Row, columns: list[str], path: Path, line: int) -> list[str]:
    out: list[str] = []
    for column in columns:
        value = row.get(column)
        if isinstance(value, list):  # JSON lines: "negative": ["...", "..."]
            out.extend(_text(v, path, line, column) for v in value)
        else:
            out.append(_text(value, path, line, column))
    return out


def encode_texts(texts: list[str], tokenizer: TextTokenizer, max_seq_length: int,
                 source: Path = Path("texts")) -> tuple[dict[str, np.ndarray], int]:
    """[CLS] text [SEP] per text, padded to `max_seq_length` (input_ids, segment_ids,
    input_mask), and how many texts were cut to fit."""
    data = ClassificationData(Path(source), list(texts), None, None,
                              list(range(1, len(texts) + 1)))
    return encode_classification_counted(data, tokenizer, max_seq_length)


def encode_pairs(data: PairsData, tokenizer: TextTokenizer, max_seq_length: int
                 ) -> tuple[dict[str, np.ndarray], int]:
    """Each row's texts encoded apart: input_ids, segment_ids and input_mask [rows, texts,
    max_seq_length] (with `labels`, the scores, for scored pairs), and the texts cut to fit."""
    per_row = len(data.columns)
    flat = [text for row in data.texts for text in row]
    arrays, truncated = encode_texts(flat, tokenizer, max_seq_length, data.path)
    shaped = {name: value.reshape(len(data), per_row, max_seq_length)
              for name, value in arrays.items()}
    if data.scores is not None:
        shaped["labels"] = data.scores
    return shaped, truncated


__all__ = ["PAIR_DEFAULTS", "PairsData", "encode_pairs", "encode_texts", "read_pairs"]
