"""Every path a `popbert` command or a run's config names, declared with what it must be and
checked before any work.

A flag names a path by taking one of the kinds below as its argparse `type`
(`p.add_argument("--model", type=ONNX_MODEL)`); a config key by its entry in `CONFIG_PATHS`.
That declaration is all: `check_arguments` (run by `popbert.cli.main.run_command` before every
handler) and `check_config_paths` (before a run creates anything) find the declared paths and
refuse, in one line naming the flag or key, what it got and what it expected: a missing path, a
directory where a file goes and a file where a directory goes, an empty file, bytes that are not
UTF-8 where text goes, a file that is not HDF5, ONNX, JSON or YAML where one goes, a file of
another kind that parses (a checkpoint where a corpus goes, SQuAD where classification rows go),
a path under a regular file, a URL whose scheme no filesystem handles. An output that is one of
the command's inputs, or a file a run or checkpoint directory already holds, is refused too.

These are cheap looks at each path's head (a few kilobytes; a JSON input is parsed whole): the
readers still check every byte as they go, through `popbert.textfile`, in the same words.
"""

from __future__ import annotations

import argparse
import glob as globlib
import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from popbert.errors import UsageError
from popbert.textfile import undecodable

HEAD_BYTES = 64 << 10
_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.\-]*)://")
_LOCAL_SCHEMES = ("file", "local")

# File signatures, to say what a file is when it is not what a flag wants.
_MAGIC = ((b"\x89HDF\r\n\x1a\n", "an HDF5 file"), (b"PAR1", "a Parquet file"),
          (b"BZh", "a bzip2 file"), (b"\x1f\x8b", "a gzip file"), (b"PK\x03\x04", "a zip file "
          "(a torch .pt or an archive)"), (b"\x7fELF", "an executable"))


def describe(path: Path) -> str:
    """What `path` is, in a few words, for the line that refuses it."""
    if path.is_dir():
        if (path / "state.json").exists():
            return "a checkpoint directory"
        if (path / "config.yaml").exists() and (path / "checkpoints").is_dir():
            return "a run directory"
        return "a directory"
    head = _head(path, 512)
    for magic, name in _MAGIC:
        if head.startswith(magic):
            return name
    if path.suffix == ".safetensors" or head[8:10] == b'{"':
        return "a safetensors file"
    if path.suffix == ".onnx":
        return "an ONNX model"
    text = head.lstrip(b"\xef\xbb\xbf \t\r\n")
    if text[:1] in (b"{", b"["):
        return "a JSON file"
    return "a text file"


def _head(path: Path, size: int = HEAD_BYTES) -> bytes:
    with open(path, "rb") as f:
        return f.read(size)


def _first_line(path: Path) -> str:
    """The first line of `path` that is not blank (a byte-order mark dropped)."""
    return next((line for line in _head(path).decode("utf-8-sig", "ignore").splitlines()
                 if line.strip()), "")


def _first_row(path: Path) -> dict | None:
    """The first line of a JSON-lines file as an object; None when it is not one."""
    try:
        row = json.loads(_first_line(path))
    except json.JSONDecodeError:
        return None
    return row if isinstance(row, dict) else None


# ---------------------------------------------------------------------------------- the sniffs
# Each takes an existing path of the right type (file or directory) and returns None when it
# looks like what the kind wants, else what it is instead ("an HDF5 file", "not UTF-8 text ...").


def _text(path: Path, args: Any = None) -> str | None:
    """UTF-8 text (any lines): the head decodes (a character cut at its end is fine)."""
    head = _head(path)
    what = describe(path)
    if what != "a text file" and what != "a JSON file":
        return what
    try:
        head.decode("utf-8") if len(head) < HEAD_BYTES else _decode_prefix(head)
    except UnicodeDecodeError as error:
        return undecodable(error)
    return None


def _decode_prefix(head: bytes) -> str:
    import codecs

    return codecs.getincrementaldecoder("utf-8")().decode(head, final=False)


def _json(path: Path) -> tuple[Any, str | None]:
    try:
        text = path.read_bytes().decode("utf-8-sig")
    except UnicodeDecodeError as error:
        return None, undecodable(error)
    try:
        return json.loads(text), None
    except json.JSONDecodeError as error:
        what = describe(path)
        return None, (what if what != "a text file" and what != "a JSON file"
                      else f"not JSON ({error.msg} at line {error.lineno})")


def yaml_keys(path: Path, allowed: tuple[str, ...]) -> str | None:
    """A YAML mapping whose top-level keys are all among `allowed`."""
    problem = _text(path)
    if problem:
        return problem
    import yaml

    try:
        value = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as error:
        return undecodable(error)
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        return "not YAML" + (f" (line {mark.line + 1})" if mark else "")
    if value is None:
        return "YAML without any key"
    if not isinstance(value, dict):
        return f"YAML holding a {type(value).__name__}, not a mapping of keys"
    unknown = [str(key) for key in value if key not in allowed]
    if unknown:
        return f"YAML with keys ({', '.join(unknown[:3])}) that are not {', '.join(allowed[:4])}..."
    return None


