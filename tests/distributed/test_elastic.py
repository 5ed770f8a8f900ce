"""`popbert pretrain` under torchrun beyond one plain launch: elastic restarts after a worker is
killed, and two "machines" (two torchrun launches with a c10d rendezvous) on one host.

Each compares with one uninterrupted 2-replica `torchrun --nproc-per-node 2` run (the module's
`reference`) of the same config and global batch: final weights bit for bit, logged losses
exactly, one metrics record per step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from replica_helpers import free_port
from test_distributed import cli_env, config, overrides

STEPS = 40
EVERY = 10  # checkpoint cadence
TORCHRUN = str(Path(sys.executable).with_name("torchrun"))


def pretrain_args(output: Path, every: int = EVERY) -> list[str]:
    args = ["-m", "popbert", "pretrain", "--output-dir", str(output)]
    for item in overrides(execution__replicas=2, execution__gradient_accumulation=2,
                          training__steps=STEPS, training__checkpoint_every=every,
                          training__log_every=1):
        args += ["--set", item]
    return args


def torchrun(*launcher: str, output: Path, log: Path, every: int = EVERY) -> subprocess.Popen:
    command = [TORCHRUN, "--rdzv-backend", "c10d", *launcher, *pretrain_args(output, every)]
    with log.open("w") as stream:
        return subprocess.Popen(command, env=cli_env(), stdout=stream, stderr=subprocess.STDOUT)


def finish(process: subprocess.Popen, log: Path, timeout: float = 120) -> str:
    try:
        process.wait(timeout=timeout)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    text = log.read_text()
    assert process.returncode == 0, text[-3000:]
    return text


def final_weights(run: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(run / "checkpoints" / f"step-{STEPS:06d}" /
                                           "weights.safetensors"))


def records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def assert_same_run(ours: Path, reference: Path) -> None:
    """Bit-identical final weights, the same losses, one record per step."""
    a, b = final_weights(ours), final_weights(reference)
    assert a.keys() == b.keys()
    different = [k for k in a if not np.array_equal(a[k], b[k])]
    assert not different, different[:5]
    mine, theirs = records(ours), records(reference)
    assert [r["step"] for r in mine] == list(range(1, STEPS + 1))
    assert [r["loss"] for r in mine] == [r["loss"] for r in theirs]


def workers_of(agent: int) -> dict[int, int]:
    """{RANK: pid} of the worker processes a torchrun agent started."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if int(stat.rsplit(")", 1)[1].split()[1]) != agent:
                continue
            env = dict(item.split("=", 1) for item in
                       (entry / "environ").read_bytes().decode(errors="replace").split("\0")
                       if "=" in item)
        except (OSError, ValueError, IndexError):
            continue
        if "RANK" in env:
            found[int(env["RANK"])] = int(entry.name)
    return found


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from popbert.data.pretraining import load_training_data

    load_training_data(config(1, 4))  # the instance cache, once, before the replicas read it
    out = tmp_path_factory.mktemp("elastic")
    started = time.perf_counter()
    process = torchrun("--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint",
                       f"127.0.0.1:{free_port()}", output=out / "run", log=out / "log")
    finish(process, out / "log")
    print(f"\nreference 2-replica run: {time.perf_counter() - started:.1f} s")
    return out / "run"


def kill_worker_when(agent: subprocess.Popen, log: Path, ready: Callable[[], bool],
                     rank: int = 1) -> None:
    """SIGKILL replica `rank` of a torchrun job once `ready()` (first attempt only)."""
    try:
        deadline = time.monotonic() + 90
        while not ready():
            assert agent.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never got there"
            time.sleep(0.01)
        os.kill(workers_of(agent.pid)[rank], signal.SIGKILL)
    except BaseException:
        agent.kill()
        agent.wait()
        raise


