"""The bad-input matrix, generated from the command line itself.

Every `popbert` command's parser (and examples/pretrain.py's) is walked; every option declared as
a path (`popbert.io.paths`: a `PathKind` as its argparse type) and every config key in
`CONFIG_PATHS` is given, in turn, each bad input its kind can get — missing, a directory for a
file and a file for a directory, empty, bytes that are not UTF-8 or not the binary format it
wants, a file of another kind that parses, a path under a regular file, a URL scheme nothing
handles, an output onto one of the command's inputs or onto a file of a run — while the other
paths get valid stand-ins. Each cell must end in one line naming the flag or key, what it got
and what it expected, with exit status 2, no traceback, the command's own work never started
and nothing written. A new path option joins the matrix by being declared; an option that looks
like a path but is not declared fails `test_every_path_option_is_declared`.
"""

from __future__ import annotations

import argparse
import bz2
import importlib.util
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import h5py
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from popbert.cli.main import build_parser, run_command
from popbert.cli.sweep import SWEEP_FILE
from popbert.data.tokenization import bundled_vocab_path
from popbert.io import paths
from popbert.io.paths import CONFIG_PATHS, PathKind

FIXTURES = Path(__file__).parent.parent / "fixtures"
EXAMPLE = Path(__file__).parents[2] / "examples" / "pretrain.py"
# Values for the required options that are not paths.
REQUIRED = {"task": ["--task", "encoder"], "sequence_length": ["--sequence-length", "32"],
            "max_predictions": ["--max-predictions", "5"], "sweep": ["no-such-sweep"]}
# Options whose metavar looks like a path but which name something else.
NOT_PATHS = {("sweep", "agent", "sweep"), ("sweep", "show", "sweep")}
UNKNOWN_URL = "nosuch://bucket/key"