def _config(path: Path, args: Any = None) -> str | None:
    from popbert.config.sections import TOP_LEVEL_KEYS

    return yaml_keys(path, TOP_LEVEL_KEYS)


def _is_squad(value: Any) -> bool:
    data = value.get("data") if isinstance(value, dict) else None
    return isinstance(data, list) and all(isinstance(a, dict) and "paragraphs" in a
                                          for a in data[:3])


def _squad(path: Path, args: Any = None) -> str | None:
    value, problem = _json(path)
    if problem:
        return problem
    return None if _is_squad(value) else "JSON that is not SQuAD (no 'data' list of articles " \
                                          "with 'paragraphs')"


def _predictions(path: Path, args: Any = None) -> str | None:
    value, problem = _json(path)
    if problem:
        return problem
    if _is_squad(value):
        return "a SQuAD data file, not predictions"
    if not isinstance(value, dict) or not all(isinstance(v, str) for v in value.values()):
        return "JSON that is not an object of question id to answer text"
    return None


ROW_SUFFIXES = (".tsv", ".csv", ".jsonl", ".json")


def _rows(path: Path, args: Any = None, suffixes: tuple[str, ...] = ROW_SUFFIXES) -> str | None:
    """Rows with a text column: the one `--text-column` names, else one of the reader's
    defaults (`popbert.data.classification.TEXT_COLUMNS`)."""
    suffix = path.suffix.lower()
    if suffix not in suffixes:
        return f"a {path.suffix or 'suffix-less'} file (the format is read from the suffix)"
    problem = _text(path)
    if problem or suffix == ".txt":
        return problem
    first = next((line for line in _head(path).decode("utf-8-sig", "ignore").splitlines()
                  if line.strip()), "")
    if suffix in (".json", ".jsonl"):
        try:
            row = json.loads(first)
        except json.JSONDecodeError:
            value, _ = _json(path)
            return "a SQuAD JSON file" if _is_squad(value) else "not JSON lines (one object a line)"
        if _is_squad(row):
            return "a SQuAD JSON file"
        if not isinstance(row, dict):
            return "JSON lines whose rows are not objects"
        columns = list(row)
    else:
        import csv

        columns = next(csv.reader([first], delimiter="\t" if suffix == ".tsv" else ","), [])
    from popbert.data.classification import TEXT_COLUMNS

    wanted = getattr(args, "text_column", None)
    wanted = (wanted,) if wanted else TEXT_COLUMNS
    if not any(column in columns for column in wanted):
        return (f"rows without a text column (columns: {', '.join(map(str, columns[:6]))}; "
                f"looked for {', '.join(wanted)})")
    return None


def _rows_or_lines(path: Path, args: Any = None) -> str | None:
    return _rows(path, args, (*ROW_SUFFIXES, ".txt"))


def _task_data(path: Path, args: Any = None) -> str | None:
    """What one of the tasks reads (`PREDICT_INPUTS`): the export then checks it is its
    task's (`popbert.export.inference.check_task_data`)."""
    if path.suffix.lower() == ".json" and _squad(path) is None:
        return None
    problems = [kind.sniff(path, args) for kind in PREDICT_INPUTS.values()
                if kind.sniff is not None]
    return None if None in problems else _rows_or_lines(path, args)


def _onnx(path: Path, args: Any = None) -> str | None:
    what = describe(path)
    if what not in ("an ONNX model", "a text file"):
        return what
    import onnx

    try:
        model = onnx.load(str(path), load_external_data=False)
    except Exception:  # protobuf's DecodeError and friends: not ONNX, whatever it is
        return f"{what}, not an ONNX model" if what != "an ONNX model" else "not a valid ONNX model"
    if not model.graph.output:
        return "an ONNX file without a graph"
    return None


def _model(path: Path, args: Any = None) -> str | None:
    """An ONNX file, or an OpenVINO IR (its directory or its .xml)."""
    if path.is_dir():
        return None if (path / "model.xml").is_file() else f"{describe(path)} without model.xml"
    if path.suffix.lower() == ".xml":
        return None if b"<net" in _head(path, 4096) else "an XML file that is not an OpenVINO IR"
    return _onnx(path)


def _shards(path: Path, args: Any = None) -> str | None:
    what = describe(path)
    return None if what == "an HDF5 file" else what


def _dump(path: Path, args: Any = None) -> str | None:
    head = _head(path, 4096)
    if head.startswith(b"BZh"):
        return None
    if b"<mediawiki" in head:
        return None
    return describe(path) + " without <mediawiki"


