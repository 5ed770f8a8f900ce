"""The sweep agent: take a trial from the study, run its job as a popbert run, report, repeat.

Each trial runs in the agent's process as a popbert run directory `trials/trial-NNNN/` (config,
metrics.jsonl, checkpoint, plot). Every value of the metric the job logs is reported to the
study (the resource is the count of values: W&B's iterations), and when the pruner says so the
run stops at once (`popbert.train.loop.RunStopped`) and keeps its partial metrics; the trial is
PRUNED with its last value. A job that fails by itself (diverged, a bad value) is a FAIL with
`outcome: error` that counts against `run_cap`; a trial whose agent died (SIGKILL, a lost
machine) stops beating and is failed by the next agent that looks, then retried (Optuna's
heartbeat and `RetryFailedTrialCallback`).

Under torchrun every process runs the agent; replica 0 talks to the store and hands each trial's
parameters to the others, and all replicas run the trial together (`execution.replicas`).
"""

from __future__ import annotations

import logging
import math
import os
import socket
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import optuna
from optuna.trial import TrialState

from popbert.errors import ConfigError, PopbertError, UsageError, one_line
from popbert.rules import PER_MACHINE
from popbert.sweep.spec import (
    FINETUNE_TASKS,
    SweepSpec,
    base_config,
    job_metrics,
    override_text,
)
from popbert.sweep.study import (
    OUTCOME,
    Sweep,
    cap,
    create_sweep,
    fail_stale_trials,
    init_checkpoint,
    make_pruner,
    make_sampler,
    open_sweep,
    quiet,
    recheck,
    retry_callback,
    slots_left,
    why_skip,
)

if TYPE_CHECKING:
    from popbert.config import RunConfig

log = logging.getLogger(__name__)

FAILURES_IN_A_ROW = 3  # an agent whose trials keep failing stops (like W&B's agent)


class TrialError(Exception):
    """The trial's job failed (recorded on the trial); the agent goes on to the next."""


class TrialSkipped(Exception):
    """The trial was taken but must not run (cap reached, grid point taken)."""


@dataclass
class AgentReport:
    """What one agent did: the trials it ran (number → state name)."""

    trials: dict[int, str] = field(default_factory=dict)
    stopped: str = ""


