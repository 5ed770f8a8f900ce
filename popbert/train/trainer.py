"""The one door for a run: `Trainer.from_config(cfg)` assembles it, `train()` runs it.

Pre-training, SQuAD and classification fine-tuning, sweep trials, the example and the benchmarks
all make their runs here, so the wiring (config → graph → session → data → schedule → steps →
checkpoints → metrics → export) exists once. What differs between them is the job's
(`popbert.train.jobs.Job`): the task graph, the data, the starting weights, and what is written
when training ends. The shape follows torchtitan's `Trainer`: built from the config, stateful
parts (`state_dict` / `load_state_dict`), `train()`, `close()`.

Under `torchrun` every process is one replica (`execution.replicas`): each reads its share of
every global batch, only replica 0 writes outputs, and all replicas take the same steps.

A run directory belongs to one run (`popbert.io.run_dir.claim_run_dir`): replica 0 locks it
before anything is written and until the last write, and a new run refuses a directory that
holds another run unless told to delete it (`overwrite=True`, `--overwrite`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from popbert.atomic import atomic_write_bytes, atomic_write_text, remove_tree, reported
from popbert.backends.sessions import make_session
from popbert.builders.bert import build_bert
from popbert.config import RunConfig, dump_config
from popbert.distributed import (
    Replicas,
    agree,
    check_world_size,
    init_replicas,
    rank_from_env,
    replica_seed,
    world_size_from_env,
)
from popbert.distributed.elastic import record_launch, restart_arguments
from popbert.errors import CheckpointError, ConfigError, WriteError, one_line
from popbert.io import checkpoint as ckpt
from popbert.io import run_dir
from popbert.io.paths import check_config_paths
from popbert.machine import quota_threads
from popbert.observe.plots import plot_metrics
from popbert.observe.tracking import MetricsLogger, read_metrics
from popbert.optimizers import set_lr
from popbert.runtime.devices import resolve_device
from popbert.runtime.options import SessionOptions
from popbert.runtime.protocol import Session
from popbert.runtime.rng import seed_all
from popbert.train.curriculum import SequenceCurriculum
from popbert.train.factories import (
    graph_batch_size,
    loss_scaler,
    lr_schedule,
    optimizer_factory,
    rows_change_length,
    warmup_micro_batches,
)
from popbert.train.jobs import Job
from popbert.train.loop import (
    LoopResult,
    LoopSettings,
    PartialBatch,
    RecordHook,
    RunInterrupted,
    RunStopped,
    StopSignals,
    TrainingClock,
    TrainingDiverged,
    agreed_max,
    all_replicas,
    train_loop,
)
from popbert.train.pretrain import check_carried_over
from popbert.train.runs import make_job

log = logging.getLogger(__name__)

# Under a time budget: the seconds kept for the final checkpoint, plot and export are this many
# times their rehearsal's (which, the first of its kind in the process, is rarely faster than
# the real ones), plus this share of the budget (for a disk that slows down).
RESERVE_FACTOR = 1.2
RESERVE_SHARE = 0.005


@dataclass
class RunResult:
    """What a finished run leaves: where, its final checkpoint and export, its last logged
    metrics and (fine-tuning) the evaluation's scores."""

    output_dir: Path
    checkpoint: Path
    steps: int  # the step the run ended at
    steps_trained: int = 0  # by this call (a resumed run trains fewer)
    final_metrics: dict[str, float] = field(default_factory=dict)  # the last logged record's
    metrics: dict[str, float] = field(default_factory=dict)  # the end-of-run evaluation's
    inference_model: Path | None = None
    plot: Path | None = None
    fresh: list[str] = field(default_factory=list)  # weights the starting checkpoint lacked
    seconds: float = 0.0  # spent in the training loop by this call (evaluation included)
    # The run's training seconds, summed over resumes: what a time budget counts (the steps,
    # checkpoints and logging, and this call's final checkpoint, plot and export).
    elapsed_s: float = 0.0