def _corpus(path: Path, args: Any = None) -> str | None:
    """A text corpus, or (sentences stage) JSON lines or Parquet."""
    return None if describe(path) == "a Parquet file" else _text(path)


def _text_or_shards(path: Path, args: Any = None) -> str | None:
    return None if describe(path) == "an HDF5 file" else _text(path)


def _vocab(path: Path, args: Any = None) -> str | None:
    if path.suffix.lower() == ".json":
        value, problem = _json(path)
        if problem:
            return problem
        return None if isinstance(value, dict) and "model" in value else \
            "JSON that is not a tokenizer.json (no 'model')"
    return _text(path)


def _pem(path: Path, args: Any = None) -> str | None:
    problem = _text(path)
    if problem:
        return problem
    return None if b"-----BEGIN " in _head(path) else "text without a PEM block (-----BEGIN ...)"


def _checkpoint(path: Path, args: Any = None) -> str | None:
    if (path / "state.json").exists():
        return None
    incomplete = (path.name.startswith("step-") and path.parent.name == "checkpoints") or any(
        (path / name).exists() for name in ("weights.safetensors", "optimizer.pt", "rng.pt"))
    if incomplete:
        return None  # a checkpoint copied in part: find_checkpoint says what to do instead
    if any((step / "state.json").exists() for step in (path / "checkpoints").glob("step-*")):
        return None
    return f"{describe(path)} without a checkpoint (no state.json, no checkpoints/step-*/)"


def _hf_model(path: Path, args: Any = None) -> str | None:
    config = path / "config.json"
    if not config.is_file():
        return f"{describe(path)} without config.json"
    value, problem = _json(config)
    return f"config.json: {problem}" if problem else (
        None if isinstance(value, dict) else "config.json: not a JSON object")


TAGGED_SUFFIXES = (".conll", ".txt", ".tsv", ".bio", ".iob", ".jsonl", ".json")


def _tagged(path: Path, args: Any = None) -> str | None:
    """Tagged words: CoNLL (a word and its columns a line) or JSON lines with "tokens"."""
    suffix = path.suffix.lower()
    if suffix not in TAGGED_SUFFIXES:
        return f"a {path.suffix or 'suffix-less'} file (the format is read from the suffix)"
    problem = _text(path)
    if problem or suffix not in (".jsonl", ".json"):
        return problem
    row = _first_row(path)
    if row is None:
        value, _ = _json(path)
        return "a SQuAD JSON file" if _is_squad(value) else "not JSON lines (one object a line)"
    return None if "tokens" in row else "JSON lines without \"tokens\""


PAIR_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".parquet", ".pq")


def _pairs(path: Path, args: Any = None) -> str | None:
    """Embedding pairs: rows with an anchor and a positive column (`--anchor-column`,
    `--positive-column`; STS-B's sentence1 and sentence2 for scored pairs), or Parquet."""
    suffix = path.suffix.lower()
    if suffix not in PAIR_SUFFIXES:
        return f"a {path.suffix or 'suffix-less'} file (the format is read from the suffix)"
    if suffix in (".parquet", ".pq"):
        return None if _head(path, 4) == b"PAR1" else f"{describe(path)}, not Parquet"
    problem = _text(path)
    if problem:
        return problem
    if suffix in (".json", ".jsonl"):
        row = _first_row(path)
        if row is None:
            value, _ = _json(path)
            return "a SQuAD JSON file" if _is_squad(value) else \
                "not JSON lines (one object a line)"
        columns = list(row)
    else:
        import csv

        columns = next(csv.reader([_first_line(path)], delimiter="\t" if suffix == ".tsv"
                                  else ","), [])
    from popbert.data.embedding_pairs import PAIR_DEFAULTS

    for role in ("anchor", "positive"):
        wanted = getattr(args, f"{role}_column", None) or role
        if wanted not in columns and not (wanted == role and PAIR_DEFAULTS[role] in columns):
            article = "an" if role == "anchor" else "a"
            return (f"rows without {article} {role} column {wanted!r} (columns: "
                    f"{', '.join(map(str, columns[:6]))})")
    return None


def _pairs_or_beir(path: Path, args: Any = None) -> str | None:
    return _beir(path, args) if path.is_dir() else _pairs(path, args)


def _beir(path: Path, args: Any = None) -> str | None:
    """A BEIR directory: corpus.jsonl, queries.jsonl and a qrels/ folder of TSV files."""
    missing = [name for name in ("corpus.jsonl", "queries.jsonl", "qrels")
               if not (path / name).exists()]
    return f"{describe(path)} without {', '.join(missing)}" if missing else None