@pytest.mark.e2e
def test_a_killed_worker_is_restarted_and_the_run_resumes_by_itself(
        tmp_path: Path, reference: Path) -> None:
    """torchrun --max-restarts 1: replica 1 is SIGKILLed once the step-10 checkpoint exists;
    torchrun restarts both workers with the same command line, and the run resumes from its
    newest checkpoint (no --resume), ending bit-identical to the uninterrupted run."""
    output, log = tmp_path / "run", tmp_path / "log"
    started = time.perf_counter()
    agent = torchrun("--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
                     "--rdzv-endpoint", f"127.0.0.1:{free_port()}", output=output, log=log)
    first = output / "checkpoints" / f"step-{EVERY:06d}" / "state.json"
    kill_worker_when(agent, log, first.exists)
    text = finish(agent, log)
    print(f"killed, restarted and finished in {time.perf_counter() - started:.1f} s")
    resumed = [line for line in text.splitlines()
               if "torchrun restarted this job: resuming" in line]
    assert resumed, text[-3000:]  # the kill came before the end: a restart resumed the run
    print(resumed[0])
    step = int(resumed[0].rsplit("step-", 1)[1].split()[0])
    assert EVERY <= step < STEPS  # lost only the steps after the newest checkpoint
    assert_same_run(output, reference)
    assert json.loads((output / ".torchrun.json").read_text())["agents"]


EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "pretrain.py"


