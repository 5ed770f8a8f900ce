"""A glob names files only, in every command and config key that takes one.

A glob whose matches include a directory used to pass the path checks and fail mid-stage in a
61-line IsADirectoryError, leaving a stage directory behind. Now every such flag and key is
refused in one line naming it and the directory, with exit status 2, before any output exists;
the same holds for a remote glob (`memory://`, fsspec's in-process store, standing in for
`s3://`), for the library's own expansion, and for a stage directory holding a directory under
a part's name. The commands are found by walking the parser, so a new glob option joins.
"""

from __future__ import annotations

from pathlib import Path

import fsspec
import pytest

from popbert.cli.main import build_parser, main
from popbert.data import expand_input_files, storage
from popbert.data.errors import DataError
from popbert.data.tokenization import bundled_vocab_path
from popbert.io import paths

INSTANCE_ARGS = ["--sequence-length", "32", "--max-predictions", "5"]
# Each glob-taking flag, as a user runs it: the command words, the flag, the other arguments.
COMMANDS = {
    ("prepare-data", "sentences"): ("--input", ["--format", "lines"]),
    ("prepare-data", "vocab"): ("--input", []),
    ("prepare-data", "instances"): ("--input", ["--vocab", str(bundled_vocab_path()),
                                                *INSTANCE_ARGS]),
    ("prepare-data", "pack"): ("--input", []),
}
KEYS = ("data.input_files", "data.validation_files")


def glob_options() -> set[tuple[tuple[str, ...], str]]:
    found = set()
    for words, parser in paths.subparsers(build_parser()):
        if parser.get_default("handler") is None:
            continue
        found |= {(words, flag) for _, flag, kind in paths.declared_paths(parser) if kind.globs}
    return found


def test_every_glob_option_and_key_is_covered():
    assert glob_options() == {(words, flag) for words, (flag, _) in COMMANDS.items()}
    assert {key for key, kind in paths.CONFIG_PATHS.items() if kind.globs} == set(KEYS)


@pytest.fixture
def mixed(tmp_path: Path) -> Path:
    """A folder with a text file and a directory whose name a glob for text files matches."""
    folder = tmp_path / "corpus"
    (folder / "more.txt").mkdir(parents=True)
    (folder / "a.txt").write_text("One sentence here. Another one.\n\nA second doc. Yes.\n")
    return folder


def one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("words", list(COMMANDS), ids=" ".join)
def test_a_glob_matching_a_directory_is_refused_before_any_output(words, mixed, tmp_path,
                                                                  capsys):
    flag, extra = COMMANDS[words]
    out = tmp_path / "out" / "stage"
    output = ["--output", str(tmp_path / "out" / "vocab.txt")] if words[-1] == "vocab" \
        else ["-o", str(out)]
    assert main([*words, flag, str(mixed / "*.txt"), *output, *extra]) == 2
    line = one_line(capsys)
    assert f"{flag} {mixed / '*.txt'}: matches the directory {mixed / 'more.txt'}" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("key", KEYS)
def test_a_config_glob_matching_a_directory_is_refused_before_the_run(key, mixed, tmp_path,
                                                                      capsys):
    run = tmp_path / "run"
    assert main(["pretrain", "-o", str(run), "--set", f"{key}=['{mixed}/*.txt']"]) == 2
    line = one_line(capsys)
    assert f"{key} {mixed}/*.txt: matches the directory {mixed / 'more.txt'}" in line
    assert not run.exists()


def test_the_library_expansion_refuses_a_directory_too(mixed):
    with pytest.raises(DataError, match="matches the directory .*more.txt; a glob must match"):
        expand_input_files(str(mixed / "*.txt"))
    with pytest.raises(DataError, match="a directory, not a file"):
        expand_input_files(str(mixed / "more.txt"))
    assert expand_input_files(str(mixed / "a*.txt")) == [mixed / "a.txt"]


@pytest.fixture
def memory_store():
    fs = fsspec.filesystem("memory")
    root = "/globs-test"
    fs.pipe_file(f"{root}/corpus/a.txt", b"One sentence here. Another one.\n")
    fs.pipe_file(f"{root}/corpus/more.txt/inner.txt", b"x\n")
    fs.pipe_file(f"{root}/stage/part-00000.txt", b"x\n")
    fs.pipe_file(f"{root}/stage/part-00001.txt/inner", b"x\n")
    yield f"memory://{root}"
    fs.rm(root, recursive=True)


def test_a_remote_glob_matching_a_prefix_is_refused(memory_store, tmp_path, capsys):
    pattern = f"{memory_store}/corpus/*.txt"
    with pytest.raises(DataError, match="matches the directory memory://.*more.txt"):
        storage.expand(pattern)
    assert storage.expand(f"{memory_store}/corpus/a*.txt") == [f"{memory_store}/corpus/a.txt"]
    out = tmp_path / "sentences"
    assert main(["prepare-data", "sentences", "--input", pattern, "--format", "lines",
                 "-o", str(out)]) == 2
    assert "--input: " in one_line(capsys) and not out.exists()


def test_a_stage_directory_holding_a_directory_under_a_parts_name_is_refused(
        memory_store, tmp_path, capsys):
    stage = tmp_path / "stage"
    (stage / "part-00001.txt").mkdir(parents=True)
    (stage / "part-00000.txt").write_text("One sentence here.\n")
    for where in (stage, f"{memory_store}/stage"):
        with pytest.raises(DataError, match="part-00001.txt: a directory where"):
            storage.list_parts(storage.location(str(where)), "part-*.txt")
        out = tmp_path / "instances"
        assert main(["prepare-data", "instances", "--input", str(where), "--vocab",
                     str(bundled_vocab_path()), "-o", str(out), *INSTANCE_ARGS]) == 2
        line = one_line(capsys)
        assert line.startswith("popbert: error: --input: ") and "part-00001.txt" in line
        assert not out.exists()
