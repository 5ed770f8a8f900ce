"""`prepare-data ... --dask` never waits in silence: on a real Dask cluster on 127.0.0.1
(`tests/dask_cluster.py`), a cluster that cannot run the work ends in one line within the
bound `--dask-wait` sets, and the stage's directory is left unlocked.

- no worker connected: one line once the wait is over, nothing written;
- a worker that cannot import popbert (`tests/hide_popbert.py`, as where popbert is not
  installed): one line naming that worker, before any unit;
- every worker killed mid-unit: one line saying how far the stage got, the lock released;
- the scheduler killed mid-unit: one line, no traceback, the lock released;
- `--dask-wait` without a cluster, or not above 0: refused in one line.

Each test sets the bound to a second or two; nothing here depends on the machine's speed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from dask_cluster import DaskCluster

from popbert.cli.main import main
from popbert.data.tokenization import bundled_corpus_path, bundled_vocab_path

pytest.importorskip("distributed")

TESTS = Path(__file__).parent.parent
STAGE_ARGS = ["--sequence-length", "64", "--max-predictions", "10", "--dupe-factor", "1"]


@pytest.fixture()
def cluster(tmp_path):
    cluster = DaskCluster(tmp_path / "cluster")
    try:
        yield cluster
    finally:
        cluster.close()


@pytest.fixture()
def corpus(tmp_path) -> Path:
    """Three small Google-format text files: three units for the instances stage."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    documents = bundled_corpus_path().read_text(encoding="utf-8")[:30_000].split("\n\n")
    for i in range(3):
        share = documents[i::3]
        (folder / f"part-{i}.txt").write_text("\n\n".join(share), encoding="utf-8")
    return folder


def instances_argv(corpus: Path, out: Path, address: str, wait: str) -> list[str]:
    return ["prepare-data", "instances", "--input", str(corpus / "*.txt"),
            "--vocab", str(bundled_vocab_path()), "-o", str(out), *STAGE_ARGS,
            "--dask", address, "--dask-wait", wait]


def error_lines(text: str) -> list[str]:
    assert "Traceback" not in text, text
    return [line for line in text.splitlines() if line.startswith("popbert: error:")]


def test_no_worker_connected_is_one_line_after_the_wait(cluster, corpus, tmp_path, capsys):
    out = tmp_path / "out"
    assert main(instances_argv(corpus, out, cluster.address, "1")) == 2
    err = capsys.readouterr().err
    [line] = error_lines(err)
    assert (f"--dask: no Dask worker joined the scheduler at {cluster.address} in 1 s "
            f"(--dask-wait)") in line
    assert not out.exists()


def test_a_worker_that_cannot_import_popbert_is_named_before_any_unit(cluster, corpus,
                                                                      tmp_path, capsys):
    cluster.add_worker("good")
    cluster.add_worker("bare", preload=str(TESTS / "hide_popbert.py"))
    bare = cluster.worker_address("bare")
    out = tmp_path / "out"
    assert main(instances_argv(corpus, out, cluster.address, "5")) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert (f"--dask: the Dask worker {bare} cannot import popbert.data "
            f"(ModuleNotFoundError: No module named 'popbert'") in line
    assert "pip install 'popbert[data,dask]'" in line
    assert not out.exists()


def _processing(cluster: DaskCluster, worker: str) -> bool:
    with cluster.client() as client:
        names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        return any(tasks for a, tasks in client.processing().items() if names.get(a) == worker)


@pytest.mark.e2e
def test_every_worker_killed_mid_stage_is_one_line_and_the_lock_goes(cluster, corpus,
                                                                     tmp_path):
    # Each unit on this worker sleeps 3 s first: it is found mid-unit however fast the machine.
    cluster.add_worker("slow", preload=str(TESTS / "slow_units.py"))
    out = tmp_path / "out"
    out.mkdir()  # a directory that existed before: it stays, unlocked, for a re-run
    run = subprocess.Popen([sys.executable, "-m", "popbert",
                            *instances_argv(corpus, out, cluster.address, "2")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "TQDM_DISABLE": "1"})
    try:
        deadline = time.monotonic() + 120  # against a hang only: the run waits for this
        while not _processing(cluster, "slow"):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
            time.sleep(0.1)
        cluster.kill_worker("slow")
        log, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 2, log
    [line] = error_lines(log)
    assert (f"instances: no Dask worker connected to the scheduler at {cluster.address} for "
            f"2 s (--dask-wait): all left or died and none joined; 0 of 3 unit(s) done") in line
    assert "no Dask worker is connected" in log  # said while it waited
    assert out.is_dir() and not (out / ".lock").exists()
    assert not list(out.glob("part-*")) and not (out / "_SUCCESS.json").exists()