def _rerank_rows(path: Path, args: Any = None) -> str | None:
    """JSON lines whose first row has a "query" and "candidates"."""
    problem = _text(path)
    if problem:
        return problem
    row = _first_row(path)
    if row is None:
        return "not JSON lines (one object a line)"
    return None if {"query", "candidates"} <= set(row) else \
        "JSON lines without \"query\" and \"candidates\""


def _metrics(path: Path, args: Any = None) -> str | None:
    if path.is_dir():
        return None if (path / "metrics.jsonl").is_file() else \
            f"{describe(path)} without metrics.jsonl"
    problem = _text(path)
    if problem:
        return problem
    first = next((line for line in _head(path).decode("utf-8", "ignore").splitlines()
                  if line.strip()), "")
    try:
        return None if isinstance(json.loads(first), dict) else "not metrics JSON lines"
    except json.JSONDecodeError:
        return "not metrics JSON lines"


# ---------------------------------------------------------------------------------- the owners
# Each takes an existing output path and says whether it holds what the command writes there (a
# previous export, prediction, plot...): only such a path is replaced. An empty directory is
# anyone's; every other path is refused (`_check_output`).

IR_FILES = frozenset({"model.xml", "model.bin"})
HF_EXPORT_FILES = frozenset({"config.json", "model.safetensors", "vocab.txt", "tokenizer.json",
                             "tokenizer_config.json",
                             # an embedding checkpoint's sentence-transformers files
                             "modules.json", "1_Pooling", "2_Normalize",
                             "sentence_bert_config.json", "config_sentence_transformers.json"})


def _entries(path: Path) -> set[str]:
    return {p.name for p in path.iterdir()}


def _owns_export(path: Path) -> bool:
    """An ONNX model, or an OpenVINO IR directory (`popbert export --runtime openvino`)."""
    if path.is_dir():
        return _entries(path) <= IR_FILES
    return path.is_file() and _onnx(path) is None


def _owns_squad_predictions(path: Path) -> bool:
    return path.is_file() and _predictions(path) is None


def _owns_nbest(path: Path) -> bool:
    value, problem = _json(path) if path.is_file() else (None, "not a file")
    return problem is None and isinstance(value, dict) and all(
        isinstance(v, list) for v in value.values())


def _owns_labelled_rows(path: Path) -> bool:
    """`popbert predict classify`'s JSON lines: a `label` and `probabilities` in each, or a
    regression model's `line` and `score`."""
    row = _first_row(path) if path.is_file() and _text(path) is None else None
    return row is not None and ({"label", "probabilities"} <= set(row)
                                or {"line", "score"} <= set(row))


def _owns_ranked(path: Path) -> bool:
    """`popbert predict rerank`'s JSON lines: a `query` and its `ranked` candidates."""
    row = _first_row(path) if path.is_file() and _text(path) is None else None
    return row is not None and {"query", "ranked"} <= set(row)


def _owns_trec_run(path: Path) -> bool:
    """A ranking in TREC's run format: `qid Q0 docid rank score tag` lines."""
    cells = _first_line(path).split() if path.is_file() and _text(path) is None else []
    return len(cells) == 6 and cells[1] == "Q0"


def _owns_config(path: Path) -> bool:
    return path.is_file() and _config(path) is None


def _owns_plot(path: Path) -> bool:
    return path.is_file() and _head(path, 8) == b"\x89PNG\r\n\x1a\n"


def _owns_vocab(path: Path) -> bool:
    return path.is_file() and _vocab(path) is None


def _owns_hf_export(path: Path) -> bool:
    return path.is_dir() and _entries(path) <= HF_EXPORT_FILES


def _owns_import(path: Path) -> bool:
    """A run directory `popbert import-hf` wrote (its import.json, nothing foreign)."""
    from popbert.io.run_dir import foreign_files

    return path.is_dir() and (path / "import.json").is_file() and not foreign_files(path)


# ---------------------------------------------------------------------------------- the kinds
@dataclass(frozen=True)
class PathKind:
    """What a flag's or key's path must be. Used as the flag's argparse `type`: it converts the
    text (to a `Path`, or text for kinds that take URLs, globs or preset names) and marks the
    flag for `check_arguments`."""

    expected: str
    directory: bool | None = False  # a directory; False: a file; None: either
    output: bool = False
    urls: bool = False               # fsspec URLs (s3://, gs://...) are accepted
    globs: bool = False              # comma-separated paths and globs
    presets: bool = False            # a preset name when no such file exists (--config)
    sniff: Callable[[Path, Any], str | None] | None = None
    # Outputs: whether an existing path holds what the command writes (then it is replaced);
    # None: the command's own rule decides (a run directory: `popbert.io.run_dir`).
    owns: Callable[[Path], bool] | None = None
    # Outputs: files the command writes beside the output ("{name}" is the output's name), each
    # with its owner test: an existing one that is not the command's is refused too.
    companions: tuple[tuple[str, Callable[[Path], bool]], ...] = ()
    into_runs: bool = False          # may be written inside a run (the run's own plot)

    def __call__(self, text: str) -> Path | str:
        # Path drops "//" of a URL, and makes "" the working directory: both stay text.
        keep = self.urls or self.globs or self.presets or _URL.match(text) or not text.strip()
        return text if keep else Path(text)

    @property
    def __name__(self) -> str:  # argparse names the type in its own errors
        return self.expected


