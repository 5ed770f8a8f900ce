"""Every file a command writes is whole or not there: a disk that fills up after the first row
of each writer leaves the previous state (the old file, or nothing) and no temporary file, and
the command says so in one line naming the output.

All of popbert's writes go through three doors, so the fault is injected there:
`popbert.atomic._create` (every file `atomic_write_bytes` makes: configs, plots, predictions,
exports, vocabularies, stage records) writes the data's first line and then fails with ENOSPC;
`atomic_directory` (Hugging Face directories, checkpoints) fails once its files are written;
`popbert.data.storage.publish` (data stages' parts and shards, written in full under a
temporary name) fails at its rename. Checkpoints and metrics have their own full-disk tests
(tests/train/test_run_faults.py).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from checkpoint_helpers import random_task_run

from popbert import atomic
from popbert.cli.main import main
from popbert.config import TaskConfig, load_config
from popbert.data.tokenization import bundled_corpus_path, bundled_vocab_path
from popbert.export import inference as export

FIXTURES = Path(__file__).parent.parent / "fixtures"
SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=32",
         "model.max_position_embeddings=64", "model.max_predictions_per_seq=5"]
PREVIOUS = b"the previous output\n"


def full_disk(path: object) -> OSError:
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


@pytest.fixture
def disk_full_after_first_row(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Install the fault; returns the temporary files it saw being written."""
    seen: list[Path] = []
    real_create = atomic._create

    def create(path: Path, data: bytes) -> None:
        if "_stage.json" in Path(path).name:  # a data stage's record: let it through, so the
            return real_create(path, data)   # stage goes on to write (and publish) its parts
        seen.append(Path(path))
        real_create(path, data.split(b"\n", 1)[0] + b"\n")  # the first row reaches the disk
        raise full_disk(path)

    real_replace = os.replace

    def replace(source: os.PathLike, destination: os.PathLike) -> None:
        if ".tmp-" not in Path(source).name or "_stage.json" in Path(source).name:
            return real_replace(source, destination)
        seen.append(Path(source))  # a data stage's part or shard, whole under its temporary
        assert Path(source).stat().st_size > 0  # name: the disk fills as it is published
        raise full_disk(destination)

    def fsync_tree(root: Path) -> None:  # a directory's files were written; its last fails
        seen.append(Path(root))
        assert any(Path(root).iterdir())
        raise full_disk(root)

    monkeypatch.setattr(atomic, "_create", create)
    monkeypatch.setattr(atomic, "_fsync_tree", fsync_tree)
    monkeypatch.setattr(os, "replace", replace)
    return seen


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Inputs for the commands, made before any fault is installed."""
    root = tmp_path_factory.mktemp("writers")
    made = {}
    for task, labels in (("classification", ["0", "1"]), ("squad", None)):
        cfg = load_config("tiny", SMALL)
        cfg.model.task = (TaskConfig(name=task, lowercase=True, num_labels=2, labels=labels)
                          if labels else TaskConfig(name=task, lowercase=True, doc_stride=8,
                                                    max_query_length=12))
        cfg.data.vocab_file = str(bundled_vocab_path())
        random_task_run(root / task, cfg, task, seed=1)
        made[task] = export.export_checkpoint(root / task, task, root / f"{task}.onnx")
    pretraining = root / "pretraining"
    random_task_run(pretraining, load_config("tiny", SMALL), "pretraining", seed=2)
    (pretraining / "metrics.jsonl").write_text('{"step": 1, "loss": 9.0}\n'
                                               '{"step": 2, "loss": 8.0}\n')
    made["pretraining"] = pretraining
    assert main(["export-hf", "--checkpoint", str(pretraining), "-o", str(root / "hf")]) == 0
    made["hf"] = root / "hf"
    corpus = root / "corpus.txt"
    corpus.write_text("\n".join(bundled_corpus_path().read_text().splitlines()[:400]) + "\n")
    made["corpus"] = corpus
    assert main(["prepare-data", "instances", "--input", str(corpus), "--vocab",
                 str(bundled_vocab_path()), "-o", str(root / "instances"), "-j", "1",
                 "--sequence-length", "32", "--max-predictions", "5", "--dupe-factor", "1"]) == 0
    made["instances"] = root / "instances"
    return made


# name: (command line given the inputs and the output, whether the output is a directory)
COMMANDS: dict[str, tuple[Callable[[dict[str, Path], Path], list[str]], bool]] = {
    "config": (lambda m, out: ["config", "-o", str(out)], False),
    "plot": (lambda m, out: ["plot", str(m["pretraining"]), "-o", str(out)], False),
    "predict classify": (lambda m, out: [
        "predict", "classify", "--model", str(m["classification"]), "--data",
        str(FIXTURES / "classification" / "sentiment.tsv"), "-o", str(out)], False),
    "predict squad": (lambda m, out: [
        "predict", "squad", "--model", str(m["squad"]), "--data",
        str(FIXTURES / "squad" / "squad-v1.1-sample.json"), "-o", str(out)], False),
    "export": (lambda m, out: ["export", "--checkpoint", str(m["pretraining"]), "--task",
                               "encoder", "--output", str(out)], False),
    "export-hf": (lambda m, out: ["export-hf", "--checkpoint", str(m["pretraining"]), "-o",
                                  str(out)], True),
    "import-hf": (lambda m, out: ["import-hf", "--model", str(m["hf"]), "-o", str(out)], True),
    "prepare-data vocab": (lambda m, out: ["prepare-data", "vocab", "--input", str(m["corpus"]),
                                           "-o", str(out), "--vocab-size", "200"], False),
    "prepare-data sentences": (lambda m, out: [
        "prepare-data", "sentences", "--input", str(m["corpus"]), "-o", str(out), "-j", "1",
        "--format", "lines", "--min-sentences", "1"], True),
    "prepare-data instances": (lambda m, out: [
        "prepare-data", "instances", "--input", str(m["corpus"]), "--vocab",
        str(bundled_vocab_path()), "-o", str(out), "-j", "1", "--sequence-length", "32",
        "--max-predictions", "5", "--dupe-factor", "1"], True),
    "prepare-data pack": (lambda m, out: [
        "prepare-data", "pack", "--input", str(m["instances"]), "-o", str(out), "-j", "1"],
        True),
}


def earlier_output(name: str, made: dict[str, Path]) -> bytes:
    """What an earlier run of the command `name` left at its output file, in small."""
    if name == "config":
        import popbert.config

        return (Path(popbert.config.__file__).parent / "presets" / "tiny.yaml").read_bytes()
    if name == "export":
        return made["classification"].read_bytes()
    if name == "plot":
        return b"\x89PNG\r\n\x1a\n" + PREVIOUS
    if name == "predict classify":
        return b'{"line": 2, "label": "1", "probabilities": {"1": 1.0}}\n'
    if name == "predict squad":
        return b'{"q1": "an answer"}'
    return PREVIOUS


def listing(directory: Path) -> dict[str, bytes]:
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file()}


@pytest.mark.e2e
@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_a_full_disk_after_the_first_row_leaves_the_previous_state(
        name: str, made: dict[str, Path], tmp_path: Path, disk_full_after_first_row: list[Path],
        capsys: pytest.CaptureFixture[str]) -> None:
    command, is_directory = COMMANDS[name]
    suffix = {"plot": ".png", "export": ".onnx", "predict squad": ".json",
              "predict classify": ".jsonl", "config": ".yaml", "prepare-data vocab": ".txt"}
    out = tmp_path / ("out" if is_directory else f"out{suffix[name]}")
    previous = earlier_output(name, made)
    if not is_directory:
        out.write_bytes(previous)  # the previous state: an earlier output (only that is replaced)
    before = listing(tmp_path)
    capsys.readouterr()
    assert main(command(made, out)) == 2, name
    err = [line for line in capsys.readouterr().err.splitlines()
           if line.startswith("popbert")]
    assert len(err) == 1 and "No space left on device" in err[0], err
    assert disk_full_after_first_row, f"{name}: the write never reached the fault"
    leftovers = [p for p in tmp_path.rglob("*") if ".tmp-" in p.name]
    assert not leftovers, leftovers  # no temporary file stays behind
    if name.startswith("prepare-data") and is_directory:  # a stage: its record, no part
        assert {str(Path(p).parent) for p in listing(tmp_path)} - {".", "out"} == set()
        assert not any(out.glob("part-*")), sorted(listing(out))
    else:
        assert listing(tmp_path) == before, f"{name}: left {sorted(listing(tmp_path))}"
    if not is_directory:
        assert out.read_bytes() == previous
