"""A whole run through the one door, as `popbert pretrain` makes it (for tests that train), and
a clock that makes a time budget independent of the machine's speed."""

from __future__ import annotations

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