class Inputs:
    """Valid stand-ins for each kind of path, and the bad inputs, made once in one folder."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.text = self._write("corpus.txt", "One sentence here.\nAnother one.\n\nA doc.\n")
        self.squad = self._copy(FIXTURES / "squad" / "squad-v1.1-sample.json", "squad.json")
        self.rows = self._copy(FIXTURES / "classification" / "sentiment.tsv", "rows.tsv")
        rows = [{"sentence": "good", "label": "pos"}, {"sentence": "bad", "label": "neg"}]
        self.rows_json = self._write("rows.json", "".join(json.dumps(r) + "\n" for r in rows))
        self.predictions = self._write("predictions.json", json.dumps({"q1": "an answer"}))
        self.config = self._copy(Path(paths.__file__).parents[1] / "config" / "presets" /
                                 "tiny.yaml", "config.yaml")
        self.sweep = self._write("sweep.yaml", "job: pretrain\nmethod: grid\nmetric: {name: "
                                 "loss, goal: minimize}\nparameters: {optimizer.lr: {values: "
                                 "[0.001]}}\n")
        self.checkpoint = root / "ckpt"
        self.checkpoint.mkdir()
        (self.checkpoint / "state.json").write_text("{}")
        (self.checkpoint / "config.yaml").write_text(self.config.read_text())
        self.hf = root / "hf"
        self.hf.mkdir()
        (self.hf / "config.json").write_text('{"model_type": "bert"}')
        self.run = root / "run"
        self.run.mkdir()
        (self.run / "config.yaml").write_text(self.config.read_text())
        (self.run / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n')
        self.shard = root / "part-00000.h5"
        with h5py.File(self.shard, "w") as f:
            f["input_ids"] = np.zeros((2, 8), np.int32)
        self.onnx = root / "model.onnx"
        node = helper.make_node("Identity", ["x"], ["y"])
        graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
            "x", TensorProto.FLOAT, [1])], [helper.make_tensor_value_info(
                "y", TensorProto.FLOAT, [1])])
        onnx.save(helper.make_model(graph), str(self.onnx))
        self.dump = root / "dump.xml.bz2"
        self.dump.write_bytes(bz2.compress(b"<mediawiki></mediawiki>"))
        self.safetensors = self._write("weights.safetensors", "")
        self.safetensors.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00" + b'{"__metadata__":{}}')
        self.directory = root / "a-directory"
        self.directory.mkdir()
        (self.directory / "something.txt").write_text("x")
        self.empty_directory = root / "empty-directory"
        self.empty_directory.mkdir()
        self.beir = root / "beir"
        (self.beir / "qrels").mkdir(parents=True)
        (self.beir / "corpus.jsonl").write_text('{"_id": "d1", "text": "a document"}\n')
        (self.beir / "queries.jsonl").write_text('{"_id": "q1", "text": "a query"}\n')
        (self.beir / "qrels" / "test.tsv").write_text("query-id\tcorpus-id\tscore\nq1\td1\t1\n")
        self.rerank = self._write("rerank.jsonl", '{"query": "q", "candidates": ["a", "b"]}\n')
        self.tagged = self._write("tagged.conll", "Paris B-LOC\nis O\n\n")
        self.pairs = self._write("pairs.jsonl", '{"anchor": "a", "positive": "b"}\n')
        self.pem = self._write("cert.pem", "-----BEGIN CERTIFICATE-----\nMIIB\n"
                               "-----END CERTIFICATE-----\n")

    def _write(self, name: str, text: str) -> Path:
        path = self.root / name
        path.write_text(text)
        return path

    def _copy(self, source: Path, name: str) -> Path:
        return Path(shutil.copy(source, self.root / name))

    def valid(self, kind: PathKind, n: int) -> str:
        """A value `kind` accepts (outputs: a fresh name, `n` keeping them apart)."""
        if kind.output:
            return str(self.root / f"new-output-{n}" / ("dir" if kind.directory else "f.out"))
        return str({
            paths.CONFIG_FILE: "tiny", SWEEP_FILE: self.sweep, paths.RUN: self.checkpoint,
            paths.CHECKPOINT: self.checkpoint, paths.HF_MODEL: self.hf, paths.SQUAD: self.squad,
            paths.PREDICTIONS: self.predictions, paths.ROWS: self.rows,
            paths.ROWS_OR_LINES: self.rows, paths.TASK_DATA: self.rows,
            paths.ONNX_MODEL: self.onnx, paths.METRICS: self.run, paths.DUMP: self.dump,
            paths.CORPUS: self.text, paths.TEXT: self.text, paths.SHARDS: self.shard,
            paths.TRAINING_DATA: self.text, paths.VOCAB: bundled_vocab_path(),
            paths.BEIR: self.beir, paths.RERANK_ROWS: self.rerank, paths.TAGGED: self.tagged,
            paths.PAIRS: self.pairs, paths.PAIRS_OR_BEIR: self.pairs, paths.PEM: self.pem,
        }[kind])

    def impostor(self, kind: PathKind) -> Path:
        """A file or directory of another kind that parses, for `kind`."""
        return {
            paths.CONFIG_FILE: self.sweep, SWEEP_FILE: self.config, paths.RUN: self.hf,
            paths.CHECKPOINT: self.hf, paths.HF_MODEL: self.checkpoint,
            paths.SQUAD: self.rows_json, paths.PREDICTIONS: self.squad,
            paths.ROWS: self.squad, paths.ROWS_OR_LINES: self.squad,
            paths.TASK_DATA: self.predictions, paths.ONNX_MODEL: self.shard,
            paths.METRICS: self.config, paths.DUMP: self.text, paths.CORPUS: self.shard,
            paths.TEXT: self.safetensors, paths.SHARDS: self.text,
            paths.TRAINING_DATA: self.safetensors, paths.VOCAB: self.shard,
            paths.BEIR: self.run, paths.RERANK_ROWS: self.rows_json,
            paths.TAGGED: self.rows_json, paths.PAIRS: self.rows_json,
            paths.PAIRS_OR_BEIR: self.rows_json, paths.PEM: self.text,
        }[kind]

    def cells(self, kind: PathKind, suffix: str) -> Iterator[tuple[str, str]]:
        """(name, bad value) of every cell of the matrix that applies to `kind`."""
        yield "under a regular file", str(self.text / f"x{suffix}")
        yield "URL scheme nothing handles", UNKNOWN_URL
        if kind.output:
            yield "an empty path", ""
            yield "the working directory", "."
            yield "inside a run", str(self.run / "inside" / "x")
            yield "inside a checkpoint", str(self.checkpoint / "x")
            if kind.directory:
                yield "a file for a directory", str(self.text)
            else:
                if kind.directory is False:
                    yield "a directory for a file", str(self.directory)
                yield "a file of a run", str(self.run / "config.yaml")
            if kind.owns is not None:  # what the command did not write is never replaced
                yield "a file it did not write", str(self.rows_json)
                if kind.directory is not False:
                    yield "a directory it did not write", str(self.directory)
            return
        yield "missing", str(self.root / f"missing{suffix}")
        yield "another kind that parses", str(self.impostor(kind))
        if kind.directory is True:
            yield "a file for a directory", str(self.text)
            yield "an empty directory", str(self.empty_directory)
            return
        if kind.directory is False:
            yield "a directory for a file", str(self.directory)
        empty = self.root / f"empty{suffix}"
        empty.write_bytes(b"")
        yield "empty", str(empty)
        bad = self.root / f"undecodable{suffix}"
        bad.write_bytes(b"\xff\xfe\x00\x81 not text, not HDF5, not ONNX\n")
        yield "not UTF-8 / not the format", str(bad)


SUFFIX = {paths.SQUAD: ".json", paths.PREDICTIONS: ".json", paths.ROWS: ".tsv",
          paths.ROWS_OR_LINES: ".tsv", paths.TASK_DATA: ".json", paths.ONNX_MODEL: ".onnx",
          paths.SHARDS: ".h5", paths.CONFIG_FILE: ".yaml", SWEEP_FILE: ".yaml",
          paths.VOCAB: ".txt", paths.DUMP: ".xml.bz2", paths.METRICS: ".jsonl",
          paths.RERANK_ROWS: ".jsonl", paths.TAGGED: ".conll", paths.PAIRS: ".jsonl",
          paths.PAIRS_OR_BEIR: ".jsonl", paths.PEM: ".pem"}


def example_parser() -> argparse.ArgumentParser:
    """examples/pretrain.py's parser, as its `__main__` block builds it."""
    spec = importlib.util.spec_from_file_location("pretrain_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    parser = argparse.ArgumentParser()
    module.add_pretrain_arguments(parser)
    assert "add_pretrain_arguments(parser)" in EXAMPLE.read_text()
    return parser


def commands() -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    for words, parser in paths.subparsers(build_parser()):
        if parser.get_default("handler") is not None:
            yield words, parser
    yield ("examples/pretrain.py",), example_parser()


def argv_for(words: tuple[str, ...], parser: argparse.ArgumentParser, inputs: Inputs,
             bad: dict[str, str]) -> list[str]:
    """The command line with every required path valid, the `bad` ones as given."""
    argv: list[str] = []  # parsed by the command's own parser: no command words
    positionals = []
    for n, action in enumerate(parser._actions):
        if isinstance(action.type, PathKind):
            if action.dest in bad:
                value = bad[action.dest]
            elif action.required or (not action.option_strings and action.nargs != "?"):
                value = inputs.valid(action.type, n)
            else:
                continue
            if action.option_strings:
                argv += [action.option_strings[0], value]
            else:
                positionals.append(value)
        elif action.required and action.dest != "help":
            if not action.option_strings:
                positionals += REQUIRED[action.dest]
            else:
                argv += REQUIRED[action.dest]
    return [*argv, *positionals]


def snapshot(root: Path) -> list[tuple[str, int]]:
    return sorted((str(p.relative_to(root)), p.stat().st_size if p.is_file() else -1)
                  for p in root.rglob("*"))


def assert_refused(line: str, name: str, value: str) -> None:
    assert line.startswith("popbert: error: "), line
    assert "Traceback" not in line and "\n" not in line.strip()
    assert f"{name} {value}" in line or f"{name} " in line, line  # names the flag or key
    assert "expected" in line, line


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    return Inputs(tmp_path_factory.mktemp("matrix") / "inputs")


def run_cell(words, parser, argv, capsys, monkeypatch) -> tuple[int, str]:
    """Parse `argv` with `parser` and run it the CLI's way, with a handler that fails the cell
    if reached (the checks come before any work)."""
    reached = []
    args = parser.parse_args(argv)
    capsys.readouterr()
    if words[0].startswith("examples/"):
        from popbert.io.paths import check_arguments, declared_paths

        def handler(a: argparse.Namespace) -> int:
            check_arguments(a, declared_paths(parser))
            reached.append(a)
            return 0
    else:
        def handler(a: argparse.Namespace) -> int:
            reached.append(a)
            return 0
    status = run_command(handler, args)
    assert not reached, f"{' '.join(argv)}: accepted, the command would have run"
    return status, capsys.readouterr().err


def test_matrix_over_every_path_option(inputs: Inputs, capsys, monkeypatch) -> None:
    cells = 0
    for words, parser in commands():
        for dest, flag, kind in paths.declared_paths(parser):
            for cell, value in inputs.cells(kind, SUFFIX.get(kind, ".txt")):
                argv = argv_for(words, parser, inputs, {dest: value})
                before = snapshot(inputs.root)
                status, err = run_cell(words, parser, argv, capsys, monkeypatch)
                where = f"{' '.join(words)} {flag} ({cell}): {err!r}"
                assert status == 2, where
                lines = err.strip().splitlines()
                assert len(lines) == 1, where
                assert_refused(lines[0], flag, value)
                assert snapshot(inputs.root) == before, f"{where}: wrote something"
                cells += 1
    assert cells > 250  # every command's every path flag, about 7 cells each


def test_outputs_never_replace_inputs(inputs: Inputs, capsys, monkeypatch) -> None:
    """Each output file flag given one of the same command's input files: refused."""
    tried = 0
    for words, parser in commands():
        declared = paths.declared_paths(parser)
        outputs = [(d, f, k) for d, f, k in declared if k.output and not k.directory]
        sources = [(d, f, k) for d, f, k in declared if not k.output and k.directory is not True]
        for out_dest, out_flag, _ in outputs:
            for in_dest, in_flag, in_kind in sources:
                value = inputs.valid(in_kind, 0)
                if not Path(value).is_file():
                    continue  # a directory (a run) is refused as an output file anyway
                argv = argv_for(words, parser, inputs, {in_dest: value, out_dest: value})
                status, err = run_cell(words, parser, argv, capsys, monkeypatch)
                assert status == 2 and f"{out_flag} {value}: is also this command's {in_flag}" \
                    in err, (argv, err)
                tried += 1
    assert tried >= 6


# What each output kind writes, as an earlier run of its command left it: replaced, not refused.
def earlier_output(kind: PathKind, inputs: Inputs, n: int) -> Path:
    root = inputs.root / f"earlier-{n}"
    root.mkdir()
    if kind is paths.EXPORT_OUTPUT:
        return Path(shutil.copy(inputs.onnx, root / "model.onnx"))
    if kind is paths.SQUAD_PREDICTIONS_OUTPUT:
        (root / "nbest_predictions.json").write_text('{"q1": [{"text": "an answer"}]}')
        return Path(shutil.copy(inputs.predictions, root / "predictions.json"))
    if kind is paths.LABELS_OUTPUT:
        path = root / "predictions.jsonl"
        path.write_text('{"line": 2, "label": "pos", "probabilities": {"pos": 1.0}}\n')
        return path
    if kind is paths.CONFIG_OUTPUT:
        return Path(shutil.copy(inputs.config, root / "config.yaml"))
    if kind is paths.PLOT_OUTPUT:
        path = root / "metrics.png"
        path.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(32))
        return path
    if kind is paths.DATA_OUTPUT_FILE:
        return Path(shutil.copy(bundled_vocab_path(), root / "vocab.txt"))
    if kind is paths.RANKED_OUTPUT:
        path = root / "ranked.jsonl"
        path.write_text('{"line": 1, "query": "q", "ranked": []}\n')
        return path
    if kind is paths.EMBEDDINGS_OUTPUT:
        path = root / "embeddings.jsonl"
        path.write_text('{"line": 1, "embedding": [0.5, 0.5]}\n')
        return path
    if kind is paths.TAGGED_OUTPUT:
        path = root / "tagged.conll"
        path.write_text("Paris B-LOC B-LOC\n\n")
        return path
    if kind is paths.TREC_RUN_OUTPUT:
        path = root / "run.trec"
        path.write_text("q1 Q0 d1 1 0.5 popbert\n")
        return path
    if kind is paths.HF_EXPORT_OUTPUT:
        (root / "hf").mkdir()
        (root / "hf" / "config.json").write_text("{}")
        (root / "hf" / "model.safetensors").write_bytes(inputs.safetensors.read_bytes())
        return root / "hf"
    if kind is paths.IMPORT_OUTPUT:
        run = root / "imported"
        (run / "checkpoints" / "step-000000").mkdir(parents=True)
        (run / "checkpoints" / "step-000000" / "state.json").write_text("{}")
        (run / "config.yaml").write_text(inputs.config.read_text())
        (run / "import.json").write_text("{}")
        return run
    raise AssertionError(f"no earlier output for {kind.expected}")