class CheckpointManager:
    """The run's checkpoints: saved every `every` steps into `output_dir/checkpoints/`, pruned to
    the newest `keep` (and the final one), and trusted only once the next step's loss passed.

    A checkpoint holds the weights the *next* step's loss is computed from, so it is pending until
    that loss is known: `confirm()` makes it the last good one; `diverged()` deletes it (its
    weights made the bad loss) and names the last good one. Only replica 0 touches the files.
    """

    def __init__(self, output_dir: Path, *, every: int, keep: int, is_main: bool,
                 config_yaml: str, graph: Any = None, resumed: bool = False,
                 resumable: bool = True):
        self.output_dir = output_dir
        self.resumable = resumable  # pre-training has --resume; fine-tuning starts over
        self.every = every
        self.keep = keep
        self.is_main = is_main
        self.config_yaml = config_yaml
        self.graph = graph  # the training graph saved with each checkpoint (None: rebuilt)
        existing = run_dir.checkpoint_dirs(output_dir) if is_main and resumed else []
        self.last_good: Path | None = existing[-1] if existing else None
        self.pending: Path | None = None

    def due(self, step: int, steps_done: int, last_step: int) -> bool:
        """Whether the run `steps_done` steps ago crossed a multiple of `every` (the last step
        is the final checkpoint's, written by `save_final`)."""
        return bool(self.every) and step % self.every < steps_done and step < last_step

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Write `state` (a pending checkpoint) as `checkpoints/step-<step>`."""
        directory = run_dir.step_dir(self.output_dir, step)
        if self.is_main:
            try:
                ckpt.save_checkpoint(directory, ckpt.Checkpoint.from_state(state),
                                     self.config_yaml, self.graph)
            except OSError as error:  # a file in its way, say: one line (`resume_hint` added)
                reason = error.strerror or str(error)
                raise WriteError(f"{directory}: cannot write: {reason}") from None
        self.pending = directory
        return directory

    def confirm(self) -> None:
        """The step after the pending checkpoint trained to a good loss: it is good."""
        if self.pending is not None:
            self.last_good, self.pending = self.pending, None
            self._prune(final=None)

    def diverged(self) -> Path | None:
        """Drop the pending checkpoint; the last good one (None: nothing was saved before)."""
        if self.pending is not None:
            if self.is_main:
                log.warning("removing %s: the run diverged right after it", self.pending)
                remove_tree(self.pending)
            self.pending = None
        return self.last_good

    def finalize(self) -> Path:
        """The pending checkpoint is the run's final one: kept by every later pruning."""
        final = self.pending
        if final is None:
            raise RuntimeError("finalize() needs a checkpoint just saved")
        self.last_good, self.pending = final, None
        self._prune(final=final)
        return final

    def resume_hint(self) -> str:
        """What a run that failed to write an output (a full disk) still has, and how to go on:
        every checkpoint written so far is intact (popbert's writes are atomic)."""
        newest = self.pending or self.last_good
        if newest is None:
            return "no checkpoint was written yet"
        if not self.resumable:
            return (f"the checkpoints written so far are intact (newest: {newest}); fine-tuning "
                    f"starts over: once the cause is fixed, run it again with --overwrite")
        return (f"the checkpoints written so far are intact (newest: {newest}); once the cause "
                f"is fixed (room, rights, a file in the way), continue with --resume "
                f"{self.output_dir}")

    def _prune(self, final: Path | None) -> None:
        if self.is_main:
            run_dir.prune_checkpoints(self.output_dir, self.keep, final=final)


