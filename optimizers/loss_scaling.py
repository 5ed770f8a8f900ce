"""Static and dynamic loss scaling.

Half-precision backward passes lose small gradients to underflow; multiplying the loss by a
scale shifts gradients into range, and the optimizer divides it out again in FP32. With dynamic
scaling the scale grows by ``growth_factor`` after ``growth_interval`` clean steps and backs off
by ``backoff_factor`` when a gradient overflows, in which case the step is skipped (weights and
optimizer state untouched). The scale never drops below ``min_scale`` (at least 1), so
unscaling never divides by zero and never amplifies gradients.

Typical loop::

    scaler = LossScaler(2.0**16)                # or LossScaler.static(512)
    scaler.scale(loss).backward()
    stepped = scaler.step(optimizer)            # checks, unscales in FP32, steps or skips
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor
from torch.optim import Optimizer

from popbert.optimizers.optimizer import AdamFamilyOptimizer

__all__ = ["LossScaler", "grads_have_overflow", "unscale_grads_"]

logger = logging.getLogger(__name__)

GradsT = Iterable[Tensor | None] | Optimizer


def _collect_grads(grads: GradsT) -> list[Tensor]:
    if isinstance(grads, Optimizer):
        return [p.grad for g in grads.param_groups for p in g["params"] if p.grad is not None]
    return [g for g in grads if g is not None]


def grads_have_overflow(grads: GradsT) -> bool:
    """True if any gradient holds an inf or NaN (one host sync per device)."""
    by_device: dict[torch.device, list[Tensor]] = {}
    for g in _collect_grads(grads):
        if g.numel():
            by_device.setdefault(g.device, []).append(g)
    for tensors in by_device.values():
        # torch's multi-tensor kernel (what torch.optim uses; it has no public name).
        max_abs = torch._foreach_norm(tensors, float("inf"))  # noqa: SLF001  propagates NaN/inf
        if not bool(torch.stack([m.float() for m in max_abs]).isfinite().all()):
            return True
    return False


def unscale_grads_(grads: GradsT, scale: float) -> None:
    """Divide gradients by ``scale`` in place (half-precision ones in FP32, rounded back).

    For optimizers that cannot take ``grad_scale`` themselves; popbert's optimizers unscale
    inside their FP32 update instead, where small half-precision gradients cannot underflow.
    """
    tensors = _collect_grads(grads)
    inv_scale = 1.0 / scale
    fp32 = [g for g in tensors if g.dtype == torch.float32]
    if fp32:
        torch._foreach_mul_(fp32, inv_scale)
    for g in tensors:
        if g.dtype != torch.float32:
            g.copy_(g.float() * inv_scale)


class LossScaler:
    """Static or dynamic loss scale with skipped-step accounting and a checkpointable state."""

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        dynamic: bool = True,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float = 1.0,
        max_scale: float = 2.0**24,
    ) -> None:
        if not min_scale >= 1.0:
            raise ValueError(f"min_scale must be >= 1, got {min_scale}")
        if not min_scale <= init_scale <= max_scale:
            raise ValueError(
                f"init_scale {init_scale} must lie in [min_scale, max_scale] = "
                f"[{min_scale}, {max_scale}]"
            )
        if not growth_factor > 1.0:
            raise ValueError(f"growth_factor must be > 1, got {growth_factor}")
        if not 0.0 < backoff_factor < 1.0:
            raise ValueError(f"backoff_factor must be in (0, 1), got {backoff_factor}")
        if growth_interval < 1:
            raise ValueError(f"growth_interval must be >= 1, got {growth_interval}")
        self.dynamic = dynamic
        self.growth_factor = float(growth_factor)
        self.backoff_factor = float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self.min_scale = float(min_scale)
        self.max_scale = float(max_scale)
        self._scale = float(init_scale)
        self._clean_steps = 0
        self._skipped_steps = 0
        self._steps = 0

    @classmethod
    def static(cls, scale: float) -> LossScaler:
        """A fixed scale (Graphcore's BERT: 512 for Base-128, 64 for Large)."""
        return cls(scale, dynamic=False, min_scale=1.0, max_scale=max(scale, 1.0))

    @property
    def scale_value(self) -> float:
        """The current loss scale."""
        return self._scale

    @property
    def skipped_steps(self) -> int:
        """Steps skipped because a gradient overflowed."""
        return self._skipped_steps

    @property
    def steps(self) -> int:
        """Calls to :meth:`update` so far (taken and skipped steps)."""
        return self._steps

    def scale(self, loss: Tensor) -> Tensor:
        """Return ``loss * scale`` (call ``backward()`` on the result)."""
        return loss * self._scale

    def step(self, optimizer: Optimizer) -> bool:
        """Step ``optimizer`` unless a gradient overflowed, then :meth:`update`.

        popbert optimizers receive ``grad_scale`` and unscale in FP32; other optimizers get
        their gradients unscaled in place first. Returns True if the step was taken.
        """
        grads = _collect_grads(optimizer)
        found_inf = grads_have_overflow(grads)
        if not found_inf:
            if isinstance(optimizer, AdamFamilyOptimizer):
                optimizer.step(grad_scale=self._scale)
            else:
                unscale_grads_(grads, self._scale)
                optimizer.step()
        self.update(found_inf)
        return not found_inf

    def update(self, found_inf: bool | Tensor) -> None:
        """Record one step: back off (dynamic) and count a skip on overflow, else maybe grow."""
        found_inf = bool(found_inf)
        self._steps += 1
        if found_inf:
            self._skipped_steps += 1
            self._clean_steps = 0
            if self.dynamic:
                new_scale = max(self._scale * self.backoff_factor, self.min_scale)
                logger.debug("loss scale overflow: %g -> %g", self._scale, new_scale)
                if new_scale == self._scale:
                    logger.warning("gradients overflow at the minimum loss scale %g", new_scale)
                self._scale = new_scale
            return
        if not self.dynamic:
            return
        self._clean_steps += 1
        if self._clean_steps >= self.growth_interval:
            self._scale = min(self._scale * self.growth_factor, self.max_scale)
            self._clean_steps = 0

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to resume bit-exactly (plain Python numbers)."""
        return {
            "scale": self._scale,
            "clean_steps": self._clean_steps,
            "skipped_steps": self._skipped_steps,
            "steps": self._steps,
            "dynamic": self.dynamic,
            "growth_factor": self.growth_factor,
            "backoff_factor": self.backoff_factor,
            "growth_interval": self.growth_interval,
            "min_scale": self.min_scale,
            "max_scale": self.max_scale,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a state produced by :meth:`state_dict`."""
        self.dynamic = bool(state_dict["dynamic"])
        self.growth_factor = float(state_dict["growth_factor"])
        self.backoff_factor = float(state_dict["backoff_factor"])
        self.growth_interval = int(state_dict["growth_interval"])
        self.min_scale = float(state_dict["min_scale"])
        self.max_scale = float(state_dict["max_scale"])
        self._scale = float(state_dict["scale"])
        self._clean_steps = int(state_dict["clean_steps"])
        self._skipped_steps = int(state_dict["skipped_steps"])
        self._steps = int(state_dict["steps"])

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return f"LossScaler({kind}, scale={self._scale:g}, skipped={self._skipped_steps})"