def test_an_earlier_output_of_the_command_is_replaced(inputs: Inputs, capsys) -> None:
    """Each output that declares what it owns accepts what its command wrote before (the
    handler is reached), while the matrix above refuses everything else there."""
    tried = 0
    for words, parser in commands():
        for dest, flag, kind in paths.declared_paths(parser):
            if kind.owns is None:
                continue
            earlier = earlier_output(kind, inputs, tried)
            reached: list[argparse.Namespace] = []
            args = parser.parse_args(argv_for(words, parser, inputs, {dest: str(earlier)}))
            capsys.readouterr()
            assert run_command(lambda a, seen=reached: seen.append(a) or 0, args) == 0, (
                words, flag, capsys.readouterr().err)
            assert reached, (words, flag)
            tried += 1
    assert tried >= 8


def test_a_companion_the_command_did_not_write_is_refused(inputs: Inputs, capsys,
                                                          tmp_path: Path) -> None:
    """`predict squad` writes nbest_predictions.json beside its output, `export` a weights file
    `<name>.data`: a user's file of that name stops the command before it starts."""
    (tmp_path / "nbest_predictions.json").write_text("my notes\n")
    (tmp_path / "model.onnx.data").write_text("my data\n")
    cases = {("predict", "squad"): ("--output", tmp_path / "predictions.json"),
             ("export",): ("--output", tmp_path / "model.onnx")}
    parsers = dict(commands())
    for words, (flag, output) in cases.items():
        parser = parsers[words]
        dest = next(d for d, f, _ in paths.declared_paths(parser) if f == flag)
        argv = argv_for(words, parser, inputs, {dest: str(output)})
        status, err = run_cell(words, parser, argv, capsys, None)
        assert status == 2 and "this command did not write and would replace" in err, err
    assert (tmp_path / "nbest_predictions.json").read_text() == "my notes\n"


