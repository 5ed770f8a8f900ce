"""How one training step's gradients become an optimizer update: one strategy per layout.

A training step is always the same sequence (``popbert.runtime.session.TrainingSession``):
zero the gradients, forward and backward every micro-batch, finish the gradients, check them for
overflow when a loss scaler is on, step. What differs between a single process, data-parallel
replicas and replicated tensor sharding is only what each of those verbs does, so each layout is
one :class:`GradientSync` the session picks once (:func:`gradient_sync`):

* :class:`LocalGradients`: backward accumulates into ``.grad``, the ordinary optimizer steps;
* :class:`AllReduceGradients`: ``.grad`` are views of flat buffers mean-all-reduced once per step
  (:class:`~popbert.distributed.buffers.GradientBuffer`);
* :class:`ShardedGradients`: each micro-batch's gradients are reduce-scattered into this
  replica's FP32 shard and the :class:`~popbert.distributed.sharded.ShardedOptimizer` updates the
  shard.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from popbert.distributed.buffers import GradientBuffer
from popbert.distributed.replicas import Replicas
from popbert.distributed.sharded import ShardedOptimizer
from popbert.optimizers.loss_scaling import grads_have_overflow, unscale_grads_
from popbert.optimizers.optimizer import AdamFamilyOptimizer

__all__ = ["AllReduceGradients", "GradientSync", "LocalGradients", "ShardedGradients",
           "gradient_sync"]


class GradientSync(ABC):
    """The gradient side of a training step. ``optimizer`` is what the session exposes as its
    optimizer (learning-rate schedules set its ``param_groups``, checkpoints read its
    ``state_dict``)."""

    optimizer: Any

    @abstractmethod
    def zero_grad(self) -> None:
        """Start a step with zero gradients."""

    def after_micro_batch(self) -> None:
        """The backward pass of a micro-batch has landed in ``.grad`` (pipelined: of all of
        them, the schedule interleaves them). Nothing to do unless gradients are sharded."""
        return

    def finish(self) -> None:
        """Every micro-batch is done: make ``.grad`` (or the shard) the step's gradient."""
        return

    @abstractmethod
    def found_inf(self) -> bool:
        """Whether the step's gradient holds an inf or NaN (on any replica)."""

    @abstractmethod
    def step(self, grad_scale: float | None) -> None:
        """Update the weights; ``grad_scale``: the loss scale the gradients still carry."""


class LocalGradients(GradientSync):
    """One process: the ordinary optimizer on ``.grad``."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def found_inf(self) -> bool:
        return grads_have_overflow(self.optimizer)

    def step(self, grad_scale: float | None) -> None:
        if grad_scale is None:
            self.optimizer.step()
        elif isinstance(self.optimizer, AdamFamilyOptimizer):
            self.optimizer.step(grad_scale=grad_scale)  # unscaled inside the FP32 update
        else:
            unscale_grads_(self.optimizer, grad_scale)
            self.optimizer.step()


class AllReduceGradients(LocalGradients):
    """Data-parallel replicas: one mean-all-reduce of flat gradient buffers per step, then every
    replica runs the ordinary optimizer on the same (reduced) gradients."""

    def __init__(self, optimizer: torch.optim.Optimizer, replicas: Replicas):
        super().__init__(optimizer)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.buffer = GradientBuffer(params, replicas)

    def zero_grad(self) -> None:
        self.buffer.zero_()

    def finish(self) -> None:
        self.buffer.all_reduce_mean_()


class ShardedGradients(GradientSync):
    """Replicated tensor sharding: gradients reduce-scattered into this replica's FP32 shard
    after each backward pass; the step updates the shard and all-gathers the weights."""

    def __init__(self, optimizer: AdamFamilyOptimizer, replicas: Replicas):
        self.optimizer = ShardedOptimizer(optimizer, replicas)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def after_micro_batch(self) -> None:
        self.optimizer.accumulate()

    def found_inf(self) -> bool:
        return self.optimizer.found_inf()

    def step(self, grad_scale: float | None) -> None:
        self.optimizer.step(grad_scale=grad_scale)


def gradient_sync(optimizer: torch.optim.Optimizer, replicas: Replicas,
                  sharded: bool) -> GradientSync:
    """The strategy of a layout: sharded (RTS, any replica count), all-reduce (several replicas)
    or local (one process)."""
    if sharded:
        return ShardedGradients(optimizer, replicas)
    if replicas.distributed:
        return AllReduceGradients(optimizer, replicas)
    return LocalGradients(optimizer)
