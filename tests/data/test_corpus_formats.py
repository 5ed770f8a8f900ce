"""Corpora as people have them (`popbert.data.documents`): JSON lines with any text field,
Parquet with a text column, one document a line; big files cut into units by byte ranges or
row groups; the `sentences` stage on each, and one clear line for what does not fit.

The documents are real: leads of the bundled Wikipedia corpus."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from popbert.cli.main import main
from popbert.data import bundled_corpus_path
from popbert.data.documents import Unit, plan_units, read_unit


def leads(count: int = 40) -> list[str]:
    """`count` documents of the bundled corpus, each one paragraph of real prose."""
    documents = bundled_corpus_path().read_text(encoding="utf-8").strip().split("\n\n")
    return [" ".join(d.split("\n")) for d in documents[:count]]


def write_jsonl(path: Path, texts: list[str], field: str = "body") -> Path:
    rows = [json.dumps({"id": i, field: t, "lang": "en"}) for i, t in enumerate(texts)]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")
    return path


def write_parquet(path: Path, texts: list[str], row_group_size: int, field: str = "body"):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"id": list(range(len(texts))), field: texts})
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def read_all(units: list[Unit]) -> list[str]:
    return [text for unit in units for text in read_unit(unit)]


@pytest.mark.parametrize("part_bytes", [None, 1, 7, 500, 4096, 10**9])
def test_byte_ranges_hold_every_document_once_in_order(tmp_path, part_bytes):
    texts = leads()
    jsonl = write_jsonl(tmp_path / "corpus.jsonl", texts)
    lines = tmp_path / "corpus.txt"
    lines.write_text("\n".join(texts) + "\n\n", encoding="utf-8")  # a blank line is no document
    for path, field in ((jsonl, "body"), (lines, "text")):
        units = plan_units([path], text_field=field, part_bytes=part_bytes)
        assert read_all(units) == texts
        expected = 1 if part_bytes is None else -(-path.stat().st_size // part_bytes)
        assert len(units) == expected
        assert all(u.path == str(path.absolute()) for u in units)


@pytest.mark.parametrize("part_bytes", [None, 1, 3000])
def test_parquet_row_groups_are_the_units(tmp_path, part_bytes):
    texts = leads()
    path = write_parquet(tmp_path / "corpus.parquet", texts, row_group_size=8)
    units = plan_units([path], text_field="body", part_bytes=part_bytes)
    assert read_all(units) == texts
    if part_bytes == 1:
        assert [(u.start, u.stop) for u in units] == [(g, g + 1) for g in range(5)]
    if part_bytes is None:
        assert [(u.start, u.stop) for u in units] == [(0, 5)]


def test_one_input_of_files_in_different_formats_keeps_their_order(tmp_path):
    """A glob or list mixing formats: each file read its own way, in the given order, the
    unit numbering running on across files."""
    texts = leads(30)
    files = [write_jsonl(tmp_path / "a.jsonl", texts[:10], field="text"),
             write_parquet(tmp_path / "b.parquet", texts[10:20], row_group_size=4, field="text"),
             tmp_path / "c.txt"]
    files[2].write_text("\n".join(texts[20:]) + "\n", encoding="utf-8")
    units = plan_units(files, part_bytes=2000)
    assert [u.format for u in units][0] == "jsonl" and units[-1].format == "lines"
    assert {u.format for u in units} == {"jsonl", "parquet", "lines"}
    assert read_all(units) == texts


def documents_of(directory: Path) -> list[str]:
    """The documents of a sentences stage's parts, in order (a part may be empty)."""
    documents = []
    for part in sorted(directory.glob("part-*.txt")):
        text = part.read_text(encoding="utf-8").strip()
        documents.extend(text.split("\n\n") if text else [])
    return documents


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "lines"])
def test_the_sentences_stage_reads_each_format_the_same(tmp_path, fmt):
    """Each format, cut into several units, gives the sentences of the extract stage's own
    format (one unit), document for document; 1 and 2 workers write the same parts."""
    texts = leads()
    reference = tmp_path / "reference"
    extracted = tmp_path / "part-00000.jsonl"
    extracted.write_text("\n".join(json.dumps({"id": str(i), "title": "", "text": t})
                                   for i, t in enumerate(texts)) + "\n", encoding="utf-8")
    assert main(["prepare-data", "sentences", "--input", str(extracted), "-o", str(reference),
                 "-j", "1"]) == 0
    if fmt == "jsonl":
        source, extra = write_jsonl(tmp_path / "corpus.jsonl", texts), ["--text-field", "body"]
    elif fmt == "parquet":
        source = write_parquet(tmp_path / "corpus.parquet", texts, row_group_size=8)
        extra = ["--text-field", "body"]
    else:
        source = tmp_path / "corpus.txt"
        source.write_text("\n".join(texts) + "\n", encoding="utf-8")
        extra = []
    runs = {}
    for workers in ("1", "2"):
        out = tmp_path / f"{fmt}-{workers}"
        assert main(["prepare-data", "sentences", "--input", str(source), "-o", str(out),
                     "-j", workers, "--part-size-mb", "0.004", *extra]) == 0
        runs[workers] = [p.read_bytes() for p in sorted(out.glob("part-*.txt"))]
        assert len(runs[workers]) > 1  # the one file was cut into several units
        assert documents_of(out) == documents_of(reference) and documents_of(reference)
    assert runs["1"] == runs["2"]


@pytest.mark.parametrize("case, fragment", [
    ("parquet-column", "no column 'text' (--text-field); its columns: id, body"),
    ("jsonl-field", "the JSON line at byte 0 has no text field 'text' (--text-field)"),
    ("not-json", "the line at byte 0 is not JSON (expected JSON lines)"),
    ("suffix", "cannot tell the corpus format from its name"),
    ("not-utf8", "not UTF-8 text"),
    ("not-parquet", "not a Parquet file"),
])
def test_inputs_that_do_not_fit_are_one_line_naming_the_file(tmp_path, capsys, case, fragment):
    texts = leads(5)
    if case == "parquet-column":
        source = write_parquet(tmp_path / "corpus.parquet", texts, row_group_size=2)
    elif case == "jsonl-field":
        source = write_jsonl(tmp_path / "corpus.jsonl", texts)  # the text is in "body"
    elif case == "not-json":
        source = tmp_path / "corpus.jsonl"
        source.write_text("plain text, not JSON\n", encoding="utf-8")
    elif case == "suffix":
        source = tmp_path / "corpus.csv"
        source.write_text("a,b\n", encoding="utf-8")
    elif case == "not-utf8":
        source = tmp_path / "corpus.txt"
        source.write_bytes(b"caf\xe9 au lait\n")
    else:
        pytest.importorskip("pyarrow")
        source = tmp_path / "corpus.parquet"
        source.write_text("not parquet\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["prepare-data", "sentences", "--input", str(source), "-o", str(out),
                 "-j", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    errors = [line for line in err if line.startswith("popbert: error:")]
    assert len(errors) == 1 and str(source) in errors[0], err
    assert fragment in errors[0], errors[0]
    assert not any("Traceback" in line for line in err)
    assert not out.exists()


def write_with_gaps(tmp_path: Path, fmt: str, texts: list[str], gaps: list) -> Path:
    """`texts` in `fmt` (the text in field "body") with one of `gaps` (documents without text;
    None is a null) after every third text."""
    rows: list = []
    for i, text in enumerate(texts):
        rows.append(text)
        if i % 3 == 2 and i // 3 < len(gaps):
            rows.append(gaps[i // 3])
    if fmt == "jsonl":
        path = tmp_path / "gaps.jsonl"
        path.write_text("\n".join(json.dumps({"id": i, "body": r}) for i, r in enumerate(rows))
                        + "\n", encoding="utf-8")
        return path
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    path = tmp_path / "gaps.parquet"
    pq.write_table(pa.table({"body": pa.array(rows, pa.string())}), path, row_group_size=4)
    return path


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_documents_without_text_are_counted_said_once_or_refused_alike(tmp_path, caplog, fmt):
    """A null, an empty and a blank text are one case in every format: left out, counted,
    said once for the stage (not once a unit), and refused under strict leaving nothing."""
    from popbert.data import DataError
    from popbert.data.sentences import split_sentences

    texts = leads(12)
    gaps = [None, "", "  \n "]
    source = write_with_gaps(tmp_path, fmt, texts, gaps)
    clean = write_jsonl(tmp_path / "clean.jsonl", texts)
    split_sentences([clean], tmp_path / "clean", text_field="body")
    with caplog.at_level(logging.WARNING, logger="popbert"):
        record = split_sentences([source], tmp_path / "out", text_field="body", part_bytes=300)
    assert record["stats"]["documents_without_text_now"] == 3
    assert documents_of(tmp_path / "out") == documents_of(tmp_path / "clean")
    said = [r.getMessage() for r in caplog.records if "have no text" in r.getMessage()]
    assert said == [f"{source}: 3 of 15 documents have no text (null or blank in the text "
                    f"field 'body'): left out"]
    assert len(plan_units([source], text_field="body", part_bytes=300)) > 2  # not per unit

    with pytest.raises(DataError, match=r"3 of 15 documents have no text .*refused \(strict\)"):
        split_sentences([source], tmp_path / "strict", text_field="body", strict=True)
    assert not (tmp_path / "strict").exists()
    # The command's --strict, the same refusal: one line, exit 2, nothing written.
    from popbert.cli.main import main

    assert main(["prepare-data", "sentences", "--input", str(source), "--text-field", "body",
                 "-o", str(tmp_path / "strict-cli"), "-j", "1", "--strict"]) == 2
    assert not (tmp_path / "strict-cli").exists()


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "lines"])
def test_a_corpus_without_any_text_is_one_line_and_blank_lines_are_no_rows(tmp_path, capsys,
                                                                          fmt):
    if fmt == "jsonl":
        source = tmp_path / "empty.jsonl"
        source.write_text('{"text": null}\n\n{"text": ""}\n{"text": " "}\n', encoding="utf-8")
    elif fmt == "parquet":
        pa = pytest.importorskip("pyarrow")
        pq = pytest.importorskip("pyarrow.parquet")
        source = tmp_path / "empty.parquet"
        pq.write_table(pa.table({"text": pa.array([None, "", " "], pa.string())}), source)
    else:  # a blank line is no row: nothing to count, and no document either
        source = tmp_path / "empty.txt"
        source.write_text("\n \n\t\n", encoding="utf-8")
    out = tmp_path / "out"
    assert main(["prepare-data", "sentences", "--input", str(source), "-o", str(out),
                 "-j", "1"]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines()
              if line.startswith("popbert: error:")]
    assert len(errors) == 1 and str(source) in errors[0], errors
    expected = ("the input holds no documents" if fmt == "lines"
                else "none of its 3 has text (null or blank in the text field 'text'")
    assert expected in errors[0], errors[0]
    assert not out.exists()
