"""The one training loop: every run (`popbert.train.trainer.Trainer`) steps its session here.

Each turn feeds one batch to `session.run` (which may perform several optimizer steps:
`device_iterations`; while the global batch warms up, a `PartialBatch` of fewer micro-batches per
step), logs the window's mean metrics every `log_every` steps (to the progress bar
and `metrics.jsonl`), evaluates every `eval_every` steps, and checkpoints when one is due. A run
ends early when the batches run out, or when it diverged (a loss that is not finite, or more
than `divergence_factor` times the first step's): one line naming the last good checkpoint.
A caller watching the records (`on_record`, a sweep's pruner) may stop the run: `RunStopped`.
SIGTERM or SIGUSR1 (what cluster schedulers send before they kill a job) ends the loop after the
current step, on every replica at the same step (`StopSignals`); the caller then checkpoints and
raises `RunInterrupted`.
"""

from __future__ import annotations

import logging
import math
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from tqdm import tqdm

from popbert.errors import ConfigError, PopbertError
from popbert.observe.tracking import MetricsLogger
from popbert.runtime.protocol import Session

if TYPE_CHECKING:
    from popbert.config import RunConfig
    from popbert.train.trainer import CheckpointManager

log = logging.getLogger(__name__)

Batch = Mapping[str, torch.Tensor]
# Progress-bar fields: metric key → short label.
POSTFIX = {"loss": "loss", "mlm_accuracy": "mlm_acc", "val_loss": "val", "seq_per_s": "seq_s"}


class TrainingDiverged(PopbertError):
    """The loss or the weights stopped being finite and loss scaling did not absorb it."""

    def __init__(self, step: int, what: str, last_good: Path | None):
        where = (f"the last good checkpoint is {last_good}" if last_good is not None
                 else "no checkpoint was written before it")
        super().__init__(f"training diverged at step {step}: {what}; {where} (lower "
                         "optimizer.lr, raise optimizer.warmup_steps, or use loss scaling)")
        self.step = step
        self.last_good = last_good


class RunStopped(PopbertError):
    """A caller's `on_record` asked the run to stop (a pruned sweep trial); the metrics logged so
    far stay on record."""

    def __init__(self, step: int, reason: str = "stopped by the caller"):
        super().__init__(f"run stopped at step {step}: {reason}")
        self.step = step
        self.reason = reason


class RunInterrupted(KeyboardInterrupt):
    """A stop signal ended the run after a step, with a checkpoint of that step to resume from.

    A KeyboardInterrupt, like Ctrl-C, not an error: a sweep agent puts its trial back, and the
    `popbert` command exits with `exit_status`, 128 + the signal's number (143 for SIGTERM, 138
    for SIGUSR1): what a shell reports for a process that signal killed, so a job script's
    requeue rule holds whether the signal came during the run or before it could stop cleanly.
    """

    def __init__(self, step: int, signum: int, checkpoint: Path | None, output_dir: Path,
                 resumable: bool = True):
        name = signal.Signals(signum).name
        # `popbert finetune` has no --resume (`Trainer.from_config(resume=...)` has).
        hint = f"; resume with --resume {output_dir}" if resumable else ""
        super().__init__(f"stopped by {name} at step {step}; checkpoint {checkpoint}{hint}")
        self.step = step
        self.signal = signum
        self.checkpoint = checkpoint
        self.exit_status = 128 + signum


STOP_SIGNALS = ("SIGTERM", "SIGUSR1")


class StopSignals:
    """While a run trains, SIGTERM and SIGUSR1 ask it to stop after its current step instead of
    killing it (the loop ends, the caller checkpoints and raises `RunInterrupted`); a repeated
    signal changes nothing (a scheduler's SIGKILL follows its grace period anyway). Installed
    only in the main thread, where Python runs signal handlers; the previous handlers come
    back on exit."""

    def __init__(self) -> None:
        self.received = 0  # the first stop signal's number (0: none)
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            for name in STOP_SIGNALS:
                number = getattr(signal, name, None)
                if number is not None:
                    self._previous[number] = signal.signal(number, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)
        self._previous.clear()

    def _handle(self, number: int, frame: object) -> None:
        if not self.received:
            self.received = number
            log.warning("%s received: stopping after this step, with a checkpoint",
                        signal.Signals(number).name)


