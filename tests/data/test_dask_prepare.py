"""`popbert prepare-data ... --dask ADDRESS` on a real Dask cluster: a scheduler and workers,
each its own process on 127.0.0.1 (`tests/dask_cluster.py`).

Every stage's output equals one local worker's, array for array and byte for byte; a worker
SIGKILLed while it runs a unit costs only that unit (the scheduler gives it to a worker that
joins later) and leaves no half-written part; a re-run on the cluster skips finished parts; an
unreachable scheduler or a missing Dask is one line and exit status 2.

The killed worker loads `tests/slow_units.py` with Dask's own `--preload`, which makes each of
its units sleep first, so the test finds it mid-unit for certain, however fast the machine.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from dask_cluster import DaskCluster, self_signed_certificate, tls_environment
from replica_helpers import free_port

from popbert.cli.main import main
from popbert.data import read_shard
from popbert.data.tokenization import bundled_vocab_path

FIXTURE = (Path(__file__).parent.parent / "fixtures" / "wiki"
           / "enwiki-fixture-pages-articles.xml.bz2")
STAGE_ARGS = ["--sequence-length", "64", "--max-predictions", "10", "--dupe-factor", "2",
              "--seed", "7"]
PIPELINE = ["--vocab", str(bundled_vocab_path()), "--part-size-mb", "0.02", *STAGE_ARGS]
STAGES = {"extracted": "jsonl", "sentences": "txt", "instances-s64-p10": "h5",
          "packed-s64-p10": "h5"}


def parts(directory: Path, suffix: str) -> list[Path]:
    return sorted(directory.glob(f"part-*.{suffix}"))


def assert_same_parts(ours: Path, reference: Path, suffix: str) -> None:
    mine, theirs = parts(ours, suffix), parts(reference, suffix)
    assert [p.name for p in mine] == [p.name for p in theirs] and mine
    for a, b in zip(mine, theirs, strict=True):
        if suffix == "h5":
            x, y = read_shard(a), read_shard(b)
            assert x.keys() == y.keys()
            assert all(np.array_equal(x[k], y[k]) for k in x), a.name
        else:
            assert a.read_bytes() == b.read_bytes(), a.name


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> Path:
    """The whole pipeline with one local worker."""
    out = tmp_path_factory.mktemp("local") / "wiki"
    assert main(["prepare-data", "wikipedia", "--input", str(FIXTURE), "-o", str(out),
                 "--workers", "1", *PIPELINE]) == 0
    assert len(parts(out / "sentences", "txt")) >= 3
    return out


@pytest.fixture()
def cluster(tmp_path):
    cluster = DaskCluster(tmp_path / "cluster")
    try:
        yield cluster
    finally:
        cluster.close()


def popbert_process(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "popbert", *argv], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "TQDM_DISABLE": "1", **(env or {})})


@pytest.mark.e2e
def test_every_stage_on_the_cluster_equals_one_local_worker(reference, cluster, tmp_path):
    cluster.add_worker("a")
    cluster.add_worker("b")
    out = tmp_path / "wiki"
    # Relative paths, as a user types them: the workers run in other directories.
    run = popbert_process("prepare-data", "wikipedia", "--input", str(FIXTURE),
                          "-o", os.path.relpath(out), "--dask", cluster.address, *PIPELINE)
    log, _ = run.communicate(timeout=300)
    assert run.returncode == 0, log
    assert f"Dask cluster at {cluster.address}" in log
    for stage, suffix in STAGES.items():
        assert_same_parts(out / stage, reference / stage, suffix)


def _processing(cluster: DaskCluster, worker: str) -> bool:
    """Whether the scheduler has a unit running on the worker named `worker`."""
    with cluster.client() as client:
        names = {a: w["name"] for a, w in client.scheduler_info(n_workers=-1)["workers"].items()}
        return any(tasks for a, tasks in client.processing().items() if names.get(a) == worker)


@pytest.mark.e2e
def test_a_worker_killed_mid_unit_costs_only_that_unit_and_a_rerun_skips_finished_parts(
        reference, cluster, tmp_path):
    cluster.add_worker("slow", preload=str(Path(__file__).parent.parent / "slow_units.py"))
    out = tmp_path / "instances"
    argv = ["prepare-data", "instances", "--input", str(reference / "sentences"),
            "--vocab", str(bundled_vocab_path()), "-o", str(out), "--dask", cluster.address,
            *STAGE_ARGS]
    run = popbert_process(*argv)
    deadline = time.monotonic() + 120
    while not _processing(cluster, "slow"):
        assert run.poll() is None and time.monotonic() < deadline, run.communicate()[0]
        time.sleep(0.1)
    cluster.kill_worker("slow")  # mid-unit: each of its units sleeps 3 s before it starts
    assert not parts(out, "h5")
    cluster.add_worker("fresh")  # the lost unit and the rest go to the worker that joins
    log, _ = run.communicate(timeout=300)
    assert run.returncode == 0, log
    reference_shards = reference / "instances-s64-p10"
    assert_same_parts(out, reference_shards, "h5")

    # A re-run of an interrupted stage on the cluster makes only the missing part.
    victim = parts(out, "h5")[1]
    victim.unlink()
    (out / "_SUCCESS.json").unlink()
    others = {p: p.stat().st_mtime_ns for p in parts(out, "h5")}
    run = popbert_process(*argv)
    log, _ = run.communicate(timeout=300)
    assert run.returncode == 0, log
    assert f"{len(others)} already done" in log
    assert {p: p.stat().st_mtime_ns for p in others} == others
    assert_same_parts(out, reference_shards, "h5")


@pytest.mark.e2e
def test_a_tls_cluster_with_dasks_own_certificate_settings(reference, tmp_path):
    """`tls://`: the scheduler takes only peers with a certificate of its CA; the client's
    certificate comes from Dask's own settings, as a user exports them."""
    tls = self_signed_certificate(tmp_path)
    cluster = DaskCluster(tmp_path / "cluster", tls=tls)
    try:
        assert cluster.address.startswith("tls://")
        cluster.add_worker("a")
        out = tmp_path / "sentences"
        argv = ["prepare-data", "sentences", "--input", str(reference / "extracted"),
                "-o", str(out), "--dask", cluster.address]
        run = popbert_process(*argv, env=tls_environment(tls))
        log, _ = run.communicate(timeout=300)
        assert run.returncode == 0, log
        assert_same_parts(out, reference / "sentences", "txt")
        # Without a certificate the scheduler is not reached: one line, nothing written.
        plain = popbert_process(*argv[:-2], "-o", str(tmp_path / "refused"), "--dask",
                                cluster.address,
                                env={"DASK_DISTRIBUTED__COMM__TIMEOUTS__CONNECT": "3s"})
        log, _ = plain.communicate(timeout=300)
        assert plain.returncode == 2, log
        assert "--dask: cannot reach the Dask scheduler at tls://" in log
        assert "Traceback" not in log and not (tmp_path / "refused").exists()
    finally:
        cluster.close()


