"""torchrun's elastic restarts: a restarted worker group resumes its own run by itself.

`torchrun --max-restarts N` restarts every worker of the job when one fails (a worker killed, a
node's process gone), with the same command line (`$TORCHELASTIC_RESTART_COUNT` is raised by one
only on the machine whose worker failed). A restarted `popbert pretrain -o DIR` must then
continue its run from the newest complete checkpoint in DIR rather than be refused as a new run
on a directory holding another run, and without `--resume` on a command line that cannot
change.

It must not resume *another* run, though: a first attempt refused because DIR held an older
run also makes torchrun restart the group. So a run started under restartable torchrun records
in `DIR/.torchrun.json` the torchrun agents (host, pid, start time) that launched it; a restart
resumes only a directory its own agents are recorded in (an agent outlives its workers'
restarts). Anything else keeps the first launch's behaviour. A restart before the first
checkpoint starts the run over in DIR (what the previous attempt wrote is deleted).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from popbert.atomic import atomic_write_text
from popbert.distributed.replicas import Replicas
from popbert.errors import ConfigError

log = logging.getLogger(__name__)

RESTART_ENV = "TORCHELASTIC_RESTART_COUNT"
MAX_RESTARTS_ENV = "TORCHELASTIC_MAX_RESTARTS"
MARKER = ".torchrun.json"


def _env_int(name: str) -> int:
    raw = os.environ.get(name, "0")
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"${name}={raw!r} is not an integer") from None


def restart_count() -> int:
    """How many times torchrun restarted this worker group (0: first launch, or no torchrun)."""
    return _env_int(RESTART_ENV)


def restartable() -> bool:
    """Whether torchrun may restart this job (`--max-restarts` > 0)."""
    return RESTART_ENV in os.environ and _env_int(MAX_RESTARTS_ENV) > 0


def agent_identity() -> list[Any]:
    """This worker's torchrun agent (its parent process): [host, pid, start time], stable over
    the agent's restarts of its workers. The start time (Linux's clock ticks after boot; None
    elsewhere) tells a reused pid apart."""
    pid = os.getppid()
    started = None
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        started = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, after "pid (comm)"
    except (OSError, ValueError, IndexError):
        pass
    return [socket.gethostname(), pid, started]


@dataclass(frozen=True)
class RestartPlan:
    """How a restarted worker group continues: resume the run in `resume`, or start over
    (`overwrite`: the previous attempt's files go) when it wrote no checkpoint yet."""

    resume: Path | None = None
    overwrite: bool = False


def _read_marker(output_dir: Path) -> dict[str, Any]:
    try:
        record = json.loads((Path(output_dir) / MARKER).read_text())
        return record if isinstance(record, dict) else {}
    except (OSError, ValueError):
        return {}


def recorded_agents(output_dir: Path) -> list[list[Any]]:
    """The torchrun agents recorded as having launched the run in `output_dir` ([] if none)."""
    try:
        return [list(agent) for agent in _read_marker(output_dir)["agents"]]
    except (KeyError, TypeError):
        return []


# The run directory's layout, as popbert.io.run_dir writes it (that package sits above this
# one: importing it here would be a cycle). tests/distributed/test_elastic.py checks they agree.
CHECKPOINTS = "checkpoints"


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    """The run's complete checkpoints (`checkpoints/step-NNNNNN/state.json`), oldest first."""
    root = Path(output_dir) / CHECKPOINTS
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / "state.json").is_file())


def _run_dir_of(path: Path) -> Path:
    """The run directory of `path`: a run directory itself, or one of its checkpoints."""
    if path.parent.name == CHECKPOINTS and (path / "state.json").exists():
        return path.parent.parent
    return path


def _checkpoint_stamps(output_dir: Path) -> dict[str, int]:
    """{name: state.json's mtime in ns} of the complete checkpoints in `output_dir`."""
    stamps = {}
    for path in checkpoint_dirs(output_dir):
        with contextlib.suppress(OSError):
            stamps[path.name] = (path / "state.json").stat().st_mtime_ns
    return stamps


