"""A whole run through the one door, as `popbert pretrain` makes it (for tests that train)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from popbert.config import RunConfig
from popbert.train.trainer import RunResult, Trainer


def run_pretraining(cfg: RunConfig, output_dir: str | Path, **kwargs: Any) -> RunResult:
    """`Trainer.from_config(cfg, output_dir, **kwargs)`, trained and closed."""
    with Trainer.from_config(cfg, output_dir, **kwargs) as trainer:
        return trainer.train()
