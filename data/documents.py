"""Corpora as people have them, cut into work units for the `sentences` stage.

Formats: JSON lines with a text field (the `extract` stage's parts are this, with `text`),
Parquet with a text column, and plain text with one document per line. Every format treats a
document without text alike: a JSON null or a Parquet null, or text of only whitespace, is read
as `""` for the `sentences` stage to count, say once and leave out (or refuse under strict),
while a file that lacks the field or column altogether does not fit (a DataError naming it). A
blank line is no row in either line format. A unit is a byte range of
a text file (the whole lines that start in it) or a run of a Parquet file's row groups, so one
big file still spreads over many workers; the units depend on the files and the part size only,
never on who reads them. Without a part size every file is one unit, as the stage always was.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from popbert.data import storage
from popbert.data.errors import DataError
from popbert.textfile import decode, lone_surrogate

__all__ = ["FORMATS", "Unit", "corpus_format", "plan_units", "read_unit"]

#: `jsonl`: one JSON object a line with the text in a field; `parquet`: a text column;
#: `lines`: plain UTF-8 text, one document a line.
FORMATS = ("jsonl", "parquet", "lines")
_SUFFIXES = {".jsonl": "jsonl", ".json": "jsonl", ".ndjson": "jsonl", ".parquet": "parquet",
             ".pq": "parquet", ".txt": "lines", ".text": "lines"}


@dataclass(frozen=True)
class Unit:
    """Part of one input file: bytes [start, stop) of a text file (the lines that start
    there), or row groups [start, stop) of a Parquet file."""

    path: str
    format: str
    start: int
    stop: int
    text_field: str = "text"


def corpus_format(path: str | os.PathLike, given: str | None = None) -> str:
    """`given`, or the format the file's suffix names; a DataError naming the file if neither."""
    if given is not None:
        if given not in FORMATS:
            raise DataError(f"unknown corpus format {given!r}; choose one of "
                            f"{', '.join(FORMATS)}")
        return given
    found = _SUFFIXES.get(Path(path).suffix.lower())
    if found is None:
        raise DataError(f"{path}: cannot tell the corpus format from its name (expected "
                        f"{', '.join(sorted(_SUFFIXES))}); give --format "
                        f"{'|'.join(FORMATS)}")
    return found


def plan_units(paths: Sequence[str | os.PathLike], fmt: str | None = None,
               text_field: str = "text", part_bytes: int | None = None) -> list[Unit]:
    """The units of `paths` in order: about `part_bytes` of input each (None: a file each).

    Parquet files are checked here, before any work: they must have the `text_field` column."""
    units: list[Unit] = []
    for path in paths:
        path = os.fspath(path)
        if not storage.is_url(path):  # units go to workers in other directories
            path = os.path.abspath(os.fspath(storage.location(path)))
        kind = corpus_format(path, fmt)
        if kind == "parquet":
            units.extend(_parquet_units(path, text_field, part_bytes))
            continue
        size = storage.size(storage.location(path))
        step = size if not part_bytes else max(1, int(part_bytes))
        starts = range(0, size, step) if size else [0]
        units.extend(Unit(path, kind, start, min(start + step, size), text_field)
                     for start in starts)
    return units


def _parquet_file(path: str):
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow: pip install pyarrow") from None
    try:
        if storage.is_url(path):  # read by ranges: its footer, then the row groups asked for
            return pq.ParquetFile(storage.open_metadata(path))
        return pq.ParquetFile(path)
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        raise DataError(f"{path}: not a Parquet file ({str(exc).splitlines()[0]})") from None


def _parquet_units(path: str, text_field: str, part_bytes: int | None) -> Iterator[Unit]:
    parquet = _parquet_file(path)
    names = parquet.schema_arrow.names
    if text_field not in names:
        raise DataError(f"{path}: no column {text_field!r} (--text-field); its columns: "
                        f"{', '.join(names)}")
    groups = parquet.metadata.num_row_groups
    start = size = 0
    for group in range(groups):
        size += parquet.metadata.row_group(group).total_byte_size
        if part_bytes and size >= part_bytes:
            yield Unit(path, "parquet", start, group + 1, text_field)
            start, size = group + 1, 0
    if start < groups or groups == 0:
        yield Unit(path, "parquet", start, groups, text_field)


def read_unit(unit: Unit) -> Iterator[str]:
    """The texts of the documents in `unit`, in file order (blank lines skipped); a document
    whose text is missing (null) or blank is `""`, so every format's are counted alike."""
    if unit.format == "parquet":
        yield from _parquet_texts(unit)
        return
    for offset, raw in _lines(unit):
        line = decode(raw, unit.path, "text, JSON lines or Parquet", offset=offset,
                      error=DataError)
        if not line.strip():
            continue
        if unit.format == "lines":
            yield line.rstrip("\r\n")
            continue
        try:
            row = json.loads(line)
        except ValueError:
            raise DataError(f"{unit.path}: the line at byte {offset} is not JSON (expected "
                            f"JSON lines)") from None
        if not isinstance(row, dict) or unit.text_field not in row:
            raise DataError(f"{unit.path}: the JSON line at byte {offset} has no text field "
                            f"{unit.text_field!r} (--text-field)")
        bad = lone_surrogate(line, row[unit.text_field])
        if bad is not None:
            raise DataError(f"{unit.path}: the JSON line at byte {offset}: {bad}")
        yield _text(row[unit.text_field], unit, f"the JSON line at byte {offset}")


def _lines(unit: Unit) -> Iterator[tuple[int, bytes]]:
    """(offset, line) of every line that starts in [start, stop)."""
    with storage.open_input(storage.location(unit.path)) as f:
        position = unit.start
        if position > 0:
            f.seek(position - 1)
            if f.read(1) != b"\n":  # mid-line: that line belongs to the unit before
                position += len(f.readline())
        f.seek(position)
        while position < unit.stop:
            line = f.readline()
            if not line:
                return
            yield position, line
            position += len(line)


def _parquet_texts(unit: Unit) -> Iterator[str]:
    parquet = _parquet_file(unit.path)
    for group in range(unit.start, unit.stop):
        column = parquet.read_row_group(group, columns=[unit.text_field]).column(0)
        for number, text in enumerate(column.to_pylist()):
            yield _text(text, unit, f"row {number} of row group {group}")


def _text(value: object, unit: Unit, where: str) -> str:
    """A row's text; `""` when missing (null) or blank; a DataError when not text."""
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{unit.path}: {unit.text_field!r} holds {type(value).__name__} at "
                        f"{where}, expected text (--text-field)")
    return value if value.strip() else ""
