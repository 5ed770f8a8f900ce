"""`backend: wandb`: the same sweep run by a W&B server instead of the Optuna store.

W&B's keys of the sweep file go to `wandb.sweep`, popbert's stay in the sweep directory's
`sweep.yaml`; each W&B run runs the same popbert trial as the Optuna agent
(`popbert.sweep.agent.run_job`), its metrics logged to that run. It needs a W&B server and
account. How it works and what is tested: docs/sweeps.md, "On a W&B server".
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import re
import sys
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from popbert.atomic import atomic_write_text
from popbert.config.yaml_io import dump_yaml, parse_yaml
from popbert.errors import ConfigError, UsageError, one_line
from popbert.sweep.spec import SweepSpec, job_metrics, load_spec, parse_spec
from popbert.sweep.study import SWEEP_FILE, TRIALS, Sweep, recheck, resolve_init_from

log = logging.getLogger(__name__)

DEFAULT_PROJECT = "popbert"
HYPERBAND_ETA = 3  # the reduction factor both backends use when the file names none
_SWEEP_PATH = re.compile(r"^[^/\s]+/[^/\s]+/[^/\s]+$")  # entity/project/sweep-id
_NEEDS_SERVER = ("W&B sweeps need a W&B server and account: wandb login (or WANDB_API_KEY), "
                 "or use backend: optuna")


def wandb_sweep_config(spec: SweepSpec) -> dict[str, Any]:
    """The W&B sweep configuration of a sweep file: W&B's own keys only. Hyperband is written
    in W&B's form: `min_iter` (default 1) and `eta` (default 3), or `max_iter` with `s`."""
    out: dict[str, Any] = {"method": spec.method,
                           "metric": {"name": spec.metric, "goal": spec.goal},
                           "parameters": spec.to_dict()["parameters"]}
    for key in ("name", "project", "entity", "run_cap"):
        if getattr(spec, key) is not None:
            out[key] = getattr(spec, key)
    early = spec.early_terminate
    if early:
        band: dict[str, Any] = {"type": "hyperband"}
        if "max_iter" in early and "s" in early:
            band.update(max_iter=early["max_iter"], s=early["s"])
        else:  # W&B reads max_iter only together with s
            band["min_iter"] = early.get("min_iter", 1)
        band["eta"] = early.get("eta", HYPERBAND_ETA)
        if "strict" in early:
            band["strict"] = early["strict"]
        out["early_terminate"] = band
    return out


def _wandb() -> Any:
    try:
        import wandb
    except ImportError:
        raise ConfigError("sweep backend wandb: wandb is not installed: pip install wandb "
                          "(or use backend: optuna)") from None
    return wandb


def require_server() -> Any:
    """wandb, when a W&B server can run the sweep (not W&B's offline or disabled mode)."""
    wandb = _wandb()
    mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if mode in ("offline", "dryrun", "disabled"):
        raise ConfigError(f"sweep backend wandb: WANDB_MODE is {mode}; {_NEEDS_SERVER}")
    return wandb


@contextlib.contextmanager
def _wandb_errors(what: str) -> Iterator[None]:
    """W&B's own errors (no API key, a server that refuses) as one line."""
    wandb = _wandb()
    try:
        yield
    except wandb.errors.Error as error:
        raise ConfigError(f"sweep backend wandb: {what}: {one_line(error)} "
                          f"({_NEEDS_SERVER})") from None


def create_wandb_sweep(path: str | os.PathLike[str], output_dir: Path | None = None) -> Sweep:
    """Check a sweep file, create its sweep on the W&B server and a sweep directory holding
    popbert's side (`sweep.yaml`, `trials/`); the sweep's id is W&B's `entity/project/id`."""
    spec = load_spec(path)
    if spec.backend != "wandb":
        raise UsageError(f"{path}: backend is {spec.backend}, not wandb")
    if output_dir is not None:  # before W&B makes a sweep this directory cannot hold
        _check_free(Path(output_dir))
    wandb = require_server()
    init = resolve_init_from(spec)
    config = wandb_sweep_config(spec)
    project = spec.project or DEFAULT_PROJECT
    with _wandb_errors("creating the sweep"), contextlib.redirect_stdout(sys.stderr):
        # wandb.sweep prints its own lines; stdout carries only the id.
        sweep_id = wandb.sweep(config, entity=spec.entity, project=project)
        entity = spec.entity or wandb.Api().default_entity
    sweep_path = f"{entity}/{project}/{sweep_id}"
    directory = Path(output_dir) if output_dir is not None else Path("sweeps") / sweep_id
    return _write_directory(directory, sweep_path, spec, init)