# Called with (step, record) for every logged record; returns a reason (str) to stop the run.
RecordHook = Callable[[int, dict[str, float]], "str | None"]


@dataclass
class LoopResult:
    """What a finished loop leaves: the steps this call trained and the last logged record."""

    steps_trained: int
    seconds: float
    record: dict[str, float] = field(default_factory=dict)
    checkpoint: Path | None = None  # the last good checkpoint
    stop_signal: int = 0  # the signal (`StopSignals`) that ended the loop early, 0 if none
    evaluation_s: float = 0.0  # of `seconds`, spent evaluating (outside a time budget)


@dataclass(frozen=True)
class PartialBatch:
    """A run's batch while the global batch warms up (`training.batch_warmup`): each optimizer
    step takes `micro_batches` micro-batches, fewer than the session's `gradient_accumulation`,
    and trains on `samples` sequences (over all replicas), which `seq_per_s` and the record's
    `batch_size` report."""

    tensors: Batch
    micro_batches: int
    samples: int


EVAL_SHARE = 0.25  # training.eval_share's default: the most of a budget evaluations may take
FEWEST_BATCHES = 4  # a budget's evaluations lose points before they fall below these batches


@dataclass(frozen=True)
class EvalPlan:
    """What a budgeted run evaluates, sized to `training.eval_share` of its budget before it
    trains (`plan_evaluations`): at `points` fractions of the budget (0: by `eval_every`
    instead) on the first `batches` validation micro-batches, about `seconds` each."""

    points: int
    batches: int
    seconds: float


def plan_evaluations(points: int, batches: int, batch_seconds: float, allowed: float
                     ) -> EvalPlan:
    """The evaluations that fit in `allowed` seconds, a validation batch taking
    `batch_seconds`. With `points`: all of them on all `batches` when they fit; else fewer
    batches, down to `FEWEST_BATCHES` (fewer make a noisy measure), then fewer points, down to
    one (the final weights'), then fewer batches, down to one. By `eval_every` (`points` 0)
    how many evaluations a budget holds is not known before it is run: one of them is made to
    fit, and the loop stops evaluating once the share is spent. A plan whose one evaluation of
    one batch does not fit has `seconds` above `allowed` (the caller refuses it)."""
    def most(evaluations: int) -> int:  # batches that many evaluations fit in `allowed`
        return math.floor(allowed / (evaluations * batch_seconds) + 1e-9)

    p, b = points, batches
    if batch_seconds > 0 and max(p, 1) * b * batch_seconds > allowed:
        if p:
            b = max(min(batches, FEWEST_BATCHES), most(p))
            if p * b * batch_seconds > allowed:
                p = max(1, math.floor(allowed / (b * batch_seconds) + 1e-9))
        if b * batch_seconds > allowed:
            b = max(1, most(1))
    return EvalPlan(p, b, b * batch_seconds)


@dataclass(frozen=True)
class LoopSettings:
    """How long the loop runs and how often it logs and evaluates (`training.*`)."""

    steps: int
    log_every: int = 10
    eval_every: int = 0
    eval_points: int = 0  # under a budget: evaluate at k / eval_points of it, and at the end
    eval_share: float = EVAL_SHARE  # under a budget: the most of it evaluations may take
    divergence_factor: float = 0.0  # 0: only a non-finite loss counts as diverged
    samples_per_step: int = 0  # sequences per optimizer step, for seq_per_s (0: not logged)
    desc: str = "train"  # the progress bar's label

    @classmethod
    def from_config(cls, cfg: RunConfig, desc: str = "train") -> LoopSettings:
        t = cfg.training
        return cls(steps=t.steps, log_every=t.log_every, eval_every=t.eval_every,
                   eval_points=t.eval_points if t.time_budget else 0,
                   eval_share=t.eval_share if t.eval_share is not None else EVAL_SHARE,
                   divergence_factor=t.divergence_factor,
                   samples_per_step=cfg.global_batch_size, desc=desc)


