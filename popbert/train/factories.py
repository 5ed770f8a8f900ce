"""What a run config turns into: the graph's batch size, the optimizer, the learning-rate schedule,
the batch-size warmup's ramp and the loss scaler.

Pre-training, fine-tuning and sweeps build these the same way, so a config means one thing
everywhere. (The session options come from `SessionOptions.from_config`, next to the options.)
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from popbert.builders.bert import BATCH
from popbert.config import RunConfig
from popbert.optimizers import (
    AdamW,
    Lamb,
    LossScaler,
    StableAdamW,
    make_schedule,
    param_groups_by_name,
)

NamedParameters = list[tuple[str, torch.nn.Parameter]]


def graph_batch_size(cfg: RunConfig) -> int | str:
    """The batch dimension of the training graph: the micro batch in the popart dialect (static
    shapes, as on IPUs), else symbolic (any batch)."""
    return cfg.execution.micro_batch_size if cfg.model.dialect == "popart" else BATCH


def rows_change_length(cfg: RunConfig) -> bool:
    """Whether the training graph needs a symbolic sequence axis: its batches are trimmed
    (`execution.trim_padding`) or cut shorter early on (`training.sequence_curriculum`)."""
    return cfg.execution.trim_padding or bool(cfg.training.sequence_curriculum)


def optimizer_factory(cfg: RunConfig) -> Callable[[NamedParameters], torch.optim.Optimizer]:
    """Our LAMB / AdamW / StableAdamW with Graphcore's per-tensor exclusions (no decay on biases
    and norms).

    A factory rather than an optimizer: the session creates the parameters (from the graph's
    initializers) and hands them over by ONNX name.
    """
    o = cfg.optimizer
    stochastic = cfg.execution.stochastic_rounding

    def make(named: NamedParameters) -> torch.optim.Optimizer:
        groups = param_groups_by_name(named, o.weight_decay)
        common = dict(lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                      bias_correction=o.bias_correction, max_grad_norm=o.max_grad_norm,
                      stochastic_rounding=stochastic, seed=cfg.training.seed)
        if o.name == "lamb":
            return Lamb(groups, max_trust_ratio=o.max_trust_ratio, **common)
        if o.name == "stableadamw":
            return StableAdamW(groups, **common)
        return AdamW(groups, **common)

    return make


def lr_schedule(cfg: RunConfig) -> Callable[[int], float]:
    """The learning rate of each optimizer step (0-based)."""
    o = cfg.optimizer
    if o.lr_schedule:
        return make_schedule("piecewise", piecewise=o.lr_schedule)
    kind = {"linear": "linear", "polynomial": "poly", "none": "constant", "cosine": "cosine",
            "wsd": "wsd"}[o.decay]
    # A run shorter than its warmup (a quick `--set training.steps=20` on a preset) warms up
    # over the whole run rather than failing.
    return make_schedule(kind, peak_lr=o.lr, total_steps=cfg.training.steps,
                         warmup_steps=min(o.warmup_steps, cfg.training.steps),
                         warmup_start_lr=o.warmup_start_lr,
                         end_lr=o.end_lr, power=o.power, decay_fraction=o.decay_fraction)


def warmup_micro_batches(step: int, accumulation: int, warmup: float, steps: int) -> int:
    """Micro-batches optimizer step ``step`` (0-based; under a time budget the schedule step)
    takes when the global batch warms up over the first ``warmup`` fraction of ``steps``
    (`training.batch_warmup`): ``ceil(accumulation × (step + 1) / (warmup × steps))``, at least 1
    and at most ``accumulation``; all ``accumulation`` with ``warmup`` 0.

    The micro-batch stays fixed (one graph, one memory footprint) and only the accumulation
    ramps: the global batch grows linearly, so early training makes more updates per sample
    (GPT-3; "Cramming", Geiping & Goldstein 2022). The step reaching the warmup's end
    (``step + 1 = warmup × steps``) takes all of them. A tolerance of 1e-9 keeps a quotient
    that is whole in exact arithmetic from rounding up a step early (0.29 × 100 is
    28.999999999999996 in floats).
    """
    if warmup <= 0:
        return accumulation
    span = warmup * steps
    return max(1, min(accumulation, math.ceil(accumulation * (step + 1) / span - 1e-9)))


def loss_scaler(cfg: RunConfig) -> LossScaler | None:
    """Static or dynamic loss scaling, or None (`optimizer.loss_scaling: none`)."""
    o = cfg.optimizer
    if o.loss_scaling == "static":
        return LossScaler.static(o.loss_scale)
    if o.loss_scaling == "dynamic":
        return LossScaler(o.loss_scale, dynamic=True)
    return None


__all__ = ["NamedParameters", "graph_batch_size", "loss_scaler", "lr_schedule",
           "optimizer_factory", "warmup_micro_batches"]