def test_an_output_directory_never_holds_an_input(inputs: Inputs, capsys) -> None:
    """Each output directory given the folder that holds one of the command's inputs: refused
    (an `--overwrite` or a replace there would delete it); a run's own directory stays where
    `--resume` continues it (`test_a_run_resumes_in_its_own_directory`)."""
    tried = 0
    for words, parser in commands():
        declared = paths.declared_paths(parser)
        outputs = [(d, f, k) for d, f, k in declared if k.output and k.directory is True]
        sources = [(d, f, k) for d, f, k in declared if not k.output and f != "--resume"]
        for out_dest, out_flag, _ in outputs:
            for in_dest, _, in_kind in sources:
                value = inputs.valid(in_kind, 0)
                if not Path(value).exists():
                    continue  # a preset name
                parent = str(Path(value).parent)
                argv = argv_for(words, parser, inputs, {in_dest: value, out_dest: parent})
                status, err = run_cell(words, parser, argv, capsys, None)
                # All stand-ins share one folder: the line names the first input it holds.
                assert status == 2 and f"{out_flag} {parent}: holds this command's " in err, \
                    (argv, err)
                tried += 1
    assert tried >= 10


def test_every_path_option_is_declared() -> None:
    """An option whose metavar or name says it is a path is declared with its kind."""
    for words, parser in commands():
        for action in parser._actions:
            looks = any(s in (action.metavar or "") for s in ("FILE", "DIR", "GLOB", "DUMP",
                                                               ".txt", ".json", ".yaml"))
            if looks and (*words, action.dest) not in NOT_PATHS:
                assert isinstance(action.type, PathKind), (words, action.dest)