def suggest(trial: optuna.Trial, name: str,
            dist: optuna.distributions.BaseDistribution) -> Any:
    """The trial's value of one parameter, through Optuna's public suggest API."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    if isinstance(dist, CategoricalDistribution):
        return trial.suggest_categorical(name, dist.choices)
    if isinstance(dist, IntDistribution):
        return trial.suggest_int(name, dist.low, dist.high, step=dist.step, log=dist.log)
    return trial.suggest_float(name, dist.low, dist.high, step=dist.step, log=dist.log)


def run_job(sweep: Sweep, params: Mapping[str, Any], run_dir: Path, *,
            device: str | None = None, on_record=None, replicas=None) -> float:
    """Run the sweep's job with one trial's parameters into `run_dir`; returns the final value
    of the metric (the job's last logged value, or its end-of-run evaluation)."""
    spec = sweep.spec
    logged, final = job_metrics(spec)
    init = init_checkpoint(sweep)
    from popbert.train.trainer import Trainer

    if spec.job == "pretrain":
        from popbert.config import DEFAULT_PRESET, load_config

        overrides = spec.overrides(params)
        if device is not None:
            overrides.append(override_text("execution.device", device))
        cfg = load_config(spec.config or DEFAULT_PRESET, overrides)
        if cfg.tracking.backend != "none":  # W&B: the trials of a sweep are one group
            named = {"tracking.group": sweep.id,
                     "tracking.run_name": f"{sweep.id}-{Path(run_dir).name}"}
            overrides += [override_text(k, v) for k, v in named.items()
                          if getattr(cfg.tracking, k.split(".")[1]) is None]
            cfg = load_config(spec.config or DEFAULT_PRESET, overrides)
    else:
        cfg = finetune_trial_config(spec, params, init, device)
        init = None  # a fine-tuning trial starts from finetune.checkpoint
    with Trainer.from_config(cfg, run_dir, init_from=init, replicas=replicas,
                             on_record=on_record) as trainer:
        results = trainer.train().metrics
    if spec.metric in final:
        value = results.get(spec.metric)
    else:
        value = last_value(run_dir / "metrics.jsonl", spec.metric)
    if value is None or not math.isfinite(value):
        raise TrialError(f"the job wrote no finite {spec.metric}")
    return float(value)


def last_value(metrics: Path, key: str) -> float | None:
    """The last value of `key` in a metrics.jsonl (None when it never appears)."""
    from popbert.observe.tracking import read_metrics

    if not metrics.is_file():
        return None
    values = [r[key] for r in read_metrics(metrics) if isinstance(r.get(key), int | float)]
    return float(values[-1]) if values else None


def finetune_trial_config(spec: SweepSpec, params: Mapping[str, Any], init: Path | None,
                          device: str | None) -> RunConfig:
    """A fine-tuning trial's config: the job's `args` (each one `finetune.*` key, as the
    command's flags), `set` and the trial's parameters, from the `init_from` trial's checkpoint
    when `args` names none."""
    from popbert.train.finetune import FLAG_KEYS, finetune_config

    args = spec.job_args(params)
    checkpoint = args.pop("checkpoint", None) or init
    train = args.pop("train")
    if isinstance(args.get("labels"), str):
        args["labels"] = [x.strip() for x in args["labels"].split(",")]
    overrides = [override_text(FLAG_KEYS[k], v) for k, v in args.items()]
    overrides += spec.overrides(params)
    if device is not None:
        overrides.append(override_text("execution.device", device))
    return finetune_config(FINETUNE_TASKS[spec.job], checkpoint, train, overrides=overrides,
                           config=spec.config)


def check_device(device: str | None, flag: str = "--device") -> None:
    """Refuse, before the first trial, a device the config refuses (`execution.device`'s own
    rule) or this machine lacks: every trial would fail on it, spending the sweep's trials as
    failures. (An agent runs its trials on its own machine.)"""
    if device is None:
        return
    from popbert.config import ExecutionConfig
    from popbert.rules import Invalid, rule_of

    rule = rule_of(ExecutionConfig, "device")
    try:
        if rule is not None:
            rule.check(flag, device)
    except Invalid as error:
        raise UsageError(str(error)) from None
    from popbert.runtime.devices import available_devices, resolve_device

    try:
        resolve_device(device)
    except ConfigError:
        raise UsageError(f"{flag}: this machine has no device {device!r} (available: "
                         f"{available_devices()})") from None


class Agent:
    """Runs trials of one sweep until it is done, `count` trials ran, or it is interrupted."""

    def __init__(self, sweep: Sweep, count: int | None = None, device: str | None = None):
        if count is not None and count < 1:
            raise UsageError(f"--count: expected a positive number of trials, got {count}")
        check_device(device)
        self.sweep = sweep
        self.spec = sweep.spec
        self.count = count
        self.device = device
        self.replicas = None
        self.report = AgentReport()

    # -- one trial ------------------------------------------------------------------------------

    def objective(self, trial: optuna.Trial) -> float:
        from popbert.sweep.study import search_space

        params = {name: suggest(trial, name, dist)
                  for name, dist in search_space(self.spec).items()}
        self._number = trial.number
        trials = trial.study.get_trials(deepcopy=False)
        me = next(t for t in trials if t.number == trial.number)
        reason = why_skip(self.spec, me, trials)
        if reason is not None:
            trial.set_user_attr(OUTCOME, "skipped")
            trial.set_user_attr("error", reason)
            raise TrialSkipped(reason)
        run_dir = self.sweep.trial_dir(trial.number)
        for key, value in {"run_dir": str(run_dir), "host": socket.gethostname(),
                           "pid": os.getpid(), "device": self.device or "config"}.items():
            trial.set_user_attr(key, value)
        log.info("trial %d: %s → %s", trial.number, params, run_dir)
        self._broadcast(("trial", trial.number, params))
        try:
            value = run_job(self.sweep, params, run_dir, device=self.device,
                            on_record=self._reporter(trial), replicas=self.replicas)
        except optuna.TrialPruned:
            raise
        except Exception as error:
            from popbert.train.loop import RunStopped

            if isinstance(error, RunStopped):
                trial.set_user_attr(OUTCOME, "pruned")
                trial.set_user_attr("stopped_step", error.step)
                log.info("trial %d pruned at step %d", trial.number, error.step)
                raise optuna.TrialPruned(str(error)) from None
            message = one_line(error)
            trial.set_user_attr(OUTCOME, "error")
            trial.set_user_attr("error", message[:1000])
            if not isinstance(error, PopbertError | TrialError):
                log.exception("trial %d failed", trial.number)
            raise TrialError(message) from None
        trial.set_user_attr(OUTCOME, "complete")
        log.info("trial %d: %s = %.6g", trial.number, self.spec.metric, value)
        return value

    def _reporter(self, trial: optuna.Trial | None):
        """The loop's `on_record`: report each value of the metric; a reason to stop when the
        pruner prunes (only replica 0 asks the store; the loop agrees with the others)."""
        metric = self.spec.metric
        _, final = job_metrics(self.spec)
        if metric in final:  # an end-of-run evaluation: nothing to report on the way
            return None
        seen = [0]

        def on_record(step: int, record: dict[str, float]) -> str | None:
            value = record.get(metric)
            if trial is None or not isinstance(value, int | float) or not math.isfinite(value):
                return None
            seen[0] += 1
            trial.report(float(value), seen[0])
            if trial.should_prune():
                return f"pruned ({metric} {value:.4g} after {seen[0]} values)"
            return None

        return on_record

    # -- the loop -------------------------------------------------------------------------------

    def run(self) -> AgentReport:
        """Take and run trials until the sweep is done or `count` trials ran."""
        recheck(self.sweep)
        self._join_replicas()
        finished = False
        try:
            if self.replicas is not None and not self.replicas.is_main:
                self._follow()
            else:
                self._lead()
            finished = True
        finally:
            if self.replicas is not None:
                # Gloo's worker threads must not outlive the interpreter (abort at exit).
                self.replicas.shutdown(clean=finished)
        return self.report

    def _lead(self) -> None:
        """The agent that talks to the store (the only one, or replica 0 under torchrun)."""
        study = self.sweep.load_study(make_sampler(self.spec), make_pruner(self.spec))
        failures = 0
        try:
            while self.count is None or len(self.report.trials) < self.count:
                fail_stale_trials(study)
                if slots_left(self.spec, study) == 0 and not study.get_trials(
                        deepcopy=False, states=(TrialState.WAITING,)):  # no retry queued
                    self.report.stopped = "the sweep is done"
                    break
                self._number = None
                if self.spec.method != "grid":
                    # Seeded by the trials so far: one agent's sweep is reproducible from
                    # `seed`, and agents that ask at different times sample differently.
                    study.sampler = make_sampler(self.spec, len(study.get_trials(deepcopy=False)))
                try:
                    with quiet():  # Optuna's heartbeat thread is "experimental"
                        study.optimize(self.objective, n_trials=1,
                                       catch=(TrialError, TrialSkipped), gc_after_trial=True)
                except KeyboardInterrupt:
                    self._retry_interrupted(study)
                    raise
                if self._number is None:
                    continue
                trial = study.get_trials(deepcopy=False)[self._number]
                outcome = trial.user_attrs.get(OUTCOME)
                if outcome == "skipped":
                    continue
                self.report.trials[trial.number] = trial.state.name
                failures = failures + 1 if outcome == "error" else 0
                if failures >= FAILURES_IN_A_ROW:
                    raise UsageError(f"sweep {self.sweep.id}: {failures} trials in a row "
                                     f"failed; the last: trial {trial.number}: "
                                     f"{trial.user_attrs.get('error')}")
            else:
                self.report.stopped = f"ran --count {self.count} trials"
        finally:
            self._broadcast(("stop",))
        log.info("agent done (%s): trials %s", self.report.stopped or "stopped",
                 ", ".join(f"{n} {s}" for n, s in self.report.trials.items()) or "none")

    def _retry_interrupted(self, study: optuna.Study) -> None:
        """An interrupted trial (Ctrl-C) is failed by Optuna; put it back for the next agent, as
        the heartbeat would for a killed one."""
        number = getattr(self, "_number", None)
        if number is None:
            return
        trial = study.get_trials(deepcopy=False)[number]
        if trial.state == TrialState.FAIL and OUTCOME not in trial.user_attrs:
            retry_callback()(study, trial)
            log.info("trial %d interrupted: queued again for the next agent", number)

    # -- torchrun -------------------------------------------------------------------------------

    def _join_replicas(self) -> None:
        from popbert.distributed import world_size_from_env

        if world_size_from_env() == 1:
            return
        if self.spec.job != "pretrain":
            raise ConfigError(f"sweep {self.sweep.id}: {self.spec.job} runs in one process; "
                              "start its agent without torchrun")
        from popbert.distributed import init_replicas
        from popbert.runtime.devices import resolve_device

        overrides = ([override_text("execution.device", self.device)]
                     if self.device is not None else [])
        cfg = base_config(self.spec)
        if overrides:
            from popbert.config import DEFAULT_PRESET, load_config

            cfg = load_config(self.spec.config or DEFAULT_PRESET,
                              self.spec.overrides() + overrides)
        self.replicas = init_replicas(cfg, resolve_device(cfg.execution.device))

    def _broadcast(self, message: tuple) -> None:
        if self.replicas is not None and self.replicas.distributed:
            self.replicas.all_gather_object(message)

    def _follow(self) -> None:
        """Replicas other than 0: run each trial replica 0 announces, until it says stop."""
        while True:
            message = self.replicas.all_gather_object(None)[0]
            if message[0] != "trial":
                return
            _, number, params = message
            try:
                run_job(self.sweep, params, self.sweep.trial_dir(number), device=self.device,
                        on_record=lambda step, record: None, replicas=self.replicas)
            except Exception as error:  # replica 0 records it
                log.debug("trial %d on this replica: %s", number, error)


def run_agent(sweep_ref: str | os.PathLike[str], *, storage: str | None = None,
              count: int | None = None, device: str | None = None,
              output_dir: Path | None = None) -> AgentReport:
    """Open a sweep (directory, or id in `storage`) and run an agent on it."""
    sweep = open_sweep(sweep_ref, storage, output_dir)
    return Agent(sweep, count=count, device=device).run()


def run_sweep(path: str | os.PathLike[str], agents: int, *, output_dir: Path | None = None,
              storage: str | None = None, count: int | None = None,
              devices: list[str] | None = None) -> Sweep:
    """Create a sweep and run `agents` local agent processes on it to the end (each logs to
    `agent-<i>.log` in the sweep directory; device `devices[i % len(devices)]`)."""
    if not PER_MACHINE.allows(agents):  # each agent is a process on this machine
        raise UsageError(f"--agents: expected a number {PER_MACHINE.expected}, got {agents}")
    for device in devices or ():
        check_device(device, "--devices")
    from popbert.sweep.spec import load_spec

    spec = load_spec(path)
    if cap(spec) is None and count is None:
        raise UsageError(f"{path}: method {spec.method} without run_cap never ends: set "
                         "run_cap in the sweep file or pass --count")
    sweep = create_sweep(path, output_dir, storage)
    processes = []
    for i in range(agents):
        command = [sys.executable, "-m", "popbert", "sweep", "agent", str(sweep.directory)]
        if count is not None:
            command += ["--count", str(count)]
        if devices:
            command += ["--device", devices[i % len(devices)]]
        logfile = open(sweep.directory / f"agent-{i}.log", "ab")  # noqa: SIM115
        processes.append((subprocess.Popen(command, stdout=logfile, stderr=subprocess.STDOUT),
                          logfile))
    failed = []
    try:
        for i, (process, logfile) in enumerate(processes):
            code = process.wait()
            logfile.close()
            if code != 0:
                failed.append(f"agent {i} exited with {code} (see "
                              f"{sweep.directory / f'agent-{i}.log'})")
    except BaseException:
        for process, _ in processes:
            if process.poll() is None:
                process.terminate()
        raise
    if failed:
        raise UsageError(f"sweep {sweep.id}: " + "; ".join(failed))
    return sweep


__all__ = ["Agent", "AgentReport", "FAILURES_IN_A_ROW", "TrialError", "TrialSkipped",
           "check_device", "last_value", "run_agent", "run_job", "run_sweep", "suggest"]
