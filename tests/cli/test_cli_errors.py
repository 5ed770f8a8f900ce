"""The `popbert` CLI: user errors are one stderr line and exit 2; commands reach the library."""

from __future__ import annotations

import subprocess
import sys
import types
from pathlib import Path

import pytest

from popbert.cli import main as cli
from popbert.config import load_config
from popbert.errors import CheckpointError


def run_cli(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "popbert", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=cwd,
    )


def assert_one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("popbert: error: ")
    for fragment in fragments:
        assert fragment in lines[0]
    return lines[0]


# ---------------------------------------------------------------------------------------------
# Through `python -m popbert`


def test_unknown_config_key(tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("optimizer:\n  lrr: 0.1\n")
    proc = run_cli("pretrain", "--config", str(path), "--output-dir", str(tmp_path / "run"))
    assert_one_line_error(proc, str(path), "unknown key optimizer.lrr", "valid keys:")
    assert not (tmp_path / "run").exists()


def test_wrong_type_override() -> None:
    proc = run_cli("pretrain", "--set", "optimizer.lr=abc")
    line = assert_one_line_error(proc)
    assert line == (
        "popbert: error: --set optimizer.lr=abc: optimizer.lr: expected float, got 'abc'"
    )


def test_bad_override_syntax() -> None:
    assert_one_line_error(
        run_cli("pretrain", "--set", "optimizer.lr"), "expected section.key=value"
    )


def test_missing_config_file(tmp_path: Path) -> None:
    assert_one_line_error(
        run_cli("pretrain", "--config", str(tmp_path / "missing.yaml")),
        "--config", "missing.yaml: not found, nor a preset",
    )


def test_bad_enum_and_batch_mismatch_via_example(tmp_path: Path) -> None:
    assert_one_line_error(
        run_cli("config", "--set", "execution.device=tpu"),
        "execution.device: expected one of cpu, cuda, auto, cuda:N, got 'tpu'",
    )
    example = Path(__file__).resolve().parents[2] / "examples" / "pretrain.py"
    proc = subprocess.run(
        [
            sys.executable,
            str(example),
            "--config",
            "base-128",
            "--set",
            "execution.micro_batch_size=48",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert_one_line_error(proc, "training.global_batch_size (65536) is not divisible")


def test_missing_checkpoint_directories(tmp_path: Path) -> None:
    assert_one_line_error(
        run_cli("pretrain", "--resume", str(tmp_path / "none")), "--resume", "none: not found"
    )
    assert_one_line_error(
        run_cli("pretrain", "--init-from", str(tmp_path / "none")),
        "--init-from", "none: not found; expected a checkpoint or run directory"
    )
    assert_one_line_error(
        run_cli(
            "export",
            "--checkpoint",
            str(tmp_path / "none"),
            "--task",
            "encoder",
            "--output",
            str(tmp_path / "m.onnx"),
        ),
        "--checkpoint", "none: not found",
    )


def test_plot_missing_metrics(tmp_path: Path) -> None:
    assert_one_line_error(
        run_cli("plot", str(tmp_path / "metrics.jsonl")), "metrics.jsonl: not found"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["pretrain", "--no-such-flag"],
        ["export", "--checkpoint", "x", "--task", "classify", "--output", "y.onnx"],
        ["pretrain", "--resume", "a", "--init-from", "b"],
        ["frobnicate"],
        [],
    ],
)
def test_usage_errors_exit_2(args: list[str]) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert "usage: popbert" in proc.stderr


def test_config_command_prints_resolved_yaml(tmp_path: Path) -> None:
    proc = run_cli("config", "--config", "tiny", "--set", "training.steps=7")
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "resolved.yaml"
    out.write_text(proc.stdout)
    assert load_config(out) == load_config("tiny", ["training.steps=7"])


# ---------------------------------------------------------------------------------------------
# In-process main(): wiring to the lead's modules (stand-ins here)


def fake_module(monkeypatch: pytest.MonkeyPatch, name: str, **attrs: object) -> None:
    module = types.ModuleType(name)
    for key, value in attrs.items():
        setattr(module, key, value)
    monkeypatch.setitem(sys.modules, name, module)


def fake_trainer(monkeypatch: pytest.MonkeyPatch, run) -> None:
    """Stand in for `popbert.train.trainer`: `Trainer.from_config(cfg, output_dir, **kw)` calls
    `run(cfg, output_dir=..., **kw)` (which may raise) and hands back a run that trains nothing."""

    class Trainer:
        replicas = None  # one process (what `popbert pretrain` hands popbert.distributed)

        def __init__(self, output_dir: object) -> None:
            self.output_dir = output_dir

        @classmethod
        def from_config(cls, cfg: object, output_dir: object = None, **kw: object) -> Trainer:
            run(cfg, output_dir=output_dir, **kw)
            return cls(output_dir)

        def __enter__(self) -> Trainer:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def train(self) -> None:
            return None

    fake_module(monkeypatch, "popbert.train.trainer", Trainer=Trainer)


def test_pretrain_calls_the_trainer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_logging: None
) -> None:
    calls = []
    fake_trainer(monkeypatch, lambda cfg, **kw: calls.append((cfg, kw)))
    init = tmp_path / "phase1"
    init.mkdir()
    (init / "state.json").write_text("{}")  # a checkpoint, as far as the flag's check looks
    rc = cli.main(
        [
            "pretrain",
            "-c",
            "base-384",
            "--set",
            "training.steps=3",
            "--output-dir",
            str(tmp_path / "out"),
            "--init-from",
            str(init),
        ]
    )
    assert rc == 0
    ((cfg, kw),) = calls
    assert cfg == load_config("base-384", ["training.steps=3"])
    assert kw == {"output_dir": tmp_path / "out", "resume": None, "init_from": init,
                  "overwrite": False}


def test_pretrain_defaults(monkeypatch: pytest.MonkeyPatch, cli_logging: None) -> None:
    calls = []
    fake_trainer(monkeypatch, lambda cfg, **kw: calls.append((cfg, kw)))
    assert cli.main(["pretrain"]) == 0
    ((cfg, kw),) = calls
    assert cfg == load_config("tiny")
    assert kw["output_dir"].parent == Path("runs")
    assert kw["output_dir"].name.startswith("pretrain-")
    assert kw["resume"] is None and kw["init_from"] is None


def test_resume_without_config_uses_the_runs_config(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_logging: None
) -> None:
    from popbert.atomic import atomic_write_text
    from popbert.config import dump_config

    calls = []
    fake_trainer(monkeypatch, lambda cfg, **kw: calls.append((cfg, kw)))
    ckpt = tmp_path / "ckpt"
    saved = load_config("tiny", ["training.steps=11"])
    atomic_write_text(ckpt / "config.yaml", dump_config(saved))
    (ckpt / "state.json").write_text("{}")
    assert cli.main(["pretrain", "--resume", str(ckpt), "-o", str(tmp_path)]) == 0
    assert calls[0][0] == saved and calls[0][1]["resume"] == ckpt


def test_export_calls_export_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cli_logging: None
) -> None:
    calls = []

    def export_checkpoint(checkpoint: Path, task: str, output: Path) -> Path:
        calls.append((checkpoint, task, output))
        return output

    fake_module(monkeypatch, "popbert.export.inference", export_checkpoint=export_checkpoint)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "state.json").write_text("{}")
    rc = cli.main(
        [
            "export",
            "--checkpoint",
            str(tmp_path / "ckpt"),
            "--task",
            "pretraining",
            "--output",
            str(tmp_path / "m.onnx"),
        ]
    )
    assert rc == 0
    assert calls == [(tmp_path / "ckpt", "pretraining", tmp_path / "m.onnx")]


