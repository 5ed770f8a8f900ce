"""What a kind of run brings to the `Trainer`: its graph's task, data, starting weights, and what
it writes at the end. `popbert.train.pretrain.PretrainingJob` and the fine-tuning jobs of
`popbert.train.finetune` fill these in; everything else about a run is the Trainer's."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import onnx
import torch

from popbert.config import RunConfig, warn_config

if TYPE_CHECKING:
    from popbert.io.checkpoint import Checkpoint
    from popbert.runtime.protocol import Session
    from popbert.train.trainer import Trainer


class Job:
    """The parts of a run that depend on what is trained. `config` is the run's resolved config
    (a fine-tuning job derives its model and step count from the checkpoint and the data)."""

    name = "train"  # the progress bar's label
    task = "pretraining"  # the graph's task head (`popbert.builders.bert.build_bert`)
    metric_keys: tuple[str, ...] = ("loss",)  # logged metrics a RunResult reports

    def __init__(self, cfg: RunConfig):
        warn_config(cfg)  # the run's own config: the one whose questionable settings matter
        self.config = cfg
        self.graph: onnx.ModelProto | None = None  # the training graph, once built

    def check(self, cfg: RunConfig) -> None:
        """What this machine or backend cannot run, said before anything starts."""

    def check_resume(self, restored: Checkpoint) -> None:
        """Whether a checkpoint can be resumed by this job."""

    def load_data(self) -> None:
        """Read the data (before any replica starts: a bad file fails at once)."""

    def loader(self, rank: int, size: int) -> Any:
        """This replica's micro-batches: an iterator with `state_dict` / `load_state_dict` and
        `num_samples`."""
        raise NotImplementedError

    def validation(self, rank: int, size: int) -> list[dict[str, torch.Tensor]] | None:
        """Held-out micro-batches evaluated every `training.eval_every` steps."""
        return None

    def load_initial_weights(self, session: Session,
                             weights: dict[str, torch.Tensor] | None) -> list[str]:
        """Load the starting weights into the session; the names that start fresh."""
        return []

    def write_inputs(self, output_dir: Path) -> None:
        """Files the run directory needs besides config.yaml (replica 0, at the start)."""

    def graph_to_save(self) -> onnx.ModelProto | None:
        """The graph written as model.onnx and into every checkpoint (None: rebuilt from the
        config)."""
        return self.graph

    def checkpoint_state(self, trainer: Trainer) -> dict[str, Any]:
        """What a checkpoint holds: by default every stateful part (resumable)."""
        return trainer.state_dict()

    def score(self, trainer: Trainer) -> dict[str, float]:
        """The end-of-run evaluation of the trained weights ({}: none)."""
        return {}

    def evaluate(self, trainer: Trainer) -> dict[str, float]:
        """The job's evaluation of the current weights (by default its end-of-run score)."""
        return self.score(trainer)

    def export(self, trainer: Trainer, directory: Path | None = None) -> Path | None:
        """The inference model written at the end (replica 0) into `directory` (default: the
        run directory), or None."""
        return None


__all__ = ["Job"]