@pytest.mark.e2e
def test_the_scheduler_lost_mid_stage_is_one_line_and_the_lock_goes(cluster, corpus, tmp_path):
    cluster.add_worker("slow", preload=str(TESTS / "slow_units.py"))
    out = tmp_path / "out"
    out.mkdir()
    run = subprocess.Popen([sys.executable, "-m", "popbert",
                            *instances_argv(corpus, out, cluster.address, "2")],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           env={**os.environ, "TQDM_DISABLE": "1"})
    try:
        deadline = time.monotonic() + 120  # against a hang only
        while not _processing(cluster, "slow"):
            assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
            time.sleep(0.1)
        cluster.scheduler.kill()
        log, _ = run.communicate(timeout=300)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 2, log
    [line] = error_lines(log)  # Dask's reconnection is said without its traceback too
    assert f"instances: lost the Dask scheduler at {cluster.address}" in line
    assert out.is_dir() and not (out / ".lock").exists()


@pytest.mark.parametrize("argv, expected", [
    (["--dask-wait", "5"], "--dask-wait: only with --dask ADDRESS"),
    (["--dask", "tcp://127.0.0.1:1", "--dask-wait", "0"], "--dask-wait must be > 0 seconds"),
])
def test_dask_wait_without_a_cluster_or_not_above_zero_is_refused(argv, expected, corpus,
                                                                  tmp_path, capsys,
                                                                  monkeypatch):
    monkeypatch.delenv("DASK_SCHEDULER_ADDRESS", raising=False)
    out = tmp_path / "out"
    assert main(["prepare-data", "sentences", "--input", str(corpus / "*.txt"), "--format",
                 "lines", "-o", str(out), *argv]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert expected in line and not out.exists()


def test_the_flags_default_is_the_librarys():
    from popbert.cli.main import build_parser
    from popbert.data.cluster import DEFAULT_WAIT_S
    from popbert.io import paths

    helps = [action.help for _, parser in paths.subparsers(build_parser())
             for action in parser._actions if "--dask-wait" in action.option_strings]
    assert len(helps) == 5  # wikipedia, extract, sentences, instances, pack
    assert all(f"(default {DEFAULT_WAIT_S:g})" in text for text in helps)


class _SchedulerGone:
    """A `distributed.Client` whose scheduler just went away: every question to it fails as
    Dask's own does (CI once caught the stage between two such questions)."""

    class scheduler:  # noqa: N801 - the attribute Dask's client has
        address = "tcp://127.0.0.1:8786"

    def nthreads(self):
        from distributed.comm.core import CommClosedError
        raise CommClosedError("in <TCP (closed) ConnectionPool.ncores>: ConnectionResetError")


@pytest.mark.parametrize("question", ["cluster_slots", "worker_count"])
def test_every_question_to_a_lost_scheduler_is_one_data_error(question):
    from popbert.data import cluster as dask_cluster
    from popbert.data.errors import DataError

    with pytest.raises(DataError, match=r"^lost the Dask scheduler at tcp://127\.0\.0\.1:8786 "
                                        r"\(in <TCP \(closed\)"):
        getattr(dask_cluster, question)(_SchedulerGone())


def test_a_client_that_gave_up_on_its_scheduler_is_one_data_error_at_submit():
    from popbert.data import stages
    from popbert.data.errors import DataError

    class GaveUp(_SchedulerGone):
        status = "closed"

        def nthreads(self):
            return {"tcp://127.0.0.1:40000": 1}

        def get_executor(self, **_):
            return self

        def submit(self, *_):
            raise RuntimeError("Client is closed")  # what Dask's client raises then

        def shutdown(self, wait):
            pass

    with pytest.raises(DataError, match=r"^instances: lost the Dask scheduler at "
                                        r"tcp://127\.0\.0\.1:8786 \(RuntimeError: Client is "):
        stages._run_on_cluster(GaveUp(), print, [(1,)], lambda *_: None, "instances", 1)