class TrainingClock:
    """Training seconds since the run began, summed over resumes (`elapsed_s` in every record),
    and the budget they may reach (`training.time_budget`, None: none). Steps, checkpoints and
    logging count; validation does not (`skip`).

    Under a budget the loop stops before the next run of steps would end past
    `budget - reserve` (`out_of_time`), where the caller keeps `reserve` seconds for what it
    writes after the loop (the final checkpoint and export: measured by a rehearsal). The next
    run's seconds are predicted from the measured ones (`expect`): runs of the same work (`work`,
    set by the caller: what the next run carries, e.g. micro-batches x row length, so a growing
    batch or a longer curriculum stage is known before it is run) take the longest of their
    recent ones; a run of work not measured yet is scaled up from the runs measured.
    """

    RECENT = 8  # runs of one work remembered: the prediction follows a machine that slows down

    def __init__(self, budget: float | None = None, elapsed: float = 0.0,
                 now: Callable[[], float] = time.perf_counter):
        self.budget = budget
        self.elapsed = float(elapsed)
        self.reserve = 0.0
        # The next run's work (relative: only ratios matter); None: every run the same.
        self.work: Callable[[], float] | None = None
        self._now = now
        self._mark: float | None = None
        self._runs: dict[float, deque[float]] = {}  # recent seconds of runs, by their work
        self._counts: dict[float, int] = {}
        self._next_work = 1.0

    def start(self) -> None:
        self._mark = self._now()

    def read(self) -> float:
        """The clock's time now (seconds; what `tick` counts from), without counting it."""
        return self._now()

    def tick(self) -> float:
        """Add the seconds since the last tick (or `start`); the elapsed seconds."""
        now = self._now()
        if self._mark is not None:
            self.elapsed += now - self._mark
        self._mark = now
        return self.elapsed

    def skip(self) -> None:
        """Leave the seconds since the last tick uncounted (validation: the run's quality is
        measured, not trained, so how often it is measured does not move its curve)."""
        self._mark = self._now()

    def progress(self) -> float:
        """The fraction of the budget spent (0 without a budget)."""
        return min(1.0, self.elapsed / self.budget) if self.budget else 0.0

    def expect(self) -> float:
        """The predicted seconds of the next run of steps (0 before any was measured): the
        longest recent run of the same work, else the measured runs scaled up to its work (a
        run of twice the micro-batches, or of rows twice as long, as twice the time: an upper
        bound, since per-step costs do not grow and attention grows at most so)."""
        work = self.work() if self.work is not None else 1.0
        self._next_work = work
        same = self._runs.get(work)
        if same:
            return max(same)
        return max((max(seconds) * max(1.0, work / done)
                    for done, seconds in self._runs.items()), default=0.0)

    def measured(self, seconds: float) -> None:
        """Record the run just done (its steps and logging; not its checkpoint, evaluation or
        rehearsal) under the work `expect` saw before it. The first run of each work pays what
        is done once (allocations, kernels chosen or compiled for its shapes), so the second
        replaces it."""
        work = self._next_work
        count = self._counts[work] = self._counts.get(work, 0) + 1
        runs = self._runs.setdefault(work, deque(maxlen=self.RECENT))
        if count == 2:
            runs.clear()
        runs.append(seconds)

    def out_of_time(self) -> bool:
        """Whether the next run of steps, as long as `expect` predicts, would end past the
        budget less the reserve (never without a budget)."""
        return self.budget is not None and \
            self.elapsed + self.expect() + self.reserve > self.budget