def micro_batches(loader: Iterator[dict[str, torch.Tensor]], per_run: int
                  ) -> Iterator[dict[str, torch.Tensor]]:
    """What one `session.run` takes: `per_run` micro-batches stacked on the batch axis
    (`device_iterations × gradient_accumulation`); ends when the loader does."""
    while True:
        parts = []
        for _ in range(per_run):
            part = next(loader, None)
            if part is None:
                return
            parts.append(part)
        yield {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


class Trainer:
    """One run, assembled from its config. Use `Trainer.from_config`; then `train()`.

    The stateful parts are `session` and `loader` (`state_dict()` holds both); `checkpoints` saves
    them, `metrics` logs every record to `metrics.jsonl` (and W&B). As a context manager the run
    is closed on exit: replicas shut down, and a run that failed before writing anything of
    value leaves no output directory behind.
    """

    def __init__(self, cfg: RunConfig, job: Job, output_dir: Path, session: Session,
                 loader: Any, validation: list[dict[str, torch.Tensor]] | None,
                 replicas: Replicas, *, owns_replicas: bool, resumed: bool,
                 fresh: list[str], on_record: RecordHook | None = None,
                 elapsed: float = 0.0, claim: run_dir.RunClaim | None = None):
        self.cfg = cfg
        self.job = job
        self.output_dir = output_dir
        self.session = session
        self.loader = loader
        self.validation = validation
        self.replicas = replicas
        self.schedule = lr_schedule(cfg)
        # training.sequence_curriculum: short rows first (the batches are cut as they are drawn)
        self.curriculum = (SequenceCurriculum(cfg, replicas.rank)
                           if cfg.training.sequence_curriculum else None)
        self.clock = TrainingClock(cfg.training.time_budget, elapsed)
        self.clock.work = self._next_work  # what the next run of steps carries: its prediction
        self.setup_seconds = 0.0  # from_config's: assembling the run (outside a time budget)
        self._elapsed_before = elapsed  # training seconds before this train() call
        self.lr = 0.0  # the rate the last step was given
        session.step_hook = self._set_lr
        self.fresh = fresh
        self.on_record = on_record
        self._owns_replicas = owns_replicas
        self._claim = claim  # replica 0's lock on the directory (from_config takes it)
        self._created = False
        self._closed = False
        self.config_yaml = dump_config(cfg)
        self.metrics: MetricsLogger | None = None
        self.resumed_from: Path | None = None  # the checkpoint resumed (from_config sets it)
        # A budgeted run resumed from the checkpoint that ended its budget (it stopped before
        # its export, say): train() writes what is missing without training (from_config).
        self.finishing = False
        self._budget_done = False  # the next checkpoint ends the budget: state.json says so
        main = replicas.is_main
        graph = job.graph_to_save()
        if main:
            self._created = (claim.created if claim is not None
                             else run_dir.create_output_dir(output_dir))
            try:
                if claim is not None:
                    claim.start()  # --overwrite: the earlier run goes now, not before the checks
                run_dir.clean_interrupted(output_dir)
                atomic_write_text(output_dir / "config.yaml", self.config_yaml)
                job.write_inputs(output_dir)
                if graph is not None:
                    atomic_write_bytes(output_dir / "model.onnx", graph.SerializeToString())
                self.metrics = MetricsLogger(output_dir, cfg.to_dict(),
                                             resume_step=session.step if resumed else None)
            except BaseException:
                run_dir.remove_if_empty_run(output_dir, self._created)
                raise
        t = cfg.training
        self.checkpoints = CheckpointManager(output_dir, every=t.checkpoint_every,
                                             keep=t.keep_checkpoints, is_main=main,
                                             config_yaml=self.config_yaml, graph=graph,
                                             resumed=resumed,
                                             resumable=cfg.finetune.task is None)

    # -- assembly -------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, cfg: RunConfig, output_dir: str | Path | None = None, *,
                    resume: str | Path | None = None, init_from: str | Path | None = None,
                    overwrite: bool = False, replicas: Replicas | None = None,
                    on_record: RecordHook | None = None,
                    backend_options: Mapping[str, Any] | None = None) -> Trainer:
        """Assemble the run `cfg` describes, writing into `output_dir` (default:
        `runs/<job>-<timestamp>`; a resumed run continues in its own directory).

        Everything that can be checked (config, device, data, the checkpoints named) is checked
        before anything is written. `resume`: a run directory or checkpoint to continue from
        (weights, optimizer, data position, RNG); `init_from`: a checkpoint whose weights start a
        new run (phase 1 → 2). Under torchrun this process becomes one of `execution.replicas`
        replicas; `replicas` may instead name a process group set up by the caller.
        `on_record(step, record)` sees every logged record and may stop the run (a sweep's
        pruner): see `popbert.train.loop.train_loop`. `backend_options` go to the backend's
        session (`popbert.backends.make_session`: `popart_options=` for PopART).

        The directory belongs to this run (`popbert.io.run_dir.claim_run_dir`): replica 0 locks
        it first (a second process on it stops with one line naming the holder) and holds the
        lock until `close()`. A new run refuses a directory holding another run (it would
        append to that run's metrics, prune its checkpoints and replace its config);
        `overwrite` deletes that run first, once every check has passed, but never clears a
        directory holding files popbert did not write. Resuming in the run's own directory
        only locks it.
        """
        check_config_paths(cfg)  # every path the config names, in one line each, first
        setup_started = time.perf_counter()
        if resume is not None:
            # The checkpoint itself, before anything is written: an incomplete one named
            # directly is refused, incomplete newer ones in a run directory are named.
            resume = ckpt.find_checkpoint(Path(resume), warn=_launch_rank(replicas) == 0)
        if output_dir is None:
            job = "pretrain" if cfg.finetune.task is None else f"finetune-{cfg.finetune.task}"
            output_dir = (run_dir.run_dir_of(Path(resume)) if resume is not None
                          else run_dir.default_run_dir(job))
        output_dir = Path(output_dir)
        # A torchrun restart of this job goes on with its own run by itself: pre-training
        # resumes its newest checkpoint, fine-tuning (which does not resume) starts over.
        resume, init_from, overwrite = restart_arguments(
            output_dir, resume, init_from, overwrite, resumable=cfg.finetune.task is None)
        run_dir.check_output_dir(output_dir)
        claim = None
        if _launch_rank(replicas) == 0:  # the other replicas share replica 0's directory
            continuing = resume is not None and _same_dir(run_dir.run_dir_of(Path(resume)),
                                                          output_dir)
            sources = [("--resume", resume), ("--init-from", init_from),
                       ("finetune.checkpoint", cfg.finetune.checkpoint)]
            if cfg.finetune.task is None:  # fine-tuning sets its own vocab_file
                sources.append(("data.vocab_file", cfg.data.vocab_file))
            claim = run_dir.claim_run_dir(output_dir, new_run=not continuing,
                                          overwrite=overwrite, sources=sources,
                                          flag="--resume" if continuing else "--output-dir",
                                          resumable=cfg.finetune.task is None)
        try:
            trainer = cls._assemble(cfg, output_dir, claim, resume=resume, init_from=init_from,
                                    replicas=replicas, on_record=on_record,
                                    backend_options=backend_options)
        except BaseException:
            if claim is not None:
                claim.release(failed=True)  # a directory it created goes (nothing was kept)
            raise
        try:
            record_launch(trainer.replicas, trainer.output_dir)  # what a restart looks for
        except BaseException:
            trainer.close()
            raise
        trainer.setup_seconds = time.perf_counter() - setup_started
        return trainer

    @classmethod
    def _assemble(cls, cfg: RunConfig, output_dir: Path, claim: run_dir.RunClaim | None, *,
                  resume: str | Path | None, init_from: str | Path | None,
                  replicas: Replicas | None, on_record: RecordHook | None,
                  backend_options: Mapping[str, Any] | None) -> Trainer:
        """`from_config` once the directory is this run's: everything else, in order."""
        job = make_job(cfg, output_dir)
        cfg = job.config
        job.check(cfg)
        replicas, owns = _replicas_for(cfg, replicas)
        restored = ckpt.load_checkpoint(Path(resume)) if resume is not None else None
        budget = cfg.training.time_budget
        finishing = False
        if restored is not None:
            job.check_resume(restored)
            spent = float(restored.trainer.get("elapsed_s", 0.0))
            if budget is not None and spent >= budget:
                raise ConfigError(f"training.time_budget is {budget:g} s but the checkpoint "
                                  f"{resume} has already trained {spent:.0f} s; raise "
                                  "training.time_budget")
            if budget is None and restored.step > cfg.training.steps:
                raise ConfigError(f"training.steps is {cfg.training.steps} but the checkpoint "
                                  f"{resume} is already at step {restored.step}; raise "
                                  "training.steps")
            finishing = budget is not None and restored.trainer.get("budget_done") == budget
            if finishing:
                log.info("%s ended the run's %g s budget: finishing the run (export, plot) "
                         "without training (a larger training.time_budget trains on)", resume,
                         budget)
            if budget is None and restored.step == cfg.training.steps:
                # Stopped after its final checkpoint (before its export, say): train() finishes
                # it; raising training.steps trains on instead.
                log.info("%s is at the run's last step (training.steps %d): finishing the run "
                         "(export, plot) without training", resume, restored.step)
        initial = (ckpt.load_checkpoint(Path(init_from), weights_only=True)
                   if init_from is not None else None)
        if cfg.execution.threads:
            torch.set_num_threads(cfg.execution.threads)
        elif "OMP_NUM_THREADS" not in os.environ:  # torchrun's own choice stands
            _threads_within_quota()
        job.load_data()
        if owns:
            replicas = init_replicas(cfg, resolve_device(cfg.execution.device))
        try:
            seed_all(cfg.training.seed)
            graph = build_bert(cfg.model, task=job.task, seed=cfg.training.seed,
                               batch_size=graph_batch_size(cfg),
                               dynamic_sequence=rows_change_length(cfg))
            job.graph = graph.model()
            session = make_session(job.graph, graph.loss, optimizer_factory(cfg),
                                   SessionOptions.from_config(cfg, replicas),
                                   loss_scaler=loss_scaler(cfg), replicas=replicas,
                                   **(backend_options or {}))
            if replicas.rank:  # every replica its own dropout masks (replica 0 as 1 process)
                seed_all(replica_seed(cfg.training.seed, replicas.rank))
            loader = job.loader(replicas.rank, replicas.size)
            validation = job.validation(replicas.rank, replicas.size)
            fresh = job.load_initial_weights(session,
                                             initial.weights if initial is not None else None)
            if initial is not None:  # a load that carries over almost nothing: one line
                check_carried_over(cfg, dict(session.named_parameters), fresh, initial.config,
                                   init_from)
            if restored is not None:
                _restore(session, loader, restored.state())
                log.info("resumed from step %d", restored.step)
            agree(replicas, "(start step, training.steps, global batch, samples)",
                  (session.step, cfg.training.steps, cfg.global_batch_size,
                   loader.num_samples))
            trainer = cls(cfg, job, output_dir, session, loader, validation, replicas,
                          owns_replicas=owns, resumed=restored is not None, fresh=fresh,
                          on_record=on_record,
                          elapsed=restored.trainer.get("elapsed_s", 0.0) if restored else 0.0,
                          claim=claim)
            trainer.resumed_from = Path(resume) if resume is not None else None
            trainer.finishing = finishing
            return trainer
        except BaseException:
            if owns:
                replicas.shutdown(clean=False)
            raise

    # -- running --------------------------------------------------------------------------------

    def train(self) -> RunResult:
        """Train to `training.steps`, save the final checkpoint, evaluate (fine-tuning) and
        export (pre-training). A diverged or stopped run raises `TrainingDiverged` /
        `RunStopped` and keeps its metrics and plot.

        SIGTERM or SIGUSR1 while training (`StopSignals`) stops the run after its current step
        with a checkpoint of that step: `RunInterrupted`. A run resumed at its last step (it
        stopped after its final checkpoint) trains nothing and writes what is missing: the
        evaluation, plot and export. A full disk is a one-line `WriteError` saying which
        checkpoint to resume from."""
        session, main = self.session, self.replicas.is_main
        started = session.step
        budget = self.clock.budget
        final: Path | None = None
        scores: dict[str, float] = {}
        scoring = 0.0  # seconds of the end-of-run evaluation (outside the budget)
        if budget is not None and not self.finishing:
            log.info("time budget: %g s%s for the steps, checkpoints, the final checkpoint and "
                     "the export; setup (%.1f s) and evaluations are outside it", budget,
                     f" ({self.clock.elapsed:.0f} s spent before this resume)"
                     if self.clock.elapsed else "", self.setup_seconds)
        self._elapsed_before = self.clock.elapsed
        self.clock.start()
        with StopSignals() as stop:
            try:
                if self.finishing:
                    result = LoopResult(0, 0.0)
                else:
                    result = train_loop(session, self.batches(), self.loop_settings(),
                                        schedule=self._logged_lr,
                                        tracker=self.metrics, checkpoints=self.checkpoints,
                                        save=self.save_checkpoint, validation=self.validation,
                                        on_record=self.on_record, clock=self.clock, stop=stop,
                                        rehearse=(self._rehearse_finish if budget is not None
                                                  else None))
                # The checkpoint saved next (unless the loop's last turn saved it) ends the budget.
                self._budget_done = budget is not None and not result.stop_signal
                here = run_dir.step_dir(self.output_dir, session.step)
                if session.step == started and self.resumed_from is not None \
                        and _same_dir(self.resumed_from, here):
                    self.checkpoints.pending = here  # resumed at its last step: it is there
                elif self.checkpoints.pending != here:
                    self.save_checkpoint()  # unless the loop's last turn just saved this step
                if result.stop_signal:
                    raise RunInterrupted(session.step, result.stop_signal,
                                         self.checkpoints.pending, self.output_dir,
                                         resumable=self.cfg.finetune.task is None)
                final = self.checkpoints.finalize()
                if main:
                    self.clock.tick()
                    scored = time.perf_counter()
                    scores = self.job.score(self)
                    scoring = time.perf_counter() - scored
                    self.clock.skip()  # evaluation, as in the loop, is not training
                    if scores and self.metrics is not None:
                        self.metrics.summarize(scores)
                plot = self._close_metrics(final)
                inference = self.job.export(self) if main else None
                self.clock.tick()
            except WriteError as error:
                self._close_metrics(None, failing=True)
                raise WriteError(f"{error}; {self.checkpoints.resume_hint()}") from None
            except BaseException:
                self._close_metrics(None, failing=True)
                raise
        if not result.record and main:  # resumed at its last step: its record is on file
            result.record = last_record(self.output_dir / "metrics.jsonl", session.step)
        if main:
            log.info("output: %s (checkpoint %s%s)", self.output_dir, final.name,
                     f", {inference.name}" if inference is not None else "")
        if budget is not None:  # the budget includes the final checkpoint and export
            log.info("time budget: %.1f s of %g s spent, final checkpoint and export included "
                     "(outside it: setup %.1f s, evaluation %.1f s)", self.clock.elapsed, budget,
                     self.setup_seconds, result.evaluation_s + scoring)
        return RunResult(self.output_dir, final, session.step, session.step - started,
                         {k: v for k, v in result.record.items() if k in self.job.metric_keys},
                         scores, inference, plot, list(self.fresh), result.seconds,
                         self.clock.elapsed)

    def batches(self) -> Iterator[dict[str, torch.Tensor] | PartialBatch]:
        """What each `session.run` takes, drawn from the loader only when the loop asks for it
        (so a checkpoint's data position is what the steps so far consumed, and a resumed run
        goes on with the same micro-batches): `micro_batches_per_run()` micro-batches stacked,
        or while the global batch warms up a `PartialBatch` of `micro_batches_per_step()`."""
        accumulation = self.cfg.execution.gradient_accumulation
        while self.cfg.training.batch_warmup:
            count = self.micro_batches_per_step()
            if count >= accumulation:
                break  # the ramp never shrinks: the schedule step only grows
            stacked = next(micro_batches(self.loader, count), None)
            if stacked is None:
                return
            yield PartialBatch(stacked, count, self.cfg.global_batch_size * count // accumulation)
        for batch in micro_batches(self.loader, self.session.micro_batches_per_run()):
            if self.curriculum is not None:
                step = self.session.step
                batch = self.curriculum(batch, self.schedule_step(step) / self.cfg.training.steps,
                                        step)
            yield batch

    def micro_batches_per_step(self) -> int:
        """Micro-batches the next optimizer step takes: `warmup_micro_batches` at its schedule
        step (`execution.gradient_accumulation` once warm, or without `training.batch_warmup`).

        Under a time budget `schedule_step` is agreed between the replicas, so they all take
        the same count and their data positions and collectives stay in step."""
        t = self.cfg.training
        return warmup_micro_batches(self.schedule_step(self.session.step),
                                    self.cfg.execution.gradient_accumulation,
                                    t.batch_warmup, t.steps)

    def loop_settings(self) -> LoopSettings:
        """The loop's length and cadences, from `training.*` (no evaluation without held-out
        data)."""
        settings = LoopSettings.from_config(self.cfg, desc=self.job.name)
        return settings if self.validation else dataclasses.replace(settings, eval_every=0,
                                                                    eval_points=0)

    def evaluate(self) -> dict[str, float]:
        """The job's evaluation of the current weights: pre-training, the `val_*` means over
        the held-out batches ({} without validation data); fine-tuning, the task metric on
        `finetune.eval_file` (also written to `eval_results.json`)."""
        return self.job.evaluate(self)

    def save_checkpoint(self) -> Path:
        """Checkpoint the run at the session's step (every replica takes part: sharded state and
        RNG states are gathered), unless a weight stopped being finite."""
        session = self.session
        finite = all(bool(torch.isfinite(w).all()) for w in session.weights().values())
        if not all_replicas(session, finite):
            raise TrainingDiverged(session.step, "a weight is not finite",
                                   self.checkpoints.diverged())
        return self.checkpoints.save(session.step, self.job.checkpoint_state(self))

    def _rehearse_finish(self, step_seconds: float) -> None:
        """Under a time budget, right after the run's first step (`train_loop`'s `rehearse`):
        write a checkpoint of that step (so it holds what the final one will: the optimizer's
        moments too), the export and a plot once, into a scratch directory
        (`checkpoints/.tmp-rehearsal-*`: what a kill leaves is tidied at the next start), and
        keep `RESERVE_FACTOR` times as long, plus `RESERVE_SHARE` of the budget, for the real
        ones after the loop. The rehearsal's seconds count against the budget. A budget that
        leaves no room for them after this first step is refused in one line naming the least
        budget (nothing is kept: the step trained in memory only)."""
        budget = self.clock.budget
        assert budget is not None
        before = self.clock.elapsed
        state = self.job.checkpoint_state(self)  # every replica: sharded state is gathered
        if self.replicas.is_main:
            root = self.output_dir / "checkpoints"
            with reported(root):  # a full disk here is the one line it is everywhere
                root.mkdir(parents=True, exist_ok=True)
                scratch_dir = tempfile.TemporaryDirectory(dir=root, prefix=".tmp-rehearsal-")
            with scratch_dir as scratch, reported(root):
                ckpt.save_checkpoint(Path(scratch) / "checkpoint",
                                     ckpt.Checkpoint.from_state(state), self.config_yaml,
                                     self.checkpoints.graph)
                self.job.export(self, Path(scratch))
                metrics = Path(scratch) / "metrics.jsonl"  # and the plot, drawn at the end
                metrics.write_text(json.dumps({"step": 1, "loss": 1.0, "lr": 0.0}) + "\n")
                plot_if_logged(metrics, Path(scratch) / "metrics.png")
        seconds = self.clock.tick() - before
        self.clock.reserve = RESERVE_FACTOR * seconds + RESERVE_SHARE * budget
        least = self.clock.elapsed + self.clock.reserve
        if not all_replicas(self.session, least < budget):
            # Not even this step fits with its finish: refuse rather than export it late.
            earlier = self._elapsed_before  # trained before this resume
            raise ConfigError(f"training.time_budget is {budget:g} s, but this run's first step "
                              f"took {step_seconds:.3g} s and its final checkpoint and export "
                              f"take about {seconds:.3g} s (measured"
                              f"{f', after {earlier:.0f} s already trained' if earlier else ''}"
                              f"): give it more than {least:.3g} s")
        log.info("time budget: the first step took %.2f s, the final checkpoint and export "
                 "%.2f s: %.2f s kept for them", step_seconds, seconds, self.clock.reserve)

    def _next_work(self) -> float:
        """What the next run of steps carries, for the clock's prediction of its seconds
        (relative: only ratios count): the micro-batches per run (fewer while the global batch
        warms up, `micro_batches_per_step`) times the row length (the curriculum's stage,
        `SequenceCurriculum.length_at`). Local to this replica (no collective): the stop
        itself is agreed by the loop."""
        t = self.cfg.training
        step = min(t.steps - 1, int(self.clock.progress() * t.steps))  # schedule_step's
        per_run = self.session.micro_batches_per_run()
        if t.batch_warmup:
            per_run = min(per_run, warmup_micro_batches(
                step, self.cfg.execution.gradient_accumulation, t.batch_warmup, t.steps))
        length = (self.curriculum.length_at(step / t.steps) if self.curriculum is not None
                  else self.cfg.model.sequence_length)
        return float(per_run * length)

    # -- state ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The run's stateful parts: the session's, the data position and the training seconds
        spent (a resumed run continues the same time budget)."""
        trainer: dict[str, Any] = {"elapsed_s": self.clock.elapsed}
        if self._budget_done:
            trainer["budget_done"] = self.clock.budget
        return {"session": self.session.state_dict(), "loader": self.loader.state_dict(),
                "trainer": trainer}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put the run back where `state` (from `state_dict`, or a checkpoint's) left it."""
        _restore(self.session, self.loader, state)
        self.clock.elapsed = float(state.get("trainer", {}).get("elapsed_s", 0.0))

    def schedule_step(self, step: int) -> int:
        """The schedule's step for optimizer step `step`: itself, or under a time budget the
        step at the spent fraction of the budget (`training.steps` is then the schedule's
        length), the same on every replica."""
        if self.clock.budget is None:
            return step
        steps = self.cfg.training.steps
        # Each replica's clock reads a little differently: all take the furthest (one small
        # all-reduce under replicas), or their learning rates and weights would drift apart.
        return agreed_max(self.session, min(steps - 1, int(self.clock.progress() * steps)))

    def _set_lr(self, step: int) -> None:
        self.lr = set_lr(self.session.optimizer, self.schedule, self.schedule_step(step))

    def _logged_lr(self, step: int) -> float:
        """The rate optimizer step `step` (0-based) trained at, for its record: under a budget
        the one the last step was given (the clock decides it, not the step)."""
        return self.lr if self.clock.budget is not None else self.schedule(step)

    # -- closing --------------------------------------------------------------------------------

    def close(self, error: BaseException | None = None) -> None:
        """Finish the run's side effects: the metrics file, the replicas (when this trainer
        joined them), and — after a failure before anything worth keeping was written — the
        output directory it created; last, the directory's lock goes (also when one of these
        fails). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        try:
            self._close_metrics(None, failing=error is not None)
            if error is not None and not isinstance(error, TrainingDiverged | RunStopped) \
                    and self.replicas.is_main:
                run_dir.remove_if_empty_run(self.output_dir, self._created)
            if self._owns_replicas:
                self.replicas.shutdown(clean=error is None)
        finally:
            if self._claim is not None:
                self._claim.release()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 traceback: TracebackType | None) -> None:
        self.close(error)

    def _close_metrics(self, checkpoint: Path | None, failing: bool = False) -> Path | None:
        """Close the metrics (W&B uploads `checkpoint` if asked) and plot them; a run that
        failed or diverged still gets its plot, and a plotting problem never hides the run's
        own error (`failing`: a full disk is then only a warning)."""
        if self.metrics is None:
            return None
        metrics, self.metrics = self.metrics, None
        try:
            metrics.close(checkpoint=checkpoint)
            return plot_if_logged(self.output_dir / "metrics.jsonl",
                                  self.output_dir / "metrics.png")
        except WriteError as error:
            if not failing:
                raise
            log.warning("%s", error)
            return None


def plot_if_logged(metrics: Path, plot: Path) -> Path:
    """Plot the metrics when any step was logged (a plotting problem is only a warning)."""
    if not metrics.is_file() or not read_metrics(metrics):
        return plot
    try:
        return plot_metrics(metrics, plot)
    except WriteError:  # a full disk is not a plotting problem: the run's outputs are at stake
        raise
    except Exception as error:  # the run's result matters more than its picture
        log.warning("could not plot %s: %s", metrics, error)
        return plot


def last_record(metrics: Path, step: int) -> dict[str, Any]:
    """The record logged at `step` ({} if none): a run resumed at its last step trains nothing,
    and its final metrics are those on file."""
    if not metrics.is_file():
        return {}
    return next((r for r in reversed(read_metrics(metrics)) if r.get("step") == step), {})


def _launch_rank(replicas: Replicas | None) -> int:
    """This process's replica rank before the replicas are joined: the given group's, else
    torchrun's `$RANK` (0 without torchrun). Replica 0 claims the run directory before any
    replica starts, so a refusal ends the job at once (torchrun stops the others)."""
    if replicas is not None:
        return replicas.rank
    if world_size_from_env() == 1:
        return 0
    return rank_from_env()


def _threads_within_quota() -> None:
    """Under a container's CPU quota, torch's threads sized to it (split between torchrun's
    processes on this machine): torch counts the machine's cores, and a pod limited to 4 CPUs
    on a 64-core node would run 64 threads the kernel throttles."""
    processes = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    threads = quota_threads(processes)
    if threads is not None and threads < torch.get_num_threads():
        log.info("torch threads: %d (the container's CPU quota%s; execution.threads to "
                 "choose)", threads, f" over {processes} processes" if processes > 1 else "")
        torch.set_num_threads(threads)


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return Path(a).resolve() == Path(b).resolve()
    except OSError:
        return False


def _replicas_for(cfg: RunConfig, replicas: Replicas | None) -> tuple[Replicas, bool]:
    """The replicas this run uses, and whether the trainer joins (and later leaves) them."""
    if cfg.execution.backend == "popart":  # PopART runs every replica from this one process
        if (replicas.size if replicas is not None else world_size_from_env()) != 1:
            raise ConfigError("execution.backend 'popart' runs its execution.replicas inside "
                              "one process: start it once, not under torchrun")
        return replicas or Replicas.single(), False
    if replicas is None:
        check_world_size(cfg, world_size_from_env())
        return Replicas.single(), True
    if replicas.size != cfg.execution.replicas:
        raise ConfigError(f"execution.replicas is {cfg.execution.replicas} but the given "
                          f"process group has {replicas.size} replicas")
    return replicas, False


def _restore(session: Session, loader: Any, state: dict[str, Any]) -> None:
    """The session's and the data position's parts of a run's state put back."""
    session.load_state_dict(state["session"])
    try:
        loader.load_state_dict(state["loader"])
    except (KeyError, ValueError) as error:
        raise CheckpointError(f"checkpoint's data position does not fit this run's data: "
                              f"{one_line(error, 300)}") from None


__all__ = ["CheckpointManager", "RunResult", "Trainer", "last_record",
           "micro_batches", "plot_if_logged"]