@pytest.mark.e2e
def test_the_example_without_an_output_dir_restarts_into_its_own_run(
        tmp_path: Path, reference: Path) -> None:
    """`examples/pretrain.py` under torchrun --max-restarts 1 and no --output-dir: replica 1
    is killed after the step-10 checkpoint; the restarted workers find the run directory of
    the first attempt (its `.torchrun.json` names their agent), resume it by themselves and
    end bit-identical to the uninterrupted run, leaving one run directory."""
    log = tmp_path / "log"
    command = [TORCHRUN, "--rdzv-backend", "c10d", "--nnodes", "1", "--nproc-per-node", "2",
               "--max-restarts", "1", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               str(EXAMPLE), *pretrain_args(tmp_path / "unused")[5:]]  # its --set flags only
    with log.open("w") as stream:
        agent = subprocess.Popen(command, env=cli_env(), cwd=tmp_path, stdout=stream,
                                 stderr=subprocess.STDOUT)

    def first_checkpoint() -> bool:
        return any((tmp_path / "runs").glob(f"pretrain-*/checkpoints/step-{EVERY:06d}/"
                                            "state.json"))

    kill_worker_when(agent, log, first_checkpoint)
    text = finish(agent, log)
    assert "torchrun restarted this job: resuming" in text, text[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert_same_run(run, reference)


SENTIMENT = Path(__file__).resolve().parents[1] / "fixtures" / "classification" / "sentiment.tsv"


@pytest.mark.e2e
def test_a_restarted_fine_tuning_job_starts_over_and_ends_as_an_uninterrupted_one(
        tmp_path: Path) -> None:
    """`popbert finetune classify` (one process: fine-tuning takes no replicas) under torchrun
    --max-restarts 1, its worker SIGKILLed after the first checkpoint: the restart does not
    refuse its own directory; it starts the run over there and ends with the weights of an
    uninterrupted run, bit for bit."""
    from popbert.cli.main import main

    pre = tmp_path / "pre"
    assert main(["pretrain", "-o", str(pre),
                 *[a for item in overrides(training__steps=2) for a in ("--set", item)]]) == 0

    def launch(output: Path, log: Path, *extra: str) -> subprocess.Popen:
        command = [TORCHRUN, "--rdzv-backend", "c10d", "--nnodes", "1", "--nproc-per-node",
                   "1", *extra, "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "-m", "popbert",
                   "finetune", "classify", "--checkpoint", str(pre), "--train", str(SENTIMENT),
                   "-o", str(output), "--epochs", "3", "--batch-size", "4",
                   "--max-seq-length", "32", "--lr", "1e-3", "--log-every", "1",
                   "--set", "training.checkpoint_every=5"]
        with log.open("w") as stream:
            return subprocess.Popen(command, env=cli_env(), stdout=stream,
                                    stderr=subprocess.STDOUT)

    straight, restarted = tmp_path / "straight", tmp_path / "restarted"
    finish(launch(straight, tmp_path / "log1"), tmp_path / "log1")
    agent = launch(restarted, tmp_path / "log2", "--max-restarts", "1")
    kill_worker_when(agent, tmp_path / "log2",
                     lambda: (restarted / "checkpoints" / "step-000005" / "state.json").exists(),
                     rank=0)
    text = finish(agent, tmp_path / "log2")
    assert "deleted the earlier run" in text, text[-3000:]  # its first attempt's files
    ours, theirs = (sorted((run / "checkpoints").glob("step-*"))[-1] for run in
                    (restarted, straight))
    assert ours.name == theirs.name
    a, b = (safetensors.numpy.load_file(str(c / "weights.safetensors")) for c in (ours, theirs))
    assert a.keys() == b.keys()
    assert not [k for k in a if not np.array_equal(a[k], b[k])]


@pytest.mark.e2e
def test_a_worker_killed_before_the_first_checkpoint_starts_the_run_over(
        tmp_path: Path, reference: Path) -> None:
    """No checkpoint yet (only the final one is written): the restart deletes what the first
    attempt wrote and trains from step 0, to the same end. (The directory exists beforehand,
    as one made on a shared filesystem would: a directory the run created itself is removed
    by the failed attempt when it holds no checkpoint, and the restart simply starts anew.)"""
    output, log = tmp_path / "run", tmp_path / "log"
    output.mkdir()
    agent = torchrun("--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
                     "--rdzv-endpoint", f"127.0.0.1:{free_port()}", output=output, log=log,
                     every=0)
    metrics = output / "metrics.jsonl"
    kill_worker_when(agent, log, lambda: metrics.is_file() and
                     len(metrics.read_text().splitlines()) >= 3)
    text = finish(agent, log)
    assert "torchrun restarted this job: no checkpoint of it in" in text, text[-3000:]
    assert "--overwrite: deleted the earlier run" in text
    assert_same_run(output, reference)


@pytest.mark.e2e
def test_a_restart_never_resumes_a_run_it_did_not_start(tmp_path: Path,
                                                        reference: Path) -> None:
    """A first attempt refused (the directory holds another run) makes torchrun restart the
    group; the restart is refused the same way instead of continuing that other run."""
    import shutil

    output, log = tmp_path / "run", tmp_path / "log"
    shutil.copytree(reference, output)
    (output / ".torchrun.json").unlink(missing_ok=True)
    before = (output / "metrics.jsonl").read_text()
    agent = torchrun("--nnodes", "1", "--nproc-per-node", "2", "--max-restarts", "1",
                     "--rdzv-endpoint", f"127.0.0.1:{free_port()}", output=output, log=log)
    agent.wait(timeout=120)
    text = log.read_text()
    assert agent.returncode != 0
    assert text.count("holds another run") >= 2, text[-3000:]  # both attempts refused
    assert "torchrun restarted this job: resuming" not in text
    assert (output / "metrics.jsonl").read_text() == before


@pytest.mark.e2e
def test_two_machines_on_one_host_train_like_one(tmp_path: Path, reference: Path) -> None:
    """Two `torchrun --nnodes 2 --nproc-per-node 1` launches meeting at a c10d rendezvous on
    127.0.0.1 (two "machines" sharing the run directory) train bit-identically to one launch of
    `--nproc-per-node 2` with the same global batch; only global rank 0 writes. (No
    `--node-rank`: a c10d rendezvous numbers the nodes itself and ignores it.)"""
    output, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    started = time.perf_counter()
    nodes = [torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                      "--rdzv-id", "two-machines",
                      output=output, log=tmp_path / f"node-{node}.log") for node in range(2)]
    logs = [finish(node, tmp_path / f"node-{i}.log") for i, node in enumerate(nodes)]
    print(f"\ntwo launches of one replica each: {time.perf_counter() - started:.1f} s")
    assert_same_run(output, reference)
    # Each "machine" has local rank 0; only the one with global rank 0 wrote the outputs.
    writers = [i for i, text in enumerate(logs) if "popbert.train.trainer: output:" in text]
    assert len(writers) == 1, logs
    assert "replica 0 of 2 (local rank 0)" in logs[writers[0]]
    assert "replica 1 of 2 (local rank 0)" in logs[1 - writers[0]]