def train_loop(session: Session, batches: Iterator[Batch | PartialBatch],
               settings: LoopSettings, *,
               schedule: Callable[[int], float] | None = None,
               tracker: MetricsLogger | None = None,
               checkpoints: CheckpointManager | None = None,
               save: Callable[[], Path] | None = None,
               validation: Sequence[Batch] | None = None,
               on_record: RecordHook | None = None,
               clock: TrainingClock | None = None,
               stop: StopSignals | None = None,
               rehearse: Callable[[float], None] | None = None) -> LoopResult:
    """Train until the session reaches `settings.steps` optimizer steps, or, when `clock` has a
    budget, until the next run of steps would overrun it (or until `batches` runs out).

    A `PartialBatch` runs its steps on fewer micro-batches (batch-size warmup): the records of
    its window carry `batch_size`, and `seq_per_s` counts the sequences actually trained on.
    `schedule` is only read to log the learning rate (the session's step hook sets it).
    `checkpoints` says when a checkpoint is due and which one is good; `save()` writes one (the
    final checkpoint is the caller's). Under replicas every replica runs this loop; only replica
    0 logs and shows the bar. `validation`: micro-batches evaluated after every step that is a
    multiple of `eval_every` (so a resumed run evaluates at the same steps); their `val_*` means
    go into that step's record, logged even when it is not a `log_every` step.
    `on_record(step, record)` sees every logged record on every replica; a reason (str) returned
    on any replica stops all of them at once with `RunStopped` (after the record is logged).
    `clock` counts the training seconds (`elapsed_s` in every record; a resumed run's clock
    starts where the checkpoint's stopped). A signal `stop` caught on any replica ends the loop
    after the current step on all of them (the largest signal number, agreed once a step) unless
    that step was the last; `LoopResult.stop_signal` says which. `rehearse(step_seconds)` is
    called once, right after the first run of steps (under a budget: the caller measures its
    finish there, on the weights and optimizer state of a trained step, and may refuse the
    budget); its seconds, and a due checkpoint's, are not part of the run's measured time.
    Under a budget, evaluations are outside it but sized to `settings.eval_share` of it before
    the first step (`_size_evaluations`: fewer points or batches, said in one line), and one
    that would take them past the share on a machine that slowed down is left out.
    """
    clock = clock if clock is not None else TrainingClock()
    budgeted = clock.budget is not None
    steps, log_every, eval_every = settings.steps, settings.log_every, settings.eval_every
    divergence_factor, samples_per_step = settings.divergence_factor, settings.samples_per_step
    if (eval_every or settings.eval_points) and not validation:
        raise ValueError("eval_every (or eval_points) needs validation batches")
    points = settings.eval_points if budgeted else 0
    allowed = math.inf  # the seconds evaluations may take (training.eval_share of a budget)
    evaluation_s = 0.0
    each = 0.0  # the longest evaluation's seconds (planned, then measured)
    if budgeted and validation and (points or eval_every):
        assert clock.budget is not None
        plan, evaluation_s, allowed = _size_evaluations(session, validation, clock, points,
                                                        eval_every, settings.eval_share)
        validation, points, each = validation[:plan.batches], plan.points, plan.seconds
    next_point = _next_point(clock.progress(), points)  # a resumed run: the next one ahead
    spent = evaluation_s  # seconds of this loop's evaluations, counted against `allowed`
    told_share = False
    replicas = session.replicas
    first_step = session.step
    window: dict[str, list[float]] = {}
    sizes: list[int] = []  # the window's global batch of each step (0: not known)
    warming = False  # a step of the window took a PartialBatch
    record: dict[str, float] = {}
    # Under a budget the bar counts seconds (and shows the step), else steps.
    bar = tqdm(total=round(clock.budget) if budgeted else steps,
               initial=round(clock.elapsed) if budgeted else session.step, desc=settings.desc,
               unit="s" if budgeted else "step", dynamic_ncols=True,
               disable=not replicas.is_main)
    started = window_start = time.perf_counter()
    clock.start()
    limit: float | None = None  # the loss above which the run has blown up
    shown: dict[str, float] = {}  # the bar keeps the last validation loss between evaluations
    last_step = sys.maxsize if budgeted else steps  # the final checkpoint's step, when known
    stop_signal = 0
    try:
        while _more(session, steps, clock):
            batch = next(batches, None)
            if batch is None:
                break
            run_started = clock.elapsed
            excluded = 0.0  # seconds of this turn that are not its steps' (rehearsal, saving)
            if isinstance(batch, PartialBatch):
                outputs = session.run(batch.tensors, micro_batches=batch.micro_batches)
                size, warming = batch.samples, True
            else:
                outputs = session.run(batch)
                size = samples_per_step
            steps_done = int(outputs[session.loss_name].shape[0])
            sizes.extend([size] * steps_done)
            for key, values in outputs.items():
                window.setdefault(key, []).extend(values.float().tolist())
            losses = outputs[session.loss_name].float()
            if limit is None and divergence_factor and bool(torch.isfinite(losses[0])):
                limit = divergence_factor * max(float(losses[0]), 1.0)
            bad = _first_bad(losses, limit, session)
            if bad is not None:
                step = session.step - steps_done + bad + 1
                _log(session, window, step, schedule, tracker, sizes, warming,
                     time.perf_counter() - window_start,
                     elapsed=clock.tick())  # the diverged step is on the record
                loss = float(losses[bad])
                what = ("the loss is not finite" if not math.isfinite(loss) else
                        f"the loss {loss:.4g} exceeds {divergence_factor:g}× the first step's "
                        f"(training.divergence_factor)")
                raise TrainingDiverged(step, what,
                                       checkpoints.diverged() if checkpoints else None)
            if checkpoints is not None:
                checkpoints.confirm()
            if rehearse is not None:
                before, rehearsal_started = clock.tick(), time.perf_counter()
                rehearse(before - run_started)  # ends with a tick of the clock
                rehearse = None
                excluded += clock.elapsed - before
                window_start += time.perf_counter() - rehearsal_started  # seq_per_s: training
            if not budgeted:
                bar.update(steps_done)
            evaluated = None
            clock.tick()
            at_point = False
            if points:
                # Each replica's clock reads a little differently; evaluation is collective,
                # so all evaluate when any one reached the point.
                at_point = not all_replicas(session, clock.progress() < next_point) \
                    and next_point < 1 - 1e-9  # the last point is the final weights' (below)
                if at_point:  # a replica short of the point moves past it with the others
                    next_point = _next_point(max(clock.progress(), next_point), points)
            due = at_point or bool(eval_every and session.step % eval_every < steps_done)
            if due and allowed < math.inf:
                # A machine that got slower: an evaluation that would take them past the share
                # (with eval_points, keeping one for the final weights) is left out.
                room = spent + each * (2 if points else 1) <= allowed * (1 + 1e-9)
                due = all_replicas(session, room)
                if not due and not told_share:
                    told_share = True
                    log.info("evaluation: none after step %d: another would take the %.1f s "
                             "spent evaluating past %g%% of the %g s budget "
                             "(training.eval_share)%s", session.step, spent,
                             100 * settings.eval_share, clock.budget,
                             "; the final weights are still measured" if points else "")
            if due:
                clock.tick()
                eval_started, eval_read = time.perf_counter(), clock.read()
                evaluated = evaluate(session, validation)
                eval_seconds = clock.read() - eval_read
                spent += eval_seconds
                evaluation_s += eval_seconds
                each = max(each, eval_seconds)
                window_start += time.perf_counter() - eval_started  # seq_per_s: training only
                clock.skip()  # measuring is not training: curves against elapsed_s stay fair
            if session.step % log_every < steps_done or session.step >= last_step or evaluated:
                record = _log(session, window, session.step, schedule, tracker, sizes,
                              warming, time.perf_counter() - window_start, clock.tick(),
                              evaluated)
                shown = {**shown, **record}
                bar.set_postfix({**({"step": session.step} if budgeted else {}),
                                 **{label: f"{shown[key]:.3f}" if key != "seq_per_s"
                                    else f"{shown[key]:.0f}"
                                    for key, label in POSTFIX.items() if key in shown}})
                window, sizes, warming, window_start = {}, [], False, time.perf_counter()
                if on_record is not None:
                    reason = on_record(session.step, dict(record))
                    if not all_replicas(session, not reason):
                        raise RunStopped(session.step, reason or "another replica stopped")
            if save is not None and checkpoints is not None \
                    and checkpoints.due(session.step, steps_done, last_step):
                before = clock.tick()
                save()
                excluded += clock.tick() - before
            else:
                clock.tick()
            if budgeted:
                clock.measured(clock.elapsed - run_started - excluded)
                bar.update(round(clock.elapsed) - bar.n)
            if stop is not None and session.step < last_step:
                # Each replica may catch the signal at a different step: all stop at the first
                # step after which any of them had it, so their checkpoint is one.
                stop_signal = agreed_max(session, stop.received)
                if stop_signal:
                    break
        evaluated = None
        measured = record.get("step") == session.step and any(k.startswith("val_")
                                                              for k in record)
        if points and not measured and not stop_signal:
            clock.tick()  # with eval_points the run's final weights are measured too
            eval_read = clock.read()
            evaluated = evaluate(session, validation)
            evaluation_s += clock.read() - eval_read
            clock.skip()
        if budgeted and (window or evaluated):  # the budget ended the run between two logs
            record = _log(session, window, session.step, schedule, tracker, sizes, warming,
                          time.perf_counter() - window_start, clock.tick(), evaluated)
    finally:
        bar.close()
    seconds = time.perf_counter() - started
    trained = session.step - first_step
    log.info("trained %d steps (%d → %d) in %.1f s%s", trained, first_step, session.step,
             seconds, f" ({clock.elapsed:.1f} s of the {clock.budget:g} s budget)"
             if budgeted else "")
    return LoopResult(trained, seconds, record,
                      checkpoints.last_good if checkpoints else None, stop_signal, evaluation_s)