@pytest.mark.parametrize("key", sorted(CONFIG_PATHS))
def test_config_keys_that_name_paths(key: str, inputs: Inputs, tmp_path: Path, capsys,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The same cells for the config keys, through `popbert pretrain --set` (finetune's
    checkpoint through `finetune classify`): refused before the run directory is claimed."""
    from popbert.cli.main import main
    from popbert.io import run_dir

    def claimed(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{key}: accepted; the run started")

    monkeypatch.setattr(run_dir, "claim_run_dir", claimed)
    kind = CONFIG_PATHS[key]
    listed = key in ("data.input_files", "data.validation_files")
    out = tmp_path / "out"
    for cell, value in inputs.cells(kind, SUFFIX.get(kind, ".txt")):
        setting = f"{key}={json.dumps([value]) if listed else json.dumps(value)}"
        if key.startswith("finetune."):
            argv = ["finetune", "classify", "--checkpoint", str(inputs.checkpoint), "--train",
                    str(inputs.rows), "-o", str(out), "--set", setting]
        else:
            argv = ["pretrain", "--set", setting, "-o", str(out)]
        before = snapshot(inputs.root)
        capsys.readouterr()
        status = main(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert status == 2 and len(err) == 1, (cell, err)
        assert_refused(err[0], key, value)
        assert not out.exists() and snapshot(inputs.root) == before, cell


def test_the_docs_name_every_checked_path() -> None:
    """docs/checks.md's table has a row for each command naming each of its path flags."""
    rows = [line for line in (Path(__file__).parents[2] / "docs" / "checks.md").read_text()
            .splitlines() if line.startswith("| `")]
    for words, parser in commands():
        if words[0].startswith("examples/"):
            continue
        names = (f"`popbert {' '.join(words)}`", f"`{' '.join(words)}`")
        row = next((r for r in rows if any(n in r.split(" | ")[0] for n in names)), None)
        assert row is not None, f"docs/checks.md: no row for popbert {' '.join(words)}"
        for _, flag, _ in paths.declared_paths(parser):
            assert f"`{flag}`" in row, f"docs/checks.md: {' '.join(words)} lacks {flag}"


def test_a_run_resumes_in_its_own_directory(inputs: Inputs) -> None:
    """An output directory that is also an input (`--resume RUN -o RUN`) is where the run goes
    on, not an input overwritten: only output files are held against the inputs."""
    parser = dict(commands())[("pretrain",)]
    args = parser.parse_args(["--resume", str(inputs.checkpoint), "-o", str(inputs.checkpoint)])
    paths.check_arguments(args, paths.declared_paths(parser))