@pytest.mark.e2e
def test_a_machine_whose_worker_is_killed_restarts_with_the_other(tmp_path: Path,
                                                                  reference: Path) -> None:
    """Two "machines" with --max-restarts 1; replica 1 is SIGKILLed after the step-10
    checkpoint. Only its machine's restart count goes up (torch counts per machine), yet both
    restarted workers resume the run and meet in a join of their own, ending bit-identical."""
    output, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"
    logs = [tmp_path / f"node-{node}.log" for node in range(2)]
    nodes = [torchrun("--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", endpoint,
                      "--rdzv-id", "two-machines", "--max-restarts", "1",
                      output=output, log=logs[node]) for node in range(2)]
    first = output / "checkpoints" / f"step-{EVERY:06d}" / "state.json"
    try:
        deadline = time.monotonic() + 90
        while not first.exists():
            assert all(node.poll() is None for node in nodes), logs[0].read_text()[-3000:]
            assert time.monotonic() < deadline, "the run never wrote its first checkpoint"
            time.sleep(0.01)
        victim = next(pid for node in nodes for rank, pid in workers_of(node.pid).items()
                      if rank == 1)
        os.kill(victim, signal.SIGKILL)
    except BaseException:
        for node in nodes:
            node.kill()
            node.wait()
        raise
    texts = [finish(node, log) for node, log in zip(nodes, logs, strict=True)]
    for text in texts:  # both machines' workers resumed, not only the failed one's
        assert "torchrun restarted this job: resuming" in text, text[-3000:]
        assert "holds another run" not in text
    assert_same_run(output, reference)


def test_a_restart_resumes_only_a_directory_this_job_started(tmp_path: Path, monkeypatch
                                                             ) -> None:
    """restart_plan: no torchrun, or a directory another job started, is a new run as before;
    this job's directory resumes from the newest checkpoint the job wrote, or starts over
    without one."""
    from popbert.distributed import elastic

    output = tmp_path / "run"
    (output / "checkpoints").mkdir(parents=True)
    monkeypatch.delenv(elastic.RESTART_ENV, raising=False)
    assert elastic.restart_plan(output) is None  # no torchrun
    monkeypatch.setenv(elastic.RESTART_ENV, "0")
    assert elastic.restart_plan(output) is None  # the first launch: nothing recorded yet
    (output / elastic.MARKER).write_text(json.dumps({"agents": [elastic.agent_identity()]}))
    # Recorded: a restart, even where this machine's count stayed 0 (its worker did not fail).
    assert elastic.restart_plan(output) == elastic.RestartPlan(overwrite=True)
    monkeypatch.setenv(elastic.RESTART_ENV, "2")
    assert elastic.restart_plan(output) == elastic.RestartPlan(overwrite=True)
    step = checkpoint(output, 10)
    assert elastic.restart_plan(output) == elastic.RestartPlan(resume=step)
    other = ["elsewhere", 1, 2]
    (output / elastic.MARKER).write_text(json.dumps({"agents": [other]}))
    assert elastic.restart_plan(output) is None  # another job's run: refused as before
    (output / elastic.MARKER).unlink()
    assert elastic.restart_plan(output) is None


def checkpoint(run: Path, step: int) -> Path:
    """A complete checkpoint, as far as restart_plan looks."""
    path = run / "checkpoints" / f"step-{step:06d}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "state.json").write_text(json.dumps({"step": step, "at": time.time_ns()}))
    return path


