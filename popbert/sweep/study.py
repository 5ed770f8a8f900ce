"""Where a sweep lives: an Optuna study in a store, and a sweep directory with its trials' runs.

A sweep directory holds `sweep.yaml` (the checked sweep file, its id and store), `study.db` (the
embedded store: SQLite, which Optuna's heartbeat needs and which several agent processes on one
machine share safely through SQLite's own locking; `optuna-dashboard sqlite:///DIR/study.db`
opens it) and `trials/trial-NNNN/`, one popbert run directory per trial. `--storage URL` puts
the study in any Optuna RDB store instead (PostgreSQL, MySQL) for agents on several machines;
the study itself then carries everything an agent needs (the sweep file in the study's user
attributes), so `popbert sweep agent ID --storage URL` works anywhere.

The study is named after the sweep id. Each trial records, as user attributes: `run_dir`
(its run directory), `host`, `pid`, `device`, and when it ends `outcome` (`complete`, `pruned`,
`error`: the job failed by itself, `skipped`: never run because the cap was reached or its grid
point was taken) and `error` (the message).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from popbert.atomic import atomic_write_text
from popbert.config.yaml_io import dump_yaml, parse_yaml
from popbert.errors import ConfigError, UsageError, one_line
from popbert.sweep.spec import Parameter, SweepSpec, check_spec, parse_spec

log = logging.getLogger(__name__)

SWEEP_FILE = "sweep.yaml"
STUDY_DB = "study.db"
TRIALS = "trials"
SPEC_ATTR = "popbert_sweep"      # study user attribute: the sweep file as plain data
DIR_ATTR = "popbert_sweep_dir"   # study user attribute: where the sweep was created
MAX_RETRY = 3  # a trial whose agent died is retried at most this many times
OUTCOME = "outcome"


@dataclass
class Sweep:
    """An opened sweep: its id (the study's name), store URL, directory and checked spec."""

    id: str
    storage_url: str
    directory: Path
    spec: SweepSpec

    def trial_dir(self, number: int) -> Path:
        """The run directory of trial `number`."""
        return self.directory / TRIALS / f"trial-{number:04d}"

    def storage(self) -> optuna.storages.RDBStorage:
        """The store, with this sweep's heartbeat: an agent that stops beating for two
        intervals has its trial failed, and the trial is retried (`MAX_RETRY`)."""
        return make_storage(self.storage_url, self.spec.heartbeat)

    def load_study(self, sampler: optuna.samplers.BaseSampler | None = None,
                   pruner: optuna.pruners.BasePruner | None = None) -> optuna.Study:
        return optuna.load_study(study_name=self.id, storage=self.storage(),
                                 sampler=sampler, pruner=pruner)


def default_storage(directory: Path) -> str:
    """The embedded store of a sweep directory."""
    return f"sqlite:///{(Path(directory) / STUDY_DB).resolve()}"


def make_storage(url: str, heartbeat: float | None = None) -> optuna.storages.RDBStorage:
    """An Optuna RDB store; SQLite waits for a busy database instead of failing (several
    agents write to it), a server connection is checked before use."""
    kwargs: dict[str, Any] = {}
    if url.startswith("sqlite"):
        kwargs["connect_args"] = {"timeout": 120}
    else:
        kwargs["pool_pre_ping"] = True
    extra: dict[str, Any] = {}
    if heartbeat:
        extra = dict(heartbeat_interval=max(int(round(heartbeat)), 1),
                     grace_period=max(int(round(2 * heartbeat)), 2),
                     heartbeat_stale_trial_callback=retry_callback())
    try:
        with quiet():
            return optuna.storages.RDBStorage(driver_url(url), engine_kwargs=kwargs, **extra)
    except (ImportError, ModuleNotFoundError) as error:
        raise ConfigError(f"--storage {_safe_url(url)}: its database driver is missing "
                          f"({error}); for PostgreSQL: pip install 'popbert[sweep-server]'"
                          ) from None
    except Exception as error:  # sqlalchemy's own errors: a bad URL, a server not there
        raise ConfigError(f"--storage {_safe_url(url)}: cannot open the study store: "
                          f"{one_line(error, 300)}") from None


def driver_url(url: str) -> str:
    """`url` with a PostgreSQL driver that is installed: SQLAlchemy 2.1 reads a plain
    `postgresql://` as psycopg 3, while popbert's sweep-server extra installs psycopg2."""
    import importlib.util

    if url.startswith("postgresql://") and importlib.util.find_spec("psycopg") is None \
            and importlib.util.find_spec("psycopg2") is not None:
        return "postgresql+psycopg2://" + url[len("postgresql://"):]
    return url


def retry_callback():
    """Optuna's callback that queues a copy of a trial whose agent stopped beating (same
    parameters, grid point and user attributes), at most `MAX_RETRY` times."""
    with quiet():
        return optuna.storages.RetryHeartbeatStaleTrialCallback(max_retry=MAX_RETRY)


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """Heartbeats, their stale-trial callback and fail_stale_trials are marked experimental in
    Optuna; popbert relies on them on purpose, so those warnings are noise."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        yield


def fail_stale_trials(study: optuna.Study) -> None:
    """Fail the trials whose agents stopped beating (and queue their retries) now."""
    with quiet():
        optuna.storages.fail_stale_trials(study)


def _safe_url(url: str) -> str:
    """The URL without its password, for messages."""
    return re.sub(r"://([^:/@]+):[^@]*@", r"://\1:***@", url)


def new_sweep_id(spec: SweepSpec, source: str) -> str:
    stem = spec.name or Path(source).stem or "sweep"
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", stem).strip("-")[:40] or "sweep"
    return f"{slug}-{uuid.uuid4().hex[:8]}"


def resolve_init_from(spec: SweepSpec) -> dict[str, Any] | None:
    """The checkpoint every trial of a phase-2 sweep starts from: the named (or best) finished
    trial of the `init_from` sweep. Recorded once, at creation, so all agents agree."""
    if spec.init_from is None:
        return None
    ref = spec.init_from
    where = f"{spec.source}: init_from.sweep {ref.sweep}"
    try:
        earlier = open_sweep(ref.sweep, ref.storage)
    except (ConfigError, UsageError) as error:
        raise ConfigError(f"{where}: {error}") from None
    study = earlier.load_study()
    done = [t for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
            if t.value is not None]
    if not done:
        raise ConfigError(f"{where}: has no finished trial to start from")
    if ref.trial == "best":
        trial = best_trial(done, earlier.spec.goal)
    else:
        matches = [t for t in done if t.number == ref.trial]
        if not matches:
            raise ConfigError(f"{spec.source}: init_from.trial: trial {ref.trial} of {ref.sweep} "
                              f"did not finish; finished: {', '.join(str(t.number) for t in done)}")
        trial = matches[0]
    run = Path(trial.user_attrs.get("run_dir", ""))
    from popbert.io.run_dir import checkpoint_dirs

    checkpoints = checkpoint_dirs(run) if run.is_dir() else []
    if not checkpoints:
        raise ConfigError(f"{where}: trial {trial.number}'s run directory {run} holds no "
                          "checkpoint")
    return {"sweep": earlier.id, "trial": trial.number, "value": trial.value,
            "checkpoint": str(checkpoints[-1]), "params": dict(trial.params)}


def best_trial(trials: list[FrozenTrial], goal: str) -> FrozenTrial:
    """The finished trial with the best value (the lowest number among ties)."""
    sign = 1.0 if goal == "minimize" else -1.0
    return min(trials, key=lambda t: (sign * t.value, t.number))


def create_sweep(path: str | os.PathLike[str], output_dir: Path | None = None,
                 storage: str | None = None) -> Sweep:
    """Check a sweep file and create its study and directory; returns the new sweep.

    `output_dir` defaults to `sweeps/<id>`; `storage` to the directory's embedded store.
    """
    from popbert.sweep.spec import load_spec

    spec = load_spec(path)
    if spec.backend != "optuna":
        raise UsageError(f"{path}: backend {spec.backend}: the sweep runs on W&B "
                         "(popbert.sweep.wandb_backend.create_wandb_sweep), not in a study")
    init = resolve_init_from(spec)
    sweep_id = new_sweep_id(spec, str(path))
    directory = Path(output_dir) if output_dir is not None else Path("sweeps") / sweep_id
    if (directory / SWEEP_FILE).exists():
        raise UsageError(f"-o {directory}: already holds a sweep ({SWEEP_FILE}); choose "
                         "another directory")
    from popbert.io.run_dir import create_output_dir

    created = create_output_dir(directory, "-o")
    directory = directory.resolve()
    url = storage or default_storage(directory)
    data = {"id": sweep_id, "storage": url if storage else None, "spec": spec.to_dict()}
    if init is not None:
        data["init_from_resolved"] = init
    try:
        study = optuna.create_study(study_name=sweep_id, storage=make_storage(url),
                                    direction=spec.goal)
        study.set_user_attr(SPEC_ATTR, {k: v for k, v in data.items() if k != "storage"})
        study.set_user_attr(DIR_ATTR, str(directory))
        atomic_write_text(directory / SWEEP_FILE, dump_yaml(data))
    except BaseException:
        if created:  # a store that cannot be reached leaves no half-made sweep behind
            shutil.rmtree(directory, ignore_errors=True)
        raise
    log.info("created sweep %s in %s (store %s)", sweep_id, directory, _safe_url(url))
    return Sweep(sweep_id, url, directory, _spec_of(data, str(directory / SWEEP_FILE)))


def _spec_of(data: dict[str, Any], source: str) -> SweepSpec:
    spec = parse_spec(data["spec"], source)
    spec.source = source
    return spec


def init_checkpoint(sweep: Sweep) -> Path | None:
    """The checkpoint a phase-2 sweep's trials start from (None for a sweep without
    init_from)."""
    data = _sweep_data(sweep)
    init = data.get("init_from_resolved")
    return Path(init["checkpoint"]) if init else None


def _sweep_data(sweep: Sweep) -> dict[str, Any]:
    path = sweep.directory / SWEEP_FILE
    if path.is_file():
        return parse_yaml(path.read_text(encoding="utf-8"), str(path))
    study = optuna.load_study(study_name=sweep.id, storage=make_storage(sweep.storage_url))
    return dict(study.user_attrs[SPEC_ATTR])


def open_sweep(ref: str | os.PathLike[str], storage: str | None = None,
               output_dir: Path | None = None) -> Sweep:
    """A sweep by its directory, or by its id in `storage` (then its runs go to `output_dir`,
    else the directory it was created in when that exists here, else `sweeps/<id>`)."""
    directory = Path(ref)
    if (directory / SWEEP_FILE).is_file():
        path = directory / SWEEP_FILE
        data = parse_yaml(path.read_text(encoding="utf-8"), str(path))
        if data.get("backend", "optuna") != "optuna":
            raise UsageError(f"{ref}: a W&B sweep ({data['id']}): its trials and plots are on "
                             "W&B; run its agent with popbert sweep agent")
        url = storage or data.get("storage") or default_storage(directory)
        return Sweep(data["id"], url, directory.resolve(), _spec_of(data, str(path)))
    if directory.exists() and storage is None:
        raise UsageError(f"{ref}: not a sweep directory (no {SWEEP_FILE})")
    if storage is None:
        raise UsageError(f"{ref}: no such sweep directory; a sweep id needs --storage URL")
    store = make_storage(storage)
    names = [s.study_name for s in optuna.get_all_study_summaries(store,
                                                                   include_best_trial=False)]
    if str(ref) not in names:
        raise UsageError(f"{ref}: no sweep of that id in {_safe_url(storage)} (sweeps: "
                         f"{', '.join(names) or 'none'})")
    study = optuna.load_study(study_name=str(ref), storage=store)
    data = study.user_attrs.get(SPEC_ATTR)
    if not data:
        raise UsageError(f"{ref}: study in {_safe_url(storage)} was not created by popbert "
                         "sweep create")
    if output_dir is None:
        created = Path(study.user_attrs.get(DIR_ATTR, ""))
        output_dir = created if created.is_dir() else Path("sweeps") / str(ref)
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    if not (output_dir / SWEEP_FILE).exists():  # this machine's copy of the sweep
        atomic_write_text(output_dir / SWEEP_FILE, dump_yaml({**data, "storage": storage}))
    return Sweep(str(ref), storage, output_dir.resolve(), _spec_of(data, f"sweep {ref}"))


def recheck(sweep: Sweep) -> None:
    """Check the spec again on this machine (files and presets it names may differ here)."""
    check_spec(sweep.spec)


# ----------------------------------------------------------------------------------------------
# Samplers and pruner


def distribution(p: Parameter) -> optuna.distributions.BaseDistribution:
    """The Optuna distribution of a W&B parameter."""
    from optuna.distributions import (
        CategoricalDistribution,
        FloatDistribution,
        IntDistribution,
    )

    if p.distribution in ("constant", "categorical"):
        return CategoricalDistribution(p.values)
    if p.distribution == "int_uniform":
        return IntDistribution(int(p.min), int(p.max))
    if p.distribution == "uniform":
        return FloatDistribution(p.min, p.max)
    if p.distribution == "q_uniform":
        return FloatDistribution(p.min, p.min + p.q * int((p.max - p.min) / p.q + 1e-9),
                                 step=p.q)
    if p.distribution == "log_uniform":  # W&B: min and max are natural-log exponents
        import math

        return FloatDistribution(math.exp(p.min), math.exp(p.max), log=True)
    if p.distribution == "log_uniform_values":
        return FloatDistribution(p.min, p.max, log=True)
    if p.distribution == "q_log_uniform_values":  # Optuna has no log grid: sampled in log
        return FloatDistribution(p.min, p.max, log=True)
    raise ValueError(p.distribution)


def search_space(spec: SweepSpec) -> dict[str, optuna.distributions.BaseDistribution]:
    return {name: distribution(p) for name, p in spec.parameters.items()}


def grid(spec: SweepSpec) -> dict[str, list[Any]]:
    return {name: p.grid_values() for name, p in spec.parameters.items()}


def grid_size(spec: SweepSpec) -> int:
    size = 1
    for values in grid(spec).values():
        size *= len(values)
    return size


def make_sampler(spec: SweepSpec, salt: int = 0) -> optuna.samplers.BaseSampler:
    """grid → GridSampler, random → RandomSampler, bayes → TPESampler (or GPSampler with
    `sampler: gp`). `salt` is added to `seed` (the agent passes the number of trials so far);
    a grid's order follows `seed` alone (a running grid point is never handed out twice)."""
    if spec.method == "grid":
        return optuna.samplers.GridSampler(grid(spec), seed=spec.seed)
    seed = None if spec.seed is None else spec.seed + salt
    if spec.method == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    # Both model the metric only after their random start-up trials (TPE's default: 10, which a
    # sweep of 8 never leaves — it would be a random search); start modelling after a third of
    # the cap, at least 3 trials.
    startup = min(10, max(3, spec.run_cap // 3)) if spec.run_cap else 10
    if spec.sampler == "gp":
        return optuna.samplers.GPSampler(seed=seed, n_startup_trials=startup)
    return optuna.samplers.TPESampler(seed=seed, n_startup_trials=startup)


def make_pruner(spec: SweepSpec) -> optuna.pruners.BasePruner:
    """early_terminate hyperband → Optuna's HyperbandPruner over evaluations of the metric
    (the resource is the count of values reported: W&B's iterations); otherwise none."""
    early = spec.early_terminate
    if not early:
        return optuna.pruners.NopPruner()
    max_iter = early.get("max_iter") or spec.max_evaluations() or "auto"
    return optuna.pruners.HyperbandPruner(min_resource=early.get("min_iter", 1),
                                          max_resource=max_iter,
                                          reduction_factor=early.get("eta", 3))


# ----------------------------------------------------------------------------------------------
# Slots: run_cap, --count and grid points across agents


def holds_slot(trial: FrozenTrial) -> bool:
    """Whether a trial counts against the sweep's cap: running, waiting (a retry), finished,
    pruned, or failed by itself; not one failed because its agent died (its retry counts) and
    not one skipped."""
    if trial.state == TrialState.FAIL:
        return trial.user_attrs.get(OUTCOME) == "error"
    return True


def cap(spec: SweepSpec) -> int | None:
    """How many trials the sweep runs in all: run_cap, and for a grid its size."""
    limits = [c for c in (spec.run_cap, grid_size(spec) if spec.method == "grid" else None)
              if c is not None]
    return min(limits) if limits else None


def why_skip(spec: SweepSpec, trial: FrozenTrial, trials: list[FrozenTrial]) -> str | None:
    """Why a trial just taken must not run, judged from the trials numbered before it (a store
    numbers trials in the order it creates them, so agents on any machine agree): the cap is
    already held, or an earlier live trial holds the same grid point."""
    earlier = [t for t in trials if t.number < trial.number and holds_slot(t)]
    limit = cap(spec)
    if limit is not None and len(earlier) >= limit:
        return f"the sweep's {limit} trials are taken"
    if spec.method == "grid" and "grid_id" in trial.system_attrs:
        point = trial.system_attrs["grid_id"]
        for t in earlier:
            if t.system_attrs.get("grid_id") == point:
                return f"grid point {point} ({trial.params}) is trial {t.number}'s"
    return None


def slots_left(spec: SweepSpec, study: optuna.Study) -> int | None:
    """Trials the sweep may still start (None: no limit)."""
    limit = cap(spec)
    if limit is None:
        return None
    held = sum(holds_slot(t) for t in study.get_trials(deepcopy=False))
    return max(limit - held, 0)


__all__ = ["DIR_ATTR", "MAX_RETRY", "OUTCOME", "SPEC_ATTR", "STUDY_DB", "SWEEP_FILE", "Sweep",
           "TRIALS", "best_trial", "cap", "create_sweep", "default_storage", "distribution",
           "fail_stale_trials", "grid", "grid_size", "holds_slot", "init_checkpoint",
           "make_pruner", "make_sampler", "make_storage", "new_sweep_id", "open_sweep", "quiet",
           "recheck", "resolve_init_from", "retry_callback", "search_space", "slots_left",
           "why_skip"]
