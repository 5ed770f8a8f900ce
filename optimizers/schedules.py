"""Learning-rate schedules as pure functions of the step.

A schedule is ``Callable[[int], float]`` with no internal state, so resuming from a checkpoint
only needs the step number. :func:`make_schedule` builds the common shapes: linear warmup from
``warmup_start_lr`` to ``peak_lr`` over ``warmup_steps``, then a decay to ``end_lr`` at
``total_steps``, or Graphcore-style piecewise-constant ``"step:lr"`` lists. The decays:

- ``linear``, ``poly`` (``(1 - progress) ** power``) and ``constant`` (no decay), over
  ``[warmup_steps, total_steps]`` (Graphcore's BERT: warmup from 1e-7, linear decay to 1e-7);
- ``cosine``: half a cosine from the peak to ``end_lr`` over ``[warmup_steps, total_steps]``
  (Loshchilov & Hutter 2017, "SGDR", without restarts);
- ``wsd``, warmup-stable-decay: hold the peak after warmup, then decay linearly to ``end_lr``
  over the final ``decay_fraction`` of ``total_steps`` (Hu et al. 2024, "MiniCPM"; Hägele et al.
  2024, "Scaling Laws and Compute-Optimal Training Beyond Fixed Training Durations"). Until its
  decay starts the rate does not depend on ``total_steps``, so a run can be extended or cut
  short from any step of the stable phase.
"""
from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Mapping
from typing import Any

from torch.optim import Optimizer

__all__ = [
    "Schedule",
    "warmup_decay",
    "wsd_decay_start",
    "parse_piecewise",
    "piecewise_constant",
    "linear_scaling_rule",
    "make_schedule",
    "set_lr",
]

Schedule = Callable[[int], float]
_DECAYS = ("linear", "poly", "polynomial", "none", "constant", "cosine", "wsd")


def wsd_decay_start(total_steps: int, warmup_steps: int = 0, decay_fraction: float = 0.2) -> int:
    """The step at which a ``wsd`` schedule leaves its stable phase and starts to decay.

    ``total_steps - round(decay_fraction * total_steps)``, but never before warmup ends: the
    decay takes the final ``decay_fraction`` of the steps, or what is left after warmup.
    """
    if not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction}")
    return max(warmup_steps, total_steps - round(decay_fraction * total_steps))


def warmup_decay(
    step: int,
    *,
    peak_lr: float,
    total_steps: int,
    warmup_steps: int = 0,
    warmup_start_lr: float = 0.0,
    end_lr: float = 0.0,
    decay: str = "linear",
    power: float = 1.0,
    decay_fraction: float = 0.2,
) -> float:
    """Learning rate at ``step`` (0-based) for warmup followed by decay.

    Warmup: ``start + (peak - start) * step / warmup_steps`` for ``step < warmup_steps``. Decay
    over ``[warmup_steps, total_steps]``, with ``progress`` going from 0 to 1 over it:

    - ``linear``/``poly``: ``end + (peak - end) * (1 - progress) ** power`` (``linear`` is
      ``power=1``);
    - ``cosine``: ``end + (peak - end) * 0.5 * (1 + cos(pi * progress))``;
    - ``wsd``: the peak until :func:`wsd_decay_start` (the final ``decay_fraction`` of
      ``total_steps``), then linear to ``end`` over ``[decay_start, total_steps]``;
    - ``none``/``constant``: stays at the peak.

    Steps past ``total_steps`` keep ``end_lr`` (or the peak without decay). ``decay_fraction``
    is read only by ``wsd``.
    """
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if step < warmup_steps:
        return warmup_start_lr + (peak_lr - warmup_start_lr) * step / warmup_steps
    if decay in ("none", "constant"):
        return peak_lr
    if decay == "cosine":
        return _cosine(step, warmup_steps, total_steps, peak_lr, end_lr)
    if decay == "wsd":
        decay_start = wsd_decay_start(total_steps, warmup_steps, decay_fraction)
        if step < decay_start:
            return peak_lr
        return _linear(step, decay_start, total_steps, peak_lr, end_lr)
    if decay == "linear":
        power = 1.0
    elif decay not in ("poly", "polynomial"):
        raise ValueError(f"unknown decay {decay!r}; expected one of {_DECAYS}")
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0 or step >= total_steps:
        return end_lr
    remaining = 1.0 - (step - warmup_steps) / decay_steps
    return end_lr + (peak_lr - end_lr) * remaining**power


def _linear(step: int, start: int, stop: int, peak_lr: float, end_lr: float) -> float:
    """Linear from ``peak_lr`` at ``start`` to ``end_lr`` at ``stop`` (then ``end_lr``); the same
    arithmetic as ``linear`` in :func:`warmup_decay` with ``start = warmup_steps``."""
    decay_steps = stop - start
    if decay_steps <= 0 or step >= stop:
        return end_lr
    remaining = 1.0 - (step - start) / decay_steps
    return end_lr + (peak_lr - end_lr) * remaining