def test_a_restart_after_resuming_an_older_checkpoint_keeps_to_its_trajectory(
        tmp_path: Path, monkeypatch) -> None:
    """`--resume DIR/checkpoints/step-000010` while DIR holds steps 10, 20 (an earlier
    trajectory): a restart resumes the newest checkpoint this job wrote, or the one the first
    launch named, never the earlier trajectory's step 20, and never deletes that run."""
    from types import SimpleNamespace

    from popbert.distributed import elastic

    output = tmp_path / "run"
    ten, twenty = checkpoint(output, 10), checkpoint(output, 20)
    monkeypatch.setenv(elastic.RESTART_ENV, "0")
    monkeypatch.setenv(elastic.MAX_RESTARTS_ENV, "1")
    single = SimpleNamespace(is_main=True, all_gather_object=lambda obj: [obj])
    elastic.record_launch(single, output)  # the first launch, after from_config
    monkeypatch.setenv(elastic.RESTART_ENV, "1")
    # Killed before its first checkpoint: again from the checkpoint it was told to resume.
    assert elastic.restart_arguments(output, ten, None, False) == (ten, None, False)
    # A new run in a directory of its own (--init-from elsewhere) starts over, deleting its files.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    elastic.record_launch(single, fresh)
    assert elastic.restart_arguments(fresh, None, twenty, False) == (None, twenty, True)
    # It wrote step 15, then rewrote step 20: the newest of its own is step 20.
    fifteen = checkpoint(output, 15)
    assert elastic.restart_arguments(output, ten, None, False) == (fifteen, None, False)
    time.sleep(0.01)
    checkpoint(output, 20)
    elastic.record_launch(single, output)  # the restarted launch keeps the first one's list
    assert elastic.restart_arguments(output, ten, None, False) == (twenty, None, False)


def test_a_restarted_job_finds_its_run_directory_and_fine_tuning_starts_over(
        tmp_path: Path, monkeypatch) -> None:
    """Given no output directory, a restart finds the one its first attempt used (the
    directory whose marker names its agent, not another job's or a newer run's); a job that
    does not resume (fine-tuning) starts over in it, deleting the first attempt's files."""
    from types import SimpleNamespace

    from popbert.distributed import elastic
    from popbert.io.run_dir import default_run_dir

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(elastic.RESTART_ENV, "0")
    monkeypatch.setenv(elastic.MAX_RESTARTS_ENV, "1")
    single = SimpleNamespace(is_main=True, all_gather_object=lambda obj: [obj])
    first = default_run_dir("finetune-squad")
    assert first.parent == Path("runs") and first.name.startswith("finetune-squad-")
    first.mkdir(parents=True)
    elastic.record_launch(single, first)
    checkpoint(first, 10)  # written by the first attempt
    other = Path("runs") / "finetune-squad-29991231-235959"  # newer, another job's
    other.mkdir(parents=True)
    (other / elastic.MARKER).write_text(json.dumps({"agents": [["elsewhere", 1, 2]]}))
    monkeypatch.setenv(elastic.RESTART_ENV, "1")
    assert default_run_dir("finetune-squad") == first
    assert default_run_dir("pretrain").name.startswith("pretrain-")  # no run of this job
    assert elastic.restart_arguments(first, None, None, False, resumable=False) == \
        (None, None, True)
    assert elastic.restart_arguments(first, None, None, False)[0].name == "step-000010"
    monkeypatch.delenv(elastic.RESTART_ENV)  # not under torchrun: a new (timestamped) one
    assert elastic.launched_run_dir(Path("runs"), "finetune-squad-") is None


def test_the_run_directory_layout_agrees_with_popbert_io(tmp_path: Path) -> None:
    """popbert.distributed.elastic reads the run directory without importing popbert.io (a
    cycle); its reading must stay the same as run_dir's."""
    from popbert.distributed import elastic
    from popbert.io import run_dir

    run = tmp_path / "run"
    for step in (5, 10):
        checkpoint(run, step)
    (run / "checkpoints" / "step-000015").mkdir()  # incomplete: no state.json
    (run / "checkpoints" / ".tmp-step-000020").mkdir()
    assert elastic.checkpoint_dirs(run) == run_dir.checkpoint_dirs(run)
    assert [p.name for p in elastic.checkpoint_dirs(run)] == ["step-000005", "step-000010"]
    step = run_dir.step_dir(run, 10)
    assert elastic._run_dir_of(step) == run_dir.run_dir_of(step) == run
    assert elastic._run_dir_of(run) == run_dir.run_dir_of(run) == run