def _more(session: Session, steps: int, clock: TrainingClock) -> bool:
    """Whether to run another batch: steps left, or (under a budget) time left on every
    replica (they stop together)."""
    if clock.budget is None:
        return session.step < steps
    return all_replicas(session, not clock.out_of_time())


def evaluate(session: Session, validation: Sequence[Batch]) -> dict[str, float]:
    """`val_<output>` for every scalar output: its mean over this replica's validation
    micro-batches, then over the replicas (as training metrics are)."""
    values: dict[str, list[float]] = {}
    for batch in validation:
        for key, value in session.evaluate(batch).items():
            if value is not None and value.dim() == 0:
                values.setdefault(f"val_{key}", []).append(float(value.float()))
    return _window_means(values, session)


def _size_evaluations(session: Session, validation: Sequence[Batch], clock: TrainingClock,
                      points: int, eval_every: int, share: float
                      ) -> tuple[EvalPlan, float, float]:
    """Before a budgeted run trains: time one validation batch (the second evaluated: the first
    pays what is done once), the slowest replica's, and size the evaluations to what is left of
    `share` of the budget after that timing (`plan_evaluations`), said in one line. Returns the
    plan, the timing's seconds and the seconds the evaluations may take, the timing's included.
    One evaluation of one batch that does not fit in the share is refused (`ConfigError`): such
    a run would measure nothing it was asked to."""
    budget = clock.budget
    assert budget is not None
    started = clock.read()
    session.evaluate(validation[0])
    probed = clock.read()
    session.evaluate(validation[min(1, len(validation) - 1)])
    finished = clock.read()
    batch_seconds, timing = _agreed_max_seconds(session, finished - probed, finished - started)
    allowed = share * budget
    knob = "training.eval_points" if points else "training.eval_every"
    if batch_seconds > allowed:
        raise ConfigError(
            f"training.time_budget is {budget:g} s, but one evaluation of a single validation "
            f"batch takes {batch_seconds:.3g} s, more than training.eval_share {share:g} of it "
            f"({allowed:.3g} s): give a budget of at least {math.ceil(batch_seconds / share)} s, "
            f"a training.eval_share of at least {math.ceil(100 * batch_seconds / budget) / 100:g}"
            f", or set {knob}=0")
    # A slow first batch (compilation) may leave less than one batch: the final one still runs.
    plan = plan_evaluations(points, len(validation), batch_seconds,
                            max(allowed - timing, batch_seconds))
    asked = (f"at most {100 * share:g}% of the {budget:g} s budget ({allowed:.3g} s) with "
             f"{timing:.1f} s timing it")
    if points:
        total = plan.points * plan.seconds
        smaller = (f"; the {_count(points, 'point')} of {len(validation)} batches asked for "
                   f"would take {points * len(validation) * batch_seconds:.3g} s"
                   if (plan.points, plan.batches) != (points, len(validation)) else "")
        over = timing + total > budget
        (log.warning if over else log.info)(
            "evaluation: %s of %s, about %.3g s in all (a batch %.2g s), %s%s%s; "
            "evaluations are outside the budget", _count(plan.points, "point"),
            _count(plan.batches, "batch"), total,
            batch_seconds, "longer than the budget itself: " if over else "", asked, smaller)
    else:
        log.info("evaluation: every %d steps on %s, about %.2g s each (a batch %.2g s); "
                 "they stop before they pass %s%s; evaluations are outside the budget",
                 eval_every, _count(plan.batches, "batch"), plan.seconds, batch_seconds, asked,
                 f" (of {len(validation)} batches)" if plan.batches < len(validation) else "")
    return plan, timing, max(allowed, timing + plan.seconds)


def _count(n: int, noun: str) -> str:
    """`1 point`, `4 points`, `1 batch`, `4 batches`."""
    return f"{n} {noun}" if n == 1 else f"{n} {noun}{'es' if noun.endswith('ch') else 's'}"


def _agreed_max_seconds(session: Session, *seconds: float) -> tuple[float, ...]:
    """Each of `seconds`' largest value over the replicas (one small all-reduce under
    replicas)."""
    replicas = session.replicas
    if not replicas.distributed:
        return seconds
    tensor = torch.tensor(seconds, dtype=torch.float64, device=_collective_device(session))
    replicas.all_reduce_(tensor, op="max")
    return tuple(tensor.tolist())


def _first_bad(losses: torch.Tensor, limit: float | None, session: Session
               ) -> int | None:
    """Index of the first loss of a run() that is not finite or above `limit` (agreed over the
    replicas: they all stop, or none), or None."""
    good = torch.isfinite(losses)
    if limit is not None:
        good &= losses <= limit
    if all_replicas(session, bool(good.all())):
        return None
    bad = (~good).nonzero()
    return int(bad[0]) if len(bad) else 0


def all_replicas(session: Session, flag: bool) -> bool:
    """Whether `flag` holds on every replica (one small all-reduce under replicas)."""
    replicas = session.replicas
    if not replicas.distributed:
        return flag
    value = torch.tensor([0.0 if flag else 1.0], device=_collective_device(session))
    replicas.all_reduce_(value)
    return float(value) == 0.0


