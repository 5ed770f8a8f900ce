"""Which job a run's config describes: pre-training, or the fine-tuning task `finetune.task`
names (`popbert.tasks`). The one place that knows the jobs, so the `Trainer`, which runs any
`Job`, names none of them."""

from __future__ import annotations

from pathlib import Path

from popbert.config import RunConfig
from popbert.train.finetune import finetune_job
from popbert.train.jobs import Job
from popbert.train.pretrain import PretrainingJob


def make_job(cfg: RunConfig, output_dir: Path) -> Job:
    """The job `cfg` describes: pre-training, or the fine-tuning task `finetune.task` names."""
    if cfg.finetune.task is None:
        return PretrainingJob(cfg)
    return finetune_job(cfg, output_dir)


__all__ = ["make_job"]