CONFIG_FILE = PathKind("a YAML config file or a preset name", presets=True, sniff=_config)
RUN = PathKind("a run directory or one of its checkpoints", directory=True, sniff=_checkpoint)
CHECKPOINT = PathKind("a checkpoint or run directory (popbert pretrain, import-hf)",
                      directory=True, sniff=_checkpoint)
HF_MODEL = PathKind("a Hugging Face model directory (config.json and weights)", directory=True,
                    sniff=_hf_model)
SQUAD = PathKind("a SQuAD v1.1 JSON file", sniff=_squad)
PREDICTIONS = PathKind("SQuAD predictions (a JSON object of question id to answer)",
                       sniff=_predictions)
ROWS = PathKind("classification rows (.tsv, .csv or .jsonl)", sniff=_rows)
ROWS_OR_LINES = PathKind("classification rows (.tsv, .csv, .jsonl) or a .txt file of texts",
                         sniff=_rows_or_lines)
TASK_DATA = PathKind("a fine-tuning task's data: classification rows (.tsv, .csv, .jsonl) or a "
                     ".txt file of texts, a SQuAD JSON file, tagged words (CoNLL or JSON lines) "
                     "or embedding pairs", sniff=lambda path, args=None: _task_data(path, args))
ONNX_MODEL = PathKind("an ONNX model or an OpenVINO IR directory (popbert export)",
                      directory=None, sniff=_model)
METRICS = PathKind("a run directory or its metrics.jsonl", directory=None, sniff=_metrics)
BEIR = PathKind("a BEIR directory (corpus.jsonl, queries.jsonl, qrels/)", directory=True,
                sniff=_beir)
RERANK_ROWS = PathKind("JSON lines of a query and its candidates", sniff=_rerank_rows)
TAGGED = PathKind("tagged words: CoNLL (.conll, .txt, .tsv, .bio, .iob) or JSON lines of "
                  "tokens and tags", sniff=_tagged)
PAIRS = PathKind("embedding pairs: JSON lines, CSV, TSV or Parquet rows with anchor and positive "
                 "columns (or sentence1, sentence2 and score)", sniff=_pairs)
PAIRS_OR_BEIR = PathKind("embedding pairs (JSON lines, CSV, TSV or Parquet) or a BEIR directory "
                         "(corpus.jsonl, queries.jsonl, qrels/)", directory=None,
                         sniff=_pairs_or_beir)
DUMP = PathKind("a MediaWiki XML dump (.xml or .xml.bz2)", urls=True, sniff=_dump)
CORPUS = PathKind("a stage directory or text, JSON-lines or Parquet files (comma-separated, "
                  "globs)", directory=None, urls=True, globs=True, sniff=_corpus)
TEXT = PathKind("a stage directory or text files (comma-separated, globs)", directory=None,
                urls=True, globs=True, sniff=_text)
SHARDS = PathKind("an instances stage directory or HDF5 shards (comma-separated, globs)",
                  directory=None, urls=True, globs=True, sniff=_shards)
TRAINING_DATA = PathKind("text files or HDF5 shards (globs)", urls=True, globs=True,
                         sniff=_text_or_shards)
VOCAB = PathKind("a WordPiece vocab.txt or a tokenizer.json", urls=True, sniff=_vocab)
PEM = PathKind("a PEM file (a TLS certificate or private key)", sniff=_pem)
OUTPUT_FILE = PathKind("a file to write", output=True)
EXPORT_OUTPUT = PathKind("a new file or an earlier export (an IR directory with --runtime "
                         "openvino)", directory=None, output=True, owns=_owns_export,
                         companions=(("{name}.data", lambda data: _owns_export(
                             data.with_name(data.name[:-len(".data")]))),))
SQUAD_PREDICTIONS_OUTPUT = PathKind("a new file or earlier SQuAD predictions", output=True,
                                    owns=_owns_squad_predictions,
                                    companions=(("nbest_predictions.json", _owns_nbest),))
LABELS_OUTPUT = PathKind("a new file or earlier predict classify output", output=True,
                         owns=_owns_labelled_rows)
EMBEDDINGS_OUTPUT = PathKind("a new file or earlier predict embed output (JSON lines or .npy)",
                             output=True, owns=lambda path: path.is_file() and (
                                 _head(path, 6) == b"\x93NUMPY" or (
                                     _text(path) is None and "embedding" in
                                     (_first_row(path) or {}))))