def _cosine(step: int, start: int, stop: int, peak_lr: float, end_lr: float) -> float:
    """Half a cosine from ``peak_lr`` at ``start`` to ``end_lr`` at ``stop`` (then ``end_lr``)."""
    decay_steps = stop - start
    if decay_steps <= 0 or step >= stop:
        return end_lr
    progress = (step - start) / decay_steps
    return end_lr + (peak_lr - end_lr) * 0.5 * (1.0 + math.cos(math.pi * progress))


def parse_piecewise(spec: str | Mapping[int | str, float]) -> dict[int, float]:
    """Parse ``"0:1e-4,1000:5e-5"`` (or a mapping) into ``{step: lr}``, sorted by step.

    The first entry must be step 0 so every step has a learning rate.
    """
    if isinstance(spec, str):
        table: dict[int, float] = {}
        for item in spec.replace(" ", "").split(","):
            if not item:
                continue
            step, sep, lr = item.partition(":")
            if not sep:
                raise ValueError(f"piecewise entry {item!r} is not 'step:lr'")
            table[int(step)] = float(lr)
    else:
        table = {int(step): float(lr) for step, lr in spec.items()}
    if not table:
        raise ValueError("empty piecewise schedule")
    if min(table) != 0:
        raise ValueError(f"piecewise schedule must start at step 0, first step is {min(table)}")
    return dict(sorted(table.items()))


def piecewise_constant(spec: str | Mapping[int | str, float]) -> Schedule:
    """Schedule whose lr at ``step`` is the value of the last entry with ``entry_step <= step``."""
    table = parse_piecewise(spec)
    starts = list(table)
    values = list(table.values())

    def schedule(step: int) -> float:
        if step < 0:
            raise ValueError(f"step must be >= 0, got {step}")
        return values[bisect.bisect_right(starts, step) - 1]

    return schedule


def linear_scaling_rule(lr: float, base_batch: int, batch: int) -> float:
    """Scale a learning rate tuned at ``base_batch`` to ``batch``: ``lr * batch / base_batch``."""
    if base_batch <= 0 or batch <= 0:
        raise ValueError(f"batch sizes must be positive, got {base_batch} and {batch}")
    return lr * batch / base_batch


def make_schedule(
    kind: str = "linear",
    *,
    peak_lr: float | None = None,
    total_steps: int | None = None,
    warmup_steps: int = 0,
    warmup_start_lr: float = 0.0,
    end_lr: float = 0.0,
    power: float = 1.0,
    piecewise: str | Mapping[int | str, float] | None = None,
    decay_fraction: float = 0.2,
) -> Schedule:
    """Build a schedule: ``kind`` is ``linear``, ``poly``, ``constant``, ``cosine``, ``wsd`` or
    ``piecewise``.

    All but ``piecewise`` use :func:`warmup_decay` (``constant`` = warmup then hold the peak;
    ``wsd`` decays over the final ``decay_fraction`` of ``total_steps``, in (0, 1]);
    ``piecewise`` needs ``piecewise`` (a ``"step:lr"`` string or a mapping).
    """
    if kind == "piecewise":
        if piecewise is None:
            raise ValueError("kind='piecewise' needs piecewise='step:lr,...'")
        return piecewise_constant(piecewise)
    decay = {"linear": "linear", "poly": "poly", "polynomial": "poly", "constant": "none",
             "cosine": "cosine", "wsd": "wsd"}.get(kind)
    if decay is None:
        raise ValueError(f"unknown schedule kind {kind!r}")
    if peak_lr is None:
        raise ValueError(f"kind={kind!r} needs peak_lr")
    if decay != "none" and total_steps is None:
        raise ValueError(f"kind={kind!r} needs total_steps")
    if warmup_steps < 0:
        raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps is not None and decay != "none" and total_steps < warmup_steps:
        raise ValueError(f"total_steps {total_steps} < warmup_steps {warmup_steps}")
    if decay == "wsd" and not 0.0 < decay_fraction <= 1.0:
        raise ValueError(f"decay_fraction must be in (0, 1], got {decay_fraction}")
    options: dict[str, Any] = {
        "peak_lr": float(peak_lr),
        "total_steps": int(total_steps) if total_steps is not None else 0,
        "warmup_steps": int(warmup_steps),
        "warmup_start_lr": float(warmup_start_lr),
        "end_lr": float(end_lr),
        "decay": decay,
        "power": float(power),
        "decay_fraction": float(decay_fraction),
    }

    def schedule(step: int) -> float:
        return warmup_decay(step, **options)

    return schedule


def set_lr(optimizer: Optimizer, schedule: Schedule | float, step: int | None = None) -> float:
    """Set every param group's ``lr`` for ``step`` and return the scheduled value.

    A group with an ``lr_scale`` entry gets ``lr * lr_scale`` (e.g. a smaller lr for the head).
    ``schedule`` may also be a plain number (then ``step`` is ignored).
    """
    if callable(schedule):
        if step is None:
            raise ValueError("set_lr with a schedule needs the step")
        lr = float(schedule(step))
    else:
        lr = float(schedule)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr
