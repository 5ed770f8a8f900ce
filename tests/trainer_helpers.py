"""A whole run through the one door, as `popbert pretrain` makes it (for tests that train), and
clocks that make a time budget independent of the machine's speed: one that counts its
readings, and one whose steps, checkpoints and exports take the seconds a test writes down."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from popbert.config import RunConfig
from popbert.train import trainer as trainer_module
from popbert.train.loop import TrainingClock
from popbert.train.trainer import RunResult, Trainer


def run_pretraining(cfg: RunConfig, output_dir: str | Path, **kwargs: Any) -> RunResult:
    """`Trainer.from_config(cfg, output_dir, **kwargs)`, trained and closed."""
    with Trainer.from_config(cfg, output_dir, **kwargs) as trainer:
        return trainer.train()


class CountingClock:
    """Training seconds that do not depend on the machine: every reading is `tick` seconds after
    the one before. A budgeted run's clock reads a fixed number of times per step, so the same
    budget trains the same steps on a fast machine and on one loaded to 5."""

    def __init__(self, tick: float):
        self.tick = tick
        self.now = 0.0
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        self.now += self.tick
        return self.now


def count_budget_time(monkeypatch: pytest.MonkeyPatch, tick: float = 0.05) -> CountingClock:
    """Make every run the test starts in this process keep its time budget on a
    `CountingClock` (the decisions of the budget logic, not how many steps a real clock
    allowed, are what a test can assert)."""
    clock = CountingClock(tick)

    def make(budget: float | None = None, elapsed: float = 0.0) -> TrainingClock:
        return TrainingClock(budget, elapsed, now=clock)

    monkeypatch.setattr(trainer_module, "TrainingClock", make)
    return clock


class ModelledTime:
    """A machine whose speed the test writes down: seconds pass only where this model says. A
    training step takes `step(rows, length)` seconds for its batch's shape (so a curriculum's
    short rows, or a warming global batch, cost what the model says they do), each checkpoint
    written `checkpoint` seconds, each export `export`, each plot `plot`, each evaluated
    micro-batch `evaluation`, and each reading of the clock `reading` (the loop's own work).
    A budgeted run then stops where it would on such a machine, however loaded this one is;
    `evaluated` sums the evaluation seconds (which a budget does not count)."""

    def __init__(self, step: Callable[[int, int], float], checkpoint: float = 0.0,
                 export: float = 0.0, plot: float = 0.0, evaluation: float = 0.0,
                 reading: float = 0.0):
        self.step = step
        self.checkpoint, self.export, self.plot = checkpoint, export, plot
        self.evaluation, self.reading = evaluation, reading
        self.now = 0.0
        self.evaluated = 0.0
        self.shapes: list[tuple[int, int]] = []  # (rows, length) of every step, in order

    def __call__(self) -> float:
        self.now += self.reading
        return self.now


def model_budget_time(monkeypatch: pytest.MonkeyPatch, model: ModelledTime) -> ModelledTime:
    """Make every run the test starts in this process keep its time budget in `model`'s
    seconds (see `ModelledTime`; the session, checkpoint, export and plot still do their work,
    the clock only reads the model)."""
    from popbert.io import checkpoint as ckpt
    from popbert.runtime.session import TrainingSession
    from popbert.train.pretrain import PretrainingJob

    run, evaluate = TrainingSession.run, TrainingSession.evaluate
    save, export, plot = ckpt.save_checkpoint, PretrainingJob.export, trainer_module.plot_if_logged

    def timed_run(self: TrainingSession, batch: Any, micro_batches: int | None = None) -> Any:
        rows, length = batch["input_ids"].shape
        model.shapes.append((int(rows), int(length)))
        model.now += model.step(int(rows), int(length))
        return run(self, batch, micro_batches)

    def timed_evaluate(self: TrainingSession, batch: Any) -> Any:
        model.now += model.evaluation
        model.evaluated += model.evaluation
        return evaluate(self, batch)

    def timed(function: Callable[..., Any], seconds: Callable[[], float]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            model.now += seconds()
            return function(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(TrainingSession, "run", timed_run)
    monkeypatch.setattr(TrainingSession, "evaluate", timed_evaluate)
    monkeypatch.setattr(ckpt, "save_checkpoint", timed(save, lambda: model.checkpoint))
    monkeypatch.setattr(PretrainingJob, "export", timed(export, lambda: model.export))
    monkeypatch.setattr(trainer_module, "plot_if_logged", timed(plot, lambda: model.plot))

    def make(budget: float | None = None, elapsed: float = 0.0) -> TrainingClock:
        return TrainingClock(budget, elapsed, now=model)

    monkeypatch.setattr(trainer_module, "TrainingClock", make)
    return model