TAGGED_OUTPUT = PathKind("a new file or an earlier predict ner output (CoNLL or JSON lines)",
                         output=True, owns=lambda path: path.is_file() and _tagged(path) is None)
RANKED_OUTPUT = PathKind("a new file or earlier predict rerank output", output=True,
                         owns=_owns_ranked)
TREC_RUN_OUTPUT = PathKind("a new file or an earlier TREC run", output=True,
                           owns=_owns_trec_run)
CONFIG_OUTPUT = PathKind("a new file or an earlier popbert config", output=True,
                         owns=_owns_config)
PLOT_OUTPUT = PathKind("a new file or an earlier plot (PNG)", output=True, owns=_owns_plot,
                       into_runs=True)
OUTPUT_DIR = PathKind("a directory to write", directory=True, output=True)
IMPORT_OUTPUT = PathKind("a new or empty directory, or an earlier import-hf output",
                         directory=True, output=True, owns=_owns_import)
HF_EXPORT_OUTPUT = PathKind("a new or empty directory, or an earlier export-hf output",
                            directory=True, output=True, owns=_owns_hf_export)
DATA_OUTPUT_FILE = PathKind("a new file or an earlier vocabulary (or a URL)", output=True,
                            urls=True, owns=_owns_vocab)
DATA_OUTPUT_DIR = PathKind("a directory to write (or a URL prefix)", directory=True,
                           output=True, urls=True)

# Config keys that name paths (lists of them for input_files and validation_files).
CONFIG_PATHS: dict[str, PathKind] = {
    "data.input_files": TRAINING_DATA,
    "data.validation_files": TRAINING_DATA,
    "data.vocab_file": VOCAB,
    "data.cache_dir": OUTPUT_DIR,
    "finetune.checkpoint": CHECKPOINT,
}
# What a fine-tuning task's files are (`popbert.tasks.Task.files`): for training and
# evaluation (`finetune.train_file`, `finetune.eval_file`), and for an export's `--eval` and
# `--calibration` and prediction (a classifier also reads a .txt file of texts there).
TRAINING_FILES: dict[str, PathKind] = {"squad": SQUAD, "rows": ROWS, "tagged": TAGGED,
                                       "pairs": PAIRS, "pairs_or_beir": PAIRS_OR_BEIR}
PREDICT_INPUTS: dict[str, PathKind] = {"squad": SQUAD, "rows": ROWS_OR_LINES, "tagged": TAGGED,
                                       "pairs": PAIRS}


# ---------------------------------------------------------------------------------- checking
def _url_scheme(text: str) -> str | None:
    match = _URL.match(text)
    return match.group(1).lower() if match else None


def _refuse(name: str, value: object, problem: str, kind: PathKind) -> UsageError:
    """The one line: flag or key, the value, what it is (`problem`), what was expected."""
    if problem.startswith(("a ", "an ")):  # what it is instead ("an HDF5 file")
        problem = f"is {problem}"
    return UsageError(f"{name} {value}: {problem}; expected {kind.expected}")


def _check_url(name: str, text: str, kind: PathKind) -> None:
    scheme = _url_scheme(text)
    if not kind.urls:
        raise _refuse(name, text, f"a {scheme}:// URL; only the data paths may be URLs", kind)
    import fsspec

    if scheme not in fsspec.available_protocols():
        raise _refuse(name, text, f"no filesystem handles {scheme}:// (known: s3, gs, az, "
                      "file, http, memory and the other fsspec protocols)", kind)


def _blocking_file(path: Path) -> Path | None:
    """A regular file among `path`'s ancestors, if any (the path can then never exist)."""
    for ancestor in path.parents:
        if ancestor.is_file():
            return ancestor
        if ancestor.is_dir():
            return None
    return None


def _paths_of(text: str, kind: PathKind) -> Iterator[Path]:
    """The local paths a value names: itself, or for globs kinds each comma-separated item's
    matches."""
    items = [t.strip() for t in text.split(",") if t.strip()] if kind.globs else [text]
    for item in items:
        if kind.globs and globlib.has_magic(item):
            matches = sorted(globlib.glob(item))
            if not matches:
                raise UsageError(f"{item}: matches no file")
            # A glob names files: a directory among them would be read as one mid-stage.
            directory = next((m for m in matches if os.path.isdir(m)), None)
            if directory is not None:
                raise UsageError(f"{item}: matches the directory {directory}; a glob must "
                                 f"match files only")
            yield from (Path(m) for m in matches[:8])  # a look at the first few is enough
        else:
            yield Path(item)


def check_path(name: str, value: str | os.PathLike, kind: PathKind,
               args: argparse.Namespace | None = None) -> None:
    """Refuse `value` for flag or key `name` unless it can be what `kind` wants: one line.
    `args`: the command's other options, where a sniff depends on them (`--text-column`)."""
    text = os.fspath(value)
    if not text.strip():
        raise _refuse(name, repr(text), "an empty path", kind)
    if _url_scheme(text) is not None and _url_scheme(text) not in _LOCAL_SCHEMES:
        _check_url(name, text, kind)
        return  # reachability and credentials are the storage layer's (one line too)
    if _url_scheme(text) in _LOCAL_SCHEMES:
        text = text.split("://", 1)[1]
    if kind.presets and not Path(text).exists():
        from popbert.config import list_presets

        if text in list_presets():
            return
        raise _refuse(name, text, f"not found, nor a preset ({', '.join(list_presets())})", kind)
    try:
        paths = list(_paths_of(text, kind))
    except UsageError as error:
        raise _refuse(name, text, str(error).split(": ", 1)[1], kind) from None
    for path in paths:
        blocking = _blocking_file(path)
        if blocking is not None:
            raise _refuse(name, path, f"{blocking} is a file, not a directory", kind)
        if kind.output:
            _check_output(name, path, kind)
            continue
        if not path.exists():
            raise _refuse(name, path, "not found", kind)
        if kind.directory is True and not path.is_dir():
            raise _refuse(name, path, f"{describe(path)}, not a directory", kind)
        if kind.directory is False and path.is_dir():
            raise _refuse(name, path, f"{describe(path)}, not a file", kind)
        if path.is_dir() and kind.globs:
            continue  # a stage directory: its parts are listed (and refused) by the stage
        if not os.access(path, os.R_OK):
            raise _refuse(name, path, "not readable (permission denied)", kind)
        if path.is_file() and path.stat().st_size == 0:
            raise _refuse(name, path, "an empty file", kind)
        problem = kind.sniff(path, args) if kind.sniff else None
        if problem:
            raise _refuse(name, path, problem, kind)


def _check_output(name: str, path: Path, kind: PathKind) -> None:
    """An output goes where it replaces nothing the command did not write: not the working
    directory or above it, not inside a run or checkpoint, not over another kind of file."""
    if kind.directory and path.exists() and not path.is_dir():
        raise _refuse(name, path, f"{describe(path)}, not a directory", kind)
    if kind.directory is False and path.is_dir():
        raise _refuse(name, path, f"{describe(path)}, not a file name", kind)
    resolved = path.resolve()
    cwd = Path.cwd().resolve()
    if resolved == cwd or resolved in cwd.parents:
        where = "the working directory" if resolved == cwd else "a parent of the working directory"
        raise _refuse(name, path, f"{where}; an output never replaces it", kind)
    holder = _run_or_checkpoint_holding(path)
    if holder is not None:
        what, directory = holder
        # A run's own plot (`popbert plot RUN`): a PNG at the top of the run, new or a plot.
        own_plot = kind.into_runs and what == "run" and directory == resolved.parent and (
            not path.exists() or kind.owns is None or kind.owns(path))
        if not own_plot:
            raise _refuse(name, path, f"inside the {what} {directory}, which this command did "
                          "not write", kind)
    if kind.owns is None:
        return
    if path.exists() and not (path.is_dir() and not any(path.iterdir())) and not kind.owns(path):
        raise _refuse(name, path, f"{describe(path)} this command did not write; it is never "
                      "replaced: remove it or choose another path", kind)
    for pattern, owns in kind.companions:
        companion = path.with_name(pattern.format(name=path.name))
        if companion.exists() and not owns(companion):
            raise _refuse(name, path, f"{companion.name} beside it is {describe(companion)} this "
                          "command did not write and would replace; remove it or choose another "
                          "path", kind)


def _run_or_checkpoint_holding(path: Path) -> tuple[str, Path] | None:
    """("run", DIR) or ("checkpoint", DIR) when `path` lies inside one (at any depth)."""
    for ancestor in path.resolve().parents:
        if (ancestor / "state.json").is_file():
            return "checkpoint", ancestor
        if (ancestor / "config.yaml").is_file() and ((ancestor / "checkpoints").is_dir()
                                                     or (ancestor / "metrics.jsonl").is_file()):
            return "run", ancestor
    return None


# ---------------------------------------------------------------------------------- arguments
def declared_paths(parser: argparse.ArgumentParser) -> list[tuple[str, str, PathKind]]:
    """(dest, flag, kind) of each of `parser`'s own options that names a path."""
    return [(a.dest, a.option_strings[0] if a.option_strings else a.metavar or a.dest, a.type)
            for a in parser._actions if isinstance(a.type, PathKind)]


def subparsers(parser: argparse.ArgumentParser) -> Iterator[tuple[tuple[str, ...],
                                                                   argparse.ArgumentParser]]:
    """Every parser in the tree under `parser` with its command words, `parser` included."""
    yield (), parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for word, child in action.choices.items():
                for words, grandchild in subparsers(child):
                    yield (word, *words), grandchild


def declare_paths(parser: argparse.ArgumentParser) -> None:
    """Give each command's namespace the list of its path flags (for `check_arguments`)."""
    for _, p in subparsers(parser):
        p.set_defaults(path_flags=declared_paths(p))


def _values(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, list | tuple) else [value]


def check_arguments(args: argparse.Namespace,
                    flags: Iterable[tuple[str, str, PathKind]] | None = None) -> None:
    """Check that no output is (or, a directory, holds) one of the inputs, then every declared
    path flag the user gave."""
    flags = list(getattr(args, "path_flags", []) if flags is None else flags)
    inputs = {_resolved(v): flag for dest, flag, kind in flags if not kind.output
              for v in _values(getattr(args, dest, None)) if _resolved(v) is not None}
    for dest, flag, kind in flags:
        if not kind.output:
            continue
        for value in _values(getattr(args, dest, None)):
            target = _resolved(value)
            if target is None:
                continue
            if kind.directory is not True and target in inputs:
                raise UsageError(f"{flag} {value}: is also this command's {inputs[target]}; "
                                 "an output never replaces an input: choose another path")
            if kind.directory is not True or target.is_file():
                continue  # a file given for a directory: check_path says so
            for source, in_flag in inputs.items():
                if source != target and target not in source.parents:
                    continue
                if in_flag == "--resume":
                    continue  # a run's own directory is where --resume continues it
                raise UsageError(f"{flag} {value}: holds this command's {in_flag} {source}; an "
                                 "output never replaces an input; expected a directory apart "
                                 "from the inputs")
    for dest, flag, kind in flags:
        for value in _values(getattr(args, dest, None)):
            check_path(flag, value, kind, args)


def _resolved(value: Any) -> Path | None:
    text = os.fspath(value)
    if not text.strip() or _url_scheme(text) is not None or globlib.has_magic(text) \
            or "," in text:
        return None  # "" is refused by check_path
    return Path(text).resolve()


def check_config_paths(cfg: Any) -> None:
    """Check the paths a run's config names (`CONFIG_PATHS`, and its task's data files)."""
    declared = dict(CONFIG_PATHS)
    if cfg.finetune.task is not None:  # the task's own file format
        from popbert.tasks import task_named

        task = task_named(cfg.finetune.task)
        kind = TRAINING_FILES[task.files]
        evaluated = next((flag.file for flag in task.flags
                          if flag.key == "finetune.eval_file" and flag.file), task.files)
        declared.update({"finetune.train_file": kind,
                         "finetune.eval_file": TRAINING_FILES[evaluated]})
    for key, kind in declared.items():
        section, name = key.split(".")
        for value in _values(getattr(getattr(cfg, section), name)):
            check_path(key, value, kind)


# ---------------------------------------------------------------------------------- older API
def check_output_file(path: Path | None, flag: str) -> Path | None:
    """Refuse an output file `path` that cannot be written as a file (a handler's default)."""
    if path is not None:
        check_path(flag, path, OUTPUT_FILE)
    return path


def check_output_directory(path: Path | None, flag: str = "--output-dir") -> Path | None:
    """Refuse an output directory that is a file, sits under one or cannot be written
    (`popbert.io.run_dir.check_output_dir`, as a run's directory is checked)."""
    if path is not None:
        from popbert.io.run_dir import check_output_dir

        check_output_dir(path, flag)
    return path


__all__ = ["BEIR", "CHECKPOINT", "CONFIG_FILE", "CONFIG_OUTPUT", "CONFIG_PATHS", "CORPUS",
           "DATA_OUTPUT_DIR", "DATA_OUTPUT_FILE", "DUMP", "EMBEDDINGS_OUTPUT", "EXPORT_OUTPUT",
           "HF_EXPORT_OUTPUT",
           "HF_MODEL", "IMPORT_OUTPUT", "LABELS_OUTPUT", "METRICS", "ONNX_MODEL", "OUTPUT_DIR",
           "OUTPUT_FILE", "PAIRS", "PAIRS_OR_BEIR", "PLOT_OUTPUT", "PREDICTIONS",
           "PREDICT_INPUTS", "RANKED_OUTPUT",
           "RERANK_ROWS", "ROWS", "ROWS_OR_LINES", "RUN", "SHARDS", "SQUAD",
           "SQUAD_PREDICTIONS_OUTPUT", "TAGGED", "TASK_DATA", "TAGGED_OUTPUT", "TEXT",
           "TRAINING_DATA",
           "TRAINING_FILES", "TREC_RUN_OUTPUT", "VOCAB", "PathKind", "check_arguments",
           "check_config_paths", "check_output_directory", "check_output_file", "check_path",
           "declare_paths", "declared_paths", "describe", "subparsers", "yaml_keys"]