def test_library_errors_become_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], cli_logging: None
) -> None:
    class DataError(ValueError):
        pass

    fake_module(monkeypatch, "popbert.data.errors", DataError=DataError)

    def failing(cfg: object, **kw: object) -> None:
        raise DataError("shard a.hdf5: sequence length 512\ndoes not match model (128)")

    fake_trainer(monkeypatch, failing)
    assert cli.main(["pretrain"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["popbert: error: shard a.hdf5: sequence length 512 does not match model (128)"]

    def bad_checkpoint(cfg: object, **kw: object) -> None:
        raise CheckpointError("checkpoint x: missing weights.safetensors")

    fake_trainer(monkeypatch, bad_checkpoint)
    assert cli.main(["pretrain"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "popbert: error: checkpoint x: missing weights.safetensors"
    ]


@pytest.mark.parametrize("failure", [
    MemoryError("Unable to allocate 95.4 GiB for an array with shape (128, 100000000)"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate "
                 "memory: you tried to allocate 102400000000 bytes. Error code 12"),
], ids=["numpy", "torch-cpu"])
def test_an_allocation_too_large_for_the_machine_is_one_line(
    failure: Exception, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
    cli_logging: None
) -> None:
    """The sizes come from the config (model.*, the batch, the data): what to change, in one
    line, exit 2."""
    def out_of_memory(cfg: object, **kw: object) -> None:
        raise failure

    fake_trainer(monkeypatch, out_of_memory)
    assert cli.main(["pretrain"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("popbert: error: out of memory (") and "popbert plan" in line
    assert str(failure).split(" for ")[0][:40] in line


def test_a_cuda_out_of_memory_is_one_line(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str],
                                          cli_logging: None) -> None:
    import torch

    def out_of_memory(cfg: object, **kw: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    fake_trainer(monkeypatch, out_of_memory)
    assert cli.main(["pretrain"]) == 2
    assert "out of memory (CUDA out of memory" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["predict", "classify"], ["predict", "embed"],
                                     ["predict", "ner"], ["predict", "squad"],
                                     ["predict", "rerank"], ["serve"], ["finetune", "classify"]])
@pytest.mark.parametrize("threads", ["0", "-5", "100000"])
def test_threads_past_any_machine_are_refused(command: list[str], threads: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    """Not a runtime's default (0 and below), nor a typo's 100000 threads (which ONNX Runtime
    or torch would try to start): one line, before any file is read or written."""
    given = {"predict": ["--model", "model.onnx", "--data", "data.txt", "-o", "out.jsonl"],
             "serve": ["--model", "model.onnx"],
             "finetune": ["--checkpoint", "run", "--train", "data.txt", "-o", "out"]}
    argv = [*command, *(str(tmp_path / a) if "." in a or a in ("run", "out") else a
                        for a in given[command[0]]), "--threads", threads]
    assert cli.main(argv) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == f"popbert: error: --threads must be from 1 to 1024, got {threads}"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["import-hf", "--model", "hf", "-o", "out"],
                                     ["finetune", "classify", "--checkpoint", "run", "--train",
                                      "data.txt", "-o", "out"],
                                     ["prepare-data", "instances", "--input", "data.txt",
                                      "--vocab", "vocab.txt", "-o", "out", "--sequence-length",
                                      "64", "--max-predictions", "10", "--seed", "1"]])
@pytest.mark.parametrize("seed", ["-1", str(2**70)])
def test_a_seed_no_generator_takes_is_refused(command: list[str], seed: str, tmp_path: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    argv = [str(tmp_path / a) if a in ("hf", "out", "run", "data.txt", "vocab.txt") else a
            for a in command]
    if "--seed" in argv:
        argv[argv.index("--seed") + 1] = seed
    else:
        argv += ["--seed", seed]
    assert cli.main(argv) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == f"popbert: error: --seed must be from 0 to 2147483647 (2**31 - 1), got {seed}"
    assert list(tmp_path.iterdir()) == []


def test_bugs_keep_their_traceback(monkeypatch: pytest.MonkeyPatch, cli_logging: None) -> None:
    def broken(cfg: object, **kw: object) -> None:
        raise RuntimeError("a bug")

    fake_trainer(monkeypatch, broken)
    with pytest.raises(RuntimeError, match="a bug"):
        cli.main(["pretrain"])


def test_main_returns_argparse_status(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["pretrain", "--bogus"]) == 2
    assert cli.main(["--version"]) == 0
    assert "popbert" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# Bad paths and values that used to end in a traceback or be accepted (issue 20), in-process


def one_line_error(capsys: pytest.CaptureFixture[str], args: list[str], *fragments: str) -> str:
    """`main(args)` exits 2 with one `popbert: error:` line holding `fragments`, and nothing
    else on stderr (no traceback, no warning)."""
    capsys.readouterr()
    assert cli.main(args) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("popbert: error: ")
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture
def binary_vocab(tmp_path: Path) -> Path:
    path = tmp_path / "vocab.bin"
    path.write_bytes(b"[PAD]\n\xb8\x00\xff\xfe binary\n")
    return path


def test_a_vocabulary_that_is_not_utf8_text(
    tmp_path: Path, binary_vocab: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    expected = "not UTF-8 text (byte 0xb8 at offset 6); expected a WordPiece vocab.txt"
    run = tmp_path / "run"
    one_line_error(capsys, ["pretrain", "--set", f"data.vocab_file={binary_vocab}", "-o",
                            str(run)], f"data.vocab_file {binary_vocab}: {expected}")
    assert not run.exists()
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("One sentence. Another one.\nA second line.\n")
    shape = ["--sequence-length", "32", "--max-predictions", "5", "-j", "1"]
    one_line_error(capsys, ["prepare-data", "instances", "--input", str(corpus), "--vocab",
                            str(binary_vocab), "-o", str(tmp_path / "inst"), *shape],
                   f"--vocab {binary_vocab}: {expected}")
    dump = tmp_path / "dump.xml.bz2"
    dump.write_bytes(b"BZh9")  # never read: the vocabulary is checked before extraction
    one_line_error(capsys, ["prepare-data", "wikipedia", "--input", str(dump), "--vocab",
                            str(binary_vocab), "-o", str(tmp_path / "wiki"), *shape],
                   f"--vocab {binary_vocab}: {expected}")
    assert not (tmp_path / "inst").exists() and not (tmp_path / "wiki").exists()
    hf = tmp_path / "hf"
    assert cli.main(["export-hf", "--checkpoint", str(pretrained_run(tmp_path / "ref")), "-o",
                     str(hf)]) == 0
    (hf / "vocab.txt").write_bytes(binary_vocab.read_bytes())
    one_line_error(capsys, ["import-hf", "--model", str(hf), "-o", str(tmp_path / "imported")],
                   f"{hf / 'vocab.txt'}: {expected}")
    assert not (tmp_path / "imported").exists()


def test_an_output_file_that_is_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    one_line_error(capsys, ["config", "-o", str(tmp_path)],
                   f"--output {tmp_path}: is a directory, not a file name; expected a new file")
    blocker = tmp_path / "file"
    blocker.write_text("Some text.\n")
    one_line_error(capsys, ["config", "-o", str(blocker / "run.yaml")],
                   f"--output {blocker / 'run.yaml'}: {blocker} is a file, not a directory")
    one_line_error(capsys, ["prepare-data", "vocab", "--input", str(blocker), "-o",
                            str(tmp_path)], f"--output {tmp_path}: is a directory, not a file")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # nothing half-written


@pytest.mark.parametrize("stage", [
    ["wikipedia", "--sequence-length", "32", "--max-predictions", "5"],
    ["extract"], ["sentences"],
    ["instances", "--vocab", "VOCAB", "--sequence-length", "32", "--max-predictions", "5"],
    ["pack"],
])
def test_prepare_data_output_dir_that_is_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], stage: list[str]
) -> None:
    from popbert.data.tokenization import bundled_vocab_path

    source = tmp_path / "input"
    source.mkdir()
    for name in ("part-00000.jsonl", "part-00000.txt", "part-00000.h5"):
        (source / name).write_text("")
    dump = tmp_path / "dump.xml.bz2"
    dump.write_bytes(b"BZh9")
    given = str(dump) if stage[0] in ("wikipedia", "extract") else str(source)
    blocker = tmp_path / "out"
    blocker.write_text("a file")
    args = [str(bundled_vocab_path()) if a == "VOCAB" else a for a in stage]
    one_line_error(capsys, ["prepare-data", *args, "--input", given, "-j", "1", "-o",
                            str(blocker)],
                   f"--output-dir {blocker}: is a text file, not a directory")
    assert blocker.read_text() == "a file"


GRID_SWEEP = """\
job: pretrain
set: {training.steps: 2}
method: grid
metric: {name: loss, goal: minimize}
parameters:
  optimizer.lr: {values: [1.0e-3, 3.0e-3]}
"""


def test_finetune_device_follows_the_config_rule() -> None:
    args = ["finetune", "classify", "--checkpoint", "c", "-o", "o", "--train", "t.tsv"]
    assert cli.build_parser().parse_args([*args, "--device", "cuda:1"]).device == "cuda:1"
    assert cli.main([*args, "--device", "tpu"]) == 2


def test_sweep_agents_refuse_a_device_the_config_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    spec = tmp_path / "lr.yaml"
    spec.write_text(GRID_SWEEP)
    sweep = tmp_path / "sweep"
    assert cli.main(["sweep", "create", str(spec), "-o", str(sweep)]) == 0
    one_line_error(capsys, ["sweep", "agent", str(sweep), "--device", "tpu"],
                   "--device: expected one of cpu, cuda, auto, cuda:N, got 'tpu'")
    one_line_error(capsys, ["sweep", "agent", str(sweep), "--device", "cuda:99"],
                   "--device: this machine has no device 'cuda:99' (available: ")
    assert not (sweep / "trials").exists()  # no trial was spent on them
    one_line_error(capsys, ["sweep", "run", str(spec), "-o", str(tmp_path / "run"),
                            "--devices", "cpu,tpu"],
                   "--devices: expected one of cpu, cuda, auto, cuda:N, got 'tpu'")
    assert not (tmp_path / "run").exists()


def pretrained_run(directory: Path, vocab_file: str | None = None) -> Path:
    """A pre-training run directory as `popbert pretrain --set training.steps=20` leaves it:
    its stored config warms up longer (30 steps) than it trains."""
    from checkpoint_helpers import random_task_run

    cfg = load_config("tiny", ["training.steps=20", "model.num_layers=1",
                               "model.hidden_size=32", "model.num_heads=2",
                               "model.intermediate_size=64", "model.sequence_length=32",
                               "model.max_position_embeddings=64"])
    cfg.data.vocab_file = vocab_file
    random_task_run(directory, cfg, "pretraining", seed=3, step=20)
    return directory


def test_no_warning_from_a_config_that_is_not_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A checkpoint's stored config (export, export-hf, fine-tuning from it), a sweep's trial
    configs checked at creation (each warned once per value checked): none of them runs."""
    run = pretrained_run(tmp_path / "ref")
    assert cli.main(["export", "--checkpoint", str(run), "--task", "encoder", "--output",
                     str(tmp_path / "encoder.onnx")]) == 0
    assert cli.main(["export-hf", "--checkpoint", str(run), "-o", str(tmp_path / "hf")]) == 0
    from popbert.train.finetune import load_pretrained

    load_pretrained(run)  # what `popbert finetune` reads first (training it here costs seconds)
    spec = tmp_path / "lr.yaml"
    spec.write_text(GRID_SWEEP)  # training.steps 2, under the tiny preset's 30 warmup steps
    assert cli.main(["sweep", "create", str(spec), "-o", str(tmp_path / "sweep")]) == 0
    assert " W " not in capsys.readouterr().err
    # The running config's own warnings stay.
    assert cli.main(["config", "--set", "training.steps=2"]) == 0
    assert "optimizer.warmup_steps (30) exceeds training.steps (2)" in capsys.readouterr().err


def test_exporting_a_pretrained_run_for_a_task(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from popbert.data.tokenization import bundled_vocab_path

    run = pretrained_run(tmp_path / "ref")
    # Its model has no SQuAD head: that is the one line, not a warning about its vocabulary
    # (it was trained on the bundled one).
    one_line_error(capsys, ["export", "--checkpoint", str(run), "--task", "squad", "--output",
                            str(tmp_path / "squad.onnx")],
                   "the checkpoint has no weights for the squad graph's")
    assert cli.main(["export-hf", "--checkpoint", str(run), "-o", str(tmp_path / "hf")]) == 0
    assert (tmp_path / "hf" / "vocab.txt").read_bytes() == bundled_vocab_path().read_bytes()
    assert " W " not in capsys.readouterr().err
    # A vocabulary that is gone is named.
    gone = pretrained_run(tmp_path / "gone", vocab_file=str(tmp_path / "moved" / "vocab.txt"))
    assert cli.main(["export-hf", "--checkpoint", str(gone), "-o", str(tmp_path / "hf2")]) == 0
    err = capsys.readouterr().err
    assert f"its vocabulary {tmp_path / 'moved' / 'vocab.txt'} is gone" in err
    assert not (tmp_path / "hf2" / "vocab.txt").exists()
