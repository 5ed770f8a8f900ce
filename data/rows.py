"""Rows of a table file, by its suffix: TSV, CSV, JSON lines, and (where a reader allows it)
Parquet. The classification and embedding-pair readers read their files through here, so each
format has one reader and one set of one-line errors (naming the file and line).

TSV is read without quote processing (GLUE's TSVs contain bare quotes); a Parquet row's "line"
is its row number, counted from 1.
"""

from __future__ import annotations

import csv
import io
import json
from collections.abc import Mapping
from pathlib import Path

from popbert.data.errors import DataError
from popbert.textfile import lone_surrogate, read_text

Row = dict[str, object]
TEXT_FORMATS = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}
FORMATS = {**TEXT_FORMATS, ".parquet": "parquet", ".pq": "parquet"}


def read_rows(path: Path, what: str, formats: Mapping[str, str] = TEXT_FORMATS
              ) -> tuple[list[str], list[tuple[int, Row]]]:
    """(column names, [(line, row)]) of a file whose suffix `formats` names; `what` says what
    the file should hold in an error ("classification rows (.tsv, .csv, .jsonl)")."""
    path = Path(path)
    kind = formats.get(path.suffix.lower())
    if kind is None:
        raise DataError(f"{path}: unknown format {path.suffix!r}; expected one of "
                        f"{', '.join(sorted(formats))}")
    if kind == "parquet":
        return _parquet_rows(path)
    text = read_text(path, what, error=DataError)
    if kind == "jsonl":
        rows = json_lines(path, text)
        columns: list[str] = []
        for _, row in rows:
            columns.extend(k for k in row if k not in columns)
        return columns, rows
    delimiter = "\t" if kind == "tsv" else ","
    quoting = csv.QUOTE_NONE if kind == "tsv" else csv.QUOTE_MINIMAL
    reader = csv.reader(io.StringIO(text, newline=""), delimiter=delimiter, quoting=quoting)
    try:
        header = next(reader)
    except StopIteration:
        raise DataError(f"{path}: empty file (expected a header row)") from None
    rows: list[tuple[int, Row]] = []
    for row in reader:
        number = reader.line_num
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(header):
            raise DataError(f"{path}:{number}: {len(row)} fields, the header has {len(header)}")
        rows.append((number, dict(zip(header, row))))
    return header, rows


def json_lines(path: Path, text: str) -> list[tuple[int, Row]]:
    """[(line, object)] of JSON-lines `text` read from `path` (blank lines skipped); a line that
    is not JSON, or not an object, is one DataError naming it."""
    rows: list[tuple[int, Row]] = []
    for number, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise DataError(f"{path}:{number}: invalid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{number}: expected a JSON object per line")
        bad = lone_surrogate(line, row)
        if bad is not None:
            raise DataError(f"{path}:{number}: {bad}")
        rows.append((number, row))
    return rows


def _parquet_rows(path: Path) -> tuple[list[str], list[tuple[int, Row]]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    try:
        table = pq.read_table(path)
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        raise DataError(f"{path}: not a Parquet file ({str(exc).splitlines()[0]})") from None
    return list(table.column_names), list(enumerate(table.to_pylist(), 1))


__all__ = ["FORMATS", "TEXT_FORMATS", "Row", "json_lines", "read_rows"]