def _write_directory(directory: Path, sweep_path: str, spec: SweepSpec,
                     init: dict[str, Any] | None) -> Sweep:
    from popbert.io.run_dir import create_output_dir

    _check_free(directory)
    create_output_dir(directory, "-o")
    data: dict[str, Any] = {"id": sweep_path, "backend": "wandb", "storage": None,
                            "spec": spec.to_dict()}
    if init is not None:
        data["init_from_resolved"] = init
    atomic_write_text(directory / SWEEP_FILE, dump_yaml(data))
    log.info("W&B sweep %s: popbert's side in %s", sweep_path, directory.resolve())
    return _sweep(data, directory, str(directory / SWEEP_FILE))


def _check_free(directory: Path) -> None:
    if (directory / SWEEP_FILE).exists():
        raise UsageError(f"-o {directory}: already holds a sweep ({SWEEP_FILE}); choose "
                         "another directory")


def _sweep(data: dict[str, Any], directory: Path, source: str) -> Sweep:
    spec = parse_spec(data["spec"], source)
    spec.source = source
    return Sweep(str(data["id"]), "", Path(directory).resolve(), spec)


def is_wandb_sweep(ref: str | os.PathLike[str], storage: str | None = None) -> bool:
    """Whether `ref` names a W&B sweep: a sweep directory of backend wandb, or (no --storage,
    no such directory) a W&B sweep path `entity/project/id`."""
    path = Path(ref)
    if (path / SWEEP_FILE).is_file():
        data = parse_yaml((path / SWEEP_FILE).read_text(encoding="utf-8"),
                          str(path / SWEEP_FILE))
        return isinstance(data, dict) and data.get("backend") == "wandb"
    return storage is None and not path.exists() and bool(_SWEEP_PATH.match(str(ref)))


def open_wandb_sweep(ref: str | os.PathLike[str], sweep_file: Path | None = None,
                     output_dir: Path | None = None) -> Sweep:
    """A W&B sweep by its directory, or by `entity/project/id` with popbert's side from
    `sweep_file` (another machine) or from `output_dir` / `sweeps/<id>` when it is there."""
    directory = _local_side(ref, sweep_file, output_dir)
    if (directory / SWEEP_FILE).is_file():
        path = directory / SWEEP_FILE
        return _sweep(parse_yaml(path.read_text(encoding="utf-8"), str(path)), directory,
                      str(path))
    spec = load_spec(sweep_file)
    if spec.backend != "wandb":
        raise UsageError(f"--file {sweep_file}: backend is {spec.backend}, not wandb")
    return _write_directory(directory, str(ref), spec, resolve_init_from(spec))


def _local_side(ref: str | os.PathLike[str], sweep_file: Path | None,
                output_dir: Path | None) -> Path:
    """The sweep directory of a W&B sweep here; one where `sweep_file` will be written, or a
    one-line error when there is neither."""
    path = Path(ref)
    if (path / SWEEP_FILE).is_file():
        return path
    if not _SWEEP_PATH.match(str(ref)):
        raise UsageError(f"{ref}: not a sweep directory nor a W&B sweep path "
                         "(entity/project/id)")
    directory = Path(output_dir) if output_dir is not None \
        else Path("sweeps") / str(ref).rsplit("/", 1)[1]
    if not (directory / SWEEP_FILE).is_file() and sweep_file is None:
        raise UsageError(f"{ref}: no sweep directory here, nor popbert's side of a W&B sweep "
                         f"in {directory}; for a W&B sweep pass its sweep file with "
                         "--file FILE.yaml")
    return directory


def run_wandb_agent(ref: str | os.PathLike[str], *, count: int | None = None,
                    device: str | None = None, output_dir: Path | None = None,
                    sweep_file: Path | None = None) -> Sweep:
    """Run W&B's agent on a W&B sweep (see `open_wandb_sweep`) until W&B's controller says it
    is done, or `count` runs."""
    if count is not None and count < 1:
        raise UsageError(f"--count: expected a positive number of trials, got {count}")
    from popbert.sweep.agent import check_device

    check_device(device)
    _local_side(ref, sweep_file, output_dir)  # a typo is not a question for W&B
    require_server()
    sweep = open_wandb_sweep(ref, sweep_file, output_dir)
    recheck(sweep)
    wandb_agent(sweep, count=count, device=device)
    return sweep


