"""The pre-training job: MLM/NSP on the bundled corpus or HDF5 shards, exported at the end.

`PretrainingJob` is what a pre-training run brings to the `Trainer` (its data, its validation
batches, the graph saved with each checkpoint, the ONNX export).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import torch

from popbert.backends import BackendUnavailable, import_popart
from popbert.backends.popart import check_run_config
from popbert.config import RunConfig
from popbert.data.pretraining import (
    ShardSet,
    load_training_data,
    load_validation_data,
    make_loader,
    validation_batches,
)
from popbert.errors import ConfigError
from popbert.export.inference import export_weights
from popbert.runtime.devices import resolve_device
from popbert.runtime.protocol import Session
from popbert.train.jobs import Job
from popbert.train.loop import evaluate

log = logging.getLogger(__name__)

METRIC_KEYS = ("loss", "mlm_loss", "nsp_loss", "mlm_accuracy", "nsp_accuracy")
METRIC_KEYS = METRIC_KEYS + tuple(f"val_{k}" for k in METRIC_KEYS)


def check_supported(cfg: RunConfig) -> None:
    """What this machine or backend cannot run, said before anything starts: the PopART backend
    where Graphcore's SDK is not importable, or a setting it cannot translate."""
    e = cfg.execution
    if e.backend == "popart":
        try:
            import_popart()
        except BackendUnavailable as error:
            raise BackendUnavailable(f"execution.backend is 'popart': {error}") from None
        check_run_config(cfg)
    if e.recompute and not e.pipeline:
        m = cfg.model
        checkpoints = sum(max(n - 1, 0) for n in m.layers_per_ipu or []) if m.recompute else 0
        if not checkpoints:
            raise ConfigError(
                "execution.recompute needs checkpoints in the graph: set model.recompute=true "
                "and model.layers_per_ipu with a device holding 2+ layers (a checkpoint goes on "
                f"every layer output except each device's last; got model.recompute="
                f"{str(m.recompute).lower()}, model.layers_per_ipu={m.layers_per_ipu}), or "
                "execution.pipeline=true")
    if e.backend == "torch":
        resolve_device(e.device)  # a device that is not there: one line, now


class PretrainingJob(Job):
    """MLM + NSP pre-training (`finetune.task: null`)."""

    name = "pretrain"
    metric_keys = METRIC_KEYS

    def __init__(self, cfg: RunConfig):
        super().__init__(cfg)
        self.data: dict[str, np.ndarray] | ShardSet | None = None
        self.held_out: dict[str, np.ndarray] | ShardSet | None = None

    def check(self, cfg: RunConfig) -> None:
        check_supported(cfg)

    def load_data(self) -> None:
        self.data = load_training_data(self.config)
        self.held_out = load_validation_data(self.config)

    def loader(self, rank: int, size: int):
        return make_loader(self.config, self.data, rank, size)

    def validation(self, rank: int, size: int) -> list[dict[str, torch.Tensor]] | None:
        return validation_batches(self.config, self.held_out, rank, size)

    def load_initial_weights(self, session: Session,
                             weights: dict[str, torch.Tensor] | None) -> list[str]:
        if weights is None:
            return []
        kept = matching_weights(weights, session)
        session.load_weights(kept, strict=False)
        return sorted(set(dict(session.named_parameters)) - set(kept))

    def evaluate(self, trainer) -> dict[str, float]:
        """The `val_*` means over the held-out batches ({} without validation data)."""
        return evaluate(trainer.session, trainer.validation) if trainer.validation else {}

    def export(self, trainer, directory: Path | None = None) -> Path:
        directory = directory if directory is not None else trainer.output_dir
        return export_weights(trainer.session.weights(), self.config.model, "pretraining",
                              directory / "model.inference.onnx")


def matching_weights(weights: dict[str, torch.Tensor], session: Session) -> dict:
    """Weights for a new run from another run's checkpoint (phase 1 → phase 2): those whose name
    and shape fit; the rest start fresh, and the log says which."""
    ours = dict(session.named_parameters)
    kept = {k: v for k, v in weights.items() if k in ours and v.shape == ours[k].shape}
    mismatched = [f"{k} {tuple(v.shape)} vs {tuple(ours[k].shape)}"
                  for k, v in weights.items() if k in ours and v.shape != ours[k].shape]
    fresh = sorted(set(ours) - set(kept))
    if mismatched:
        log.warning("--init-from: shapes differ, initialised fresh: %s", "; ".join(mismatched))
    if fresh:
        log.info("--init-from: %d of %d weights initialised fresh: %s", len(fresh), len(ours),
                 ", ".join(fresh[:8]) + (" ..." if len(fresh) > 8 else ""))
    return kept


# The weights of the encoder (embeddings, layers, final norm), as against its task heads: what
# `--init-from` must carry over for the new run to start from the checkpoint at all.
ENCODER_PREFIXES = ("Embedding/", "Layer", "FinalNorm/")
# `--init-from` carrying over less than this share of the encoder's weights (a checkpoint of
# another size, by mistake), or another family's, is refused unless
# `training.allow_partial_init_from`.
MIN_CARRIED_SHARE = 0.5


def check_carried_over(cfg: RunConfig, names: Iterable[str], fresh: Iterable[str],
                       checkpoint_config: dict, source: str | Path) -> None:
    """ConfigError (one line, naming both families) when `--init-from` names another family's
    checkpoint (weights that fit by name and shape are a coincidence there: the layers differ)
    or carries over fewer than `MIN_CARRIED_SHARE` of the run's encoder weights (another
    size): such a run starts from scratch in all but name, and would say nothing."""
    encoder = [n for n in names if n.startswith(ENCODER_PREFIXES)]
    fresh = set(fresh)
    carried = [n for n in encoder if n not in fresh]
    model = checkpoint_config.get("model") if isinstance(checkpoint_config, dict) else None
    theirs = str(model.get("architecture") or "bert") if isinstance(model, dict) else "bert"
    ours = cfg.model.architecture
    if theirs == ours and len(carried) >= MIN_CARRIED_SHARE * len(encoder):
        return
    said = (f"the checkpoint's {_title(theirs)} (model.architecture {theirs}) fits "
            f"{len(carried)} of the {len(encoder)} encoder weights of this run's {_title(ours)} "
            f"(model.architecture {ours}")
    if cfg.training.allow_partial_init_from:
        log.warning("--init-from %s: %s); starting from what fits "
                    "(training.allow_partial_init_from)", source, said)
        return
    why = "another family" if theirs != ours else "names or shapes differ"
    raise ConfigError(f"--init-from {source}: {said}; {why}); drop --init-from, or set "
                      "training.allow_partial_init_from=true to start from what fits")


def _title(architecture: str) -> str:
    from popbert.builders.families import FAMILIES

    family = FAMILIES.get(architecture)
    return family.title if family is not None else str(architecture)


__all__ = ["ENCODER_PREFIXES", "METRIC_KEYS", "MIN_CARRIED_SHARE", "PretrainingJob",
           "check_carried_over", "check_supported", "matching_weights"]