def restart_plan(output_dir: Path) -> RestartPlan | None:
    """Under torchrun: whether this worker is a restart of the job that runs in `output_dir`,
    and how it goes on (None: a first launch, or not this job's directory, so the usual checks
    apply). A restart is recognised by this worker's agent being recorded in the directory, not
    by `$TORCHELASTIC_RESTART_COUNT`: each agent counts only its own workers' failures, so on
    the machines where nothing failed the restarted workers still read 0 (torch issue 108158).

    It resumes from the newest checkpoint this job wrote: one that was there before it started
    (`--resume` of an older checkpoint of the same directory) belongs to another trajectory.
    Every worker decides alone, from the same files (the run directory is on a filesystem all
    nodes share), and the replicas then agree on the start step."""
    if RESTART_ENV not in os.environ:
        return None
    if agent_identity() not in recorded_agents(output_dir):
        if restart_count() and any(Path(output_dir).glob("[!.]*")):
            log.info("torchrun restarted this job, but %s holds no run it started; starting as "
                     "a new run", output_dir)
        return None  # nothing there yet (a failed first attempt leaves no empty run behind)
    before = _read_marker(output_dir).get("checkpoints_before", {})
    ours = [name for name, stamp in sorted(_checkpoint_stamps(output_dir).items())
            if before.get(name) != stamp]
    if ours:
        log.warning("torchrun restarted this job: resuming the run in %s from %s (the steps "
                    "after it are trained again)", output_dir, ours[-1])
        return RestartPlan(resume=Path(output_dir) / CHECKPOINTS / ours[-1])
    log.warning("torchrun restarted this job: no checkpoint of it in %s yet; the run starts "
                "over", output_dir)
    return RestartPlan(overwrite=True)


def restart_arguments(output_dir: Path, resume: Path | None, init_from: Path | None,
                      overwrite: bool, resumable: bool = True
                      ) -> tuple[Path | None, Path | None, bool]:
    """A run's (resume, init_from, overwrite), changed on a torchrun restart of this job's
    run (:func:`restart_plan`): resume its newest checkpoint; or, with none yet (or for a job
    that does not resume: `resumable` false, fine-tuning), start over the way the first launch
    did, deleting what it wrote, unless it resumed a checkpoint of this same directory (that
    run is not deleted: it is resumed from the same checkpoint again)."""
    plan = restart_plan(output_dir)
    if plan is None:
        return resume, init_from, overwrite
    if plan.resume is not None and resumable:
        return plan.resume, None, False
    if resume is not None and _same_dir(_run_dir_of(Path(resume)), Path(output_dir)):
        return resume, init_from, False
    return resume, init_from, True


def launched_run_dir(root: Path, prefix: str) -> Path | None:
    """Under torchrun: the newest run directory `root/<prefix>*` that this worker's agent
    launched (its `.torchrun.json` names the agent), so a restarted job given no `-o` finds
    the directory of its first attempt instead of starting a new one. None elsewhere."""
    if RESTART_ENV not in os.environ or not Path(root).is_dir():
        return None
    me = agent_identity()
    for directory in sorted(Path(root).glob(f"{prefix}*"), reverse=True):
        if me in recorded_agents(directory):
            return directory
    return None


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return False


def record_launch(replicas: Replicas, output_dir: Path) -> None:
    """Under restartable torchrun: write which agents launched the run in `output_dir`, so a
    restart of this job (and only of this job) resumes it, and which checkpoints were there
    before it (kept from the first launch on). Every replica takes part (one gather of the
    agents: on several nodes, replica 0 after a restart may sit on another)."""
    if not restartable():
        return
    if replicas.is_main:  # its own agent at once: one machine's restart needs no more
        record = _read_marker(output_dir)
        if agent_identity() not in recorded_agents(output_dir):  # this job's first launch here
            record = {"checkpoints_before": _checkpoint_stamps(output_dir)}
        record.update(run_id=os.environ.get("TORCHELASTIC_RUN_ID"),
                      agents=_union(recorded_agents(output_dir) if "agents" in record else [],
                                    [agent_identity()]))
        _write_marker(output_dir, record)
    agents = replicas.all_gather_object(agent_identity())
    if replicas.is_main:
        record["agents"] = _union(record["agents"], agents)
        _write_marker(output_dir, record)


def _union(first: list[list[Any]], second: list[list[Any]]) -> list[list[Any]]:
    both = [list(a) for a in first + second]
    return [a for i, a in enumerate(both) if a not in both[:i]]


def _write_marker(output_dir: Path, record: dict[str, Any]) -> None:
    atomic_write_text(Path(output_dir) / MARKER, json.dumps(record) + "\n")


__all__ = ["MARKER", "RestartPlan", "agent_identity", "checkpoint_dirs", "launched_run_dir",
           "record_launch", "recorded_agents", "restart_arguments", "restart_count",
           "restart_plan", "restartable"]