def wandb_agent(sweep: Sweep, count: int | None = None, device: str | None = None) -> None:
    """`wandb.agent` on the sweep with `trial_function` (no checks of the server: see
    `run_wandb_agent`)."""
    wandb = _wandb()
    entity, project, sweep_id = sweep.id.split("/")
    with _wandb_errors(f"agent on {sweep.id}"):
        wandb.agent(sweep_id, function=trial_function(sweep, device), entity=entity,
                    project=project, count=count)


def trial_function(sweep: Sweep, device: str | None = None) -> Callable[[], None]:
    """The function W&B's agent calls for each run: the run's parameters from `wandb.config`,
    the popbert trial (`run_job`) into `trials/<run id>/`, its metrics into the W&B run."""
    wandb = _wandb()
    from popbert.sweep.agent import run_job

    spec = sweep.spec
    _, final = job_metrics(spec)
    pretrain = spec.job == "pretrain"
    if pretrain:  # the job's own logger writes every record (and the checkpoint) to the run
        tracked = Sweep(sweep.id, sweep.storage_url, sweep.directory,
                        replace(spec, set={**spec.set, "tracking.backend": "wandb"}))
    else:
        tracked = sweep
    # Fine-tuning tracks as its checkpoint's config says; a job that tracks to W&B itself logs
    # into the agent's run (wandb.init returns the active run) and finishes it at its end.
    self_tracked = pretrain or _finetune_tracks_wandb(sweep)
    if self_tracked and spec.metric in final:
        raise ConfigError(f"{spec.source}: metric.name: {spec.metric} is scored after the "
                          "job's W&B run ends (its checkpoint's config has tracking.backend "
                          "wandb); under backend wandb fine-tune from a checkpoint with "
                          "tracking.backend none, or sweep a metric the job logs")

    def trial() -> None:
        run = wandb.init()  # W&B's agent hands the run its parameters
        missing = [name for name in spec.parameters if name not in run.config]
        if missing:
            raise ConfigError(f"sweep {sweep.id}: W&B run {run.id} has no value for "
                              f"{', '.join(missing)}; is it the sweep of {spec.source}?")
        params = {name: run.config[name] for name in spec.parameters}
        if pretrain:  # the whole config beside the swept keys (the logger reuses this run)
            from popbert.sweep.spec import base_config

            run.config.update(base_config(tracked.spec, params).to_dict(),
                              allow_val_change=True)
        run_dir = sweep.directory / TRIALS / f"trial-{run.id}"
        log.info("W&B run %s: %s → %s", run.id, params, run_dir)

        last = [0]

        def on_record(step: int, record: dict[str, float]) -> None:
            run.log({k: v for k, v in record.items() if k != "step" and
                     not (isinstance(v, float) and math.isnan(v))}, step=step)
            last[0] = step

        value = run_job(tracked, params, run_dir, device=device,
                        on_record=None if self_tracked else on_record)
        if not self_tracked:
            if spec.metric in final:  # the end-of-run evaluation, once, under its name, after
                # the last training step (classification's training records have an accuracy)
                run.log({spec.metric: value}, step=last[0] + 1)
            run.summary[spec.metric] = value
            run.finish()
        log.info("W&B run %s: %s = %.6g", run.id, spec.metric, value)

    return trial


def _finetune_tracks_wandb(sweep: Sweep) -> bool:
    """Whether a fine-tuning sweep's checkpoint config has tracking.backend wandb (fine-tuning
    keeps its checkpoint's tracking section)."""
    from popbert.io.checkpoint import find_checkpoint
    from popbert.sweep.study import init_checkpoint

    start = sweep.spec.args.get("checkpoint") or init_checkpoint(sweep)
    if start is None:
        return False
    config = find_checkpoint(Path(start)) / "config.yaml"
    data = parse_yaml(config.read_text(encoding="utf-8"), str(config)) \
        if config.is_file() else {}
    tracking = data.get("tracking") if isinstance(data, dict) else None
    return isinstance(tracking, dict) and tracking.get("backend") == "wandb"


__all__ = ["DEFAULT_PROJECT", "HYPERBAND_ETA", "create_wandb_sweep", "is_wandb_sweep",
           "open_wandb_sweep", "require_server", "run_wandb_agent", "trial_function",
           "wandb_agent", "wandb_sweep_config"]