def _next_point(progress: float, points: int) -> float:
    """The next fraction k / points of the budget beyond `progress` (0 without points)."""
    return (math.floor(progress * points + 1e-9) + 1) / points if points else 0.0


def agreed_max(session: Session, value: int) -> int:
    """The largest `value` over the replicas (one small all-reduce under replicas): what they
    all use where each one's own clock may read a little differently."""
    replicas = session.replicas
    if not replicas.distributed:
        return value
    tensor = torch.tensor([float(value)], dtype=torch.float64, device=_collective_device(session))
    replicas.all_reduce_(tensor, op="max")
    return int(tensor.item())


def _collective_device(session: Session) -> torch.device:
    return session.device if session.device.type == "cuda" else torch.device("cpu")


def _log(session: Session, window: dict[str, list[float]], step: int,
         schedule: Callable[[int], float] | None, tracker: MetricsLogger | None,
         sizes: Sequence[int], warming: bool, window_seconds: float, elapsed: float,
         evaluated: dict[str, float] | None = None) -> dict[str, Any]:
    """One metrics record: the window's means (over the replicas too), lr, throughput, and the
    validation metrics when this step evaluated.

    `sizes`: the global batch of each step of the window (0 where unknown: no `seq_per_s`
    then). A window with a step of a warming-up batch (`warming`) logs its last step's batch as
    `batch_size`, so the ramp is on record up to the record where it reached the full batch."""
    record: dict[str, Any] = {"step": step}
    if schedule is not None:
        record["lr"] = schedule(step - 1)
    record.update(_window_means(window, session))
    if sizes and all(sizes) and window:
        record["seq_per_s"] = sum(sizes) / max(window_seconds, 1e-9)
    if warming and sizes:
        record["batch_size"] = sizes[-1]
    record["elapsed_s"] = round(elapsed, 3)
    if session.loss_scaler is not None:
        record["skipped_steps"] = session.loss_scaler.skipped_steps
    record.update(evaluated or {})
    if tracker is not None:
        tracker.log(record)
    return record


def _window_means(window: dict[str, list[float]], session: Session) -> dict[str, float]:
    """Each metric's mean over the log window, and over the replicas (one small all-reduce)."""
    means = {k: float(np.mean(v)) if v else math.nan for k, v in window.items()}
    replicas = session.replicas
    if not replicas.distributed or not means:
        return means
    values = torch.tensor(list(means.values()), dtype=torch.float64,
                          device=_collective_device(session))
    replicas.all_reduce_(values)
    return dict(zip(means, (values / replicas.size).tolist()))


__all__ = ["EVAL_SHARE", "STOP_SIGNALS", "EvalPlan", "LoopResult", "LoopSettings", "PartialBatch",
           "RecordHook", "RunInterrupted", "RunStopped", "StopSignals", "TrainingClock",
           "TrainingDiverged", "agreed_max", "all_replicas", "evaluate", "plan_evaluations",
           "train_loop"]