@pytest.mark.parametrize("source", ["--dask", "$DASK_SCHEDULER_ADDRESS"])
def test_an_unreachable_scheduler_is_one_line(source, tmp_path, capsys, monkeypatch):
    import dask

    # Imported before the config is set: its defaults join dask.config at import, and leaving
    # `dask.config.set` would drop them again.
    pytest.importorskip("distributed")
    address = f"tcp://127.0.0.1:{free_port()}"
    argv = ["prepare-data", "sentences", "--input", str(tmp_path), "-o", str(tmp_path / "out")]
    if source == "--dask":
        argv += ["--dask", address]
    else:
        monkeypatch.setenv("DASK_SCHEDULER_ADDRESS", address)
    with dask.config.set({"distributed.comm.timeouts.connect": "1s"}):
        assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert f"{source}: cannot reach the Dask scheduler at {address}" in err
    assert not (tmp_path / "out").exists()


def test_without_dask_installed_the_flag_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "distributed", None)  # import distributed -> ImportError
    assert main(["prepare-data", "sentences", "--input", str(tmp_path),
                 "-o", str(tmp_path / "out"), "--dask", "tcp://127.0.0.1:8786"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0
    assert "--dask: Dask is not installed: pip install 'popbert[dask]'" in err
    assert not (tmp_path / "out").exists()
