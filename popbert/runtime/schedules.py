"""Pipelining and recomputation, part two: the schedules that run a partitioned program.

:class:`PipelineEngine` trains micro-batches through a :class:`~popbert.runtime.partition.Program`'s
stages with the ``gpipe`` or ``1f1b`` schedule, one worker thread per device. The schedules, the
threading, and why not ``torch.distributed.pipelining``: docs/design.md, section
"popbert.runtime.schedules".
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from popbert.config.sections import PIPELINE_SCHEDULES

if TYPE_CHECKING:
    from popbert.runtime.partition import Program

__all__ = ["Action", "PipelineEngine", "schedule_order", "stage_actions"]

Action = tuple[str, int, int]  # ("F" | "B", stage, micro-batch)


def stage_actions(kind: str, position: int, num_stages: int, micro: int) -> list[Action]:
    """The actions of the stage at ``position`` (0 = first) in schedule ``kind``."""
    if kind == "gpipe":
        return ([("F", position, m) for m in range(micro)]
                + [("B", position, m) for m in range(micro)])
    if kind == "1f1b":
        warmup = min(num_stages - position - 1, micro)
        actions = [("F", position, m) for m in range(warmup)]
        for i in range(micro - warmup):
            actions += [("F", position, warmup + i), ("B", position, i)]
        actions += [("B", position, m) for m in range(micro - warmup, micro)]
        return actions
    raise ValueError(f"unknown pipeline schedule {kind!r}; expected one of "
                     f"{', '.join(PIPELINE_SCHEDULES)}")


def _dependencies(action: Action, producers: dict[int, set[int]],
                  consumers: dict[int, set[int]]) -> list[Action]:
    kind, stage, m = action
    if kind == "F":
        return [("F", p, m) for p in sorted(producers[stage])]
    return [("F", stage, m)] + [("B", c, m) for c in sorted(consumers[stage])]


def schedule_order(kind: str, num_stages: int, producers: dict[int, set[int]],
                   consumers: dict[int, set[int]], micro: int) -> list[Action]:
    """One valid global order of the schedule: every stage advances one action per tick when
    its dependencies finished in earlier ticks (what the stages would do in parallel)."""
    lists = [stage_actions(kind, s, num_stages, micro) for s in range(num_stages)]
    position = [0] * num_stages
    done: set[Action] = set()
    order: list[Action] = []
    remaining = sum(len(actions) for actions in lists)
    while remaining:
        ready = []
        for s in range(num_stages):
            if position[s] < len(lists[s]):
                action = lists[s][position[s]]
                if all(d in done for d in _dependencies(action, producers, consumers)):
                    ready.append(action)
        if not ready:
            raise RuntimeError(f"pipeline schedule {kind!r} deadlocks")
        for action in ready:
            order.append(action)
            position[action[1]] += 1
        done.update(ready)
        remaining -= len(ready)
    return order


class PipelineEngine:
    """Trains micro-batches through a :class:`Program`'s stages with a GPipe or 1F1B schedule.

    ``threads``: None = one worker thread per device when the stages span several devices;
    True/False forces it (True on CPU is for testing the threaded executor).
    """

    def __init__(self, program: Program, schedule: str = "1f1b",
                 autocast: Callable[[], contextlib.AbstractContextManager] | None = None,
                 threads: bool | None = None, poll_s: float = 0.05):
        if schedule not in PIPELINE_SCHEDULES:
            raise ValueError(f"unknown pipeline schedule {schedule!r}; expected one of "
                             f"{', '.join(PIPELINE_SCHEDULES)}")
        self.program = program
        self.schedule = schedule
        self.autocast = autocast or contextlib.nullcontext
        devices = {str(d) for d in program.stage_device.values()}
        self.threads = len(devices) > 1 if threads is None else threads
        self.poll_s = poll_s
        # Stages renumbered 0..S-1 in order, for the schedule.
        self._pos = {s: i for i, s in enumerate(program.stages)}
        self._producers = {self._pos[s]: {self._pos[p] for p in program.producers[s]}
                           for s in program.stages}
        self._consumers = {self._pos[s]: {self._pos[c] for c in program.consumers[s]}
                           for s in program.stages}

    def order(self, micro: int) -> list[Action]:
        """The global action order for ``micro`` micro-batches (positions, not stage ids)."""
        return schedule_order(self.schedule, self.program.num_stages, self._producers,
                              self._consumers, micro)

    def train(self, micro_batches: Sequence[Sequence[torch.Tensor]], loss_index: int,
              loss_scale: float = 1.0, scalars_only: bool = False) -> list[tuple[Any, ...]]:
        """Forward and backward every micro-batch; gradients accumulate into ``.grad`` as
        ``mean over micro-batches of loss × loss_scale``. Returns each micro-batch's outputs,
        detached; with ``scalars_only`` the others (logits) are dropped as soon as their stage
        ran (as None), so a step does not hold every micro-batch's [batch, positions, vocab]
        logits until its end."""
        program = self.program
        micro = len(micro_batches)
        runs = [program.micro_batch(inputs, cut=True) for inputs in micro_batches]
        loss_stage = program.stage_of_output(loss_index)
        factor = loss_scale / micro

        def run(action: Action) -> None:
            kind, position, m = action
            stage = program.stages[position]
            mb = runs[m]
            with self.autocast():
                if kind == "F":
                    produced = program.forward_stage(mb, stage)
                    if stage == loss_stage:
                        # Same arithmetic as the unpipelined loop: loss.float() * (scale / M).
                        mb.seed = mb.outputs[loss_index].float() * factor
                        mb.seed_stage = stage
                    for index in produced:  # only this stage's: others may run concurrently
                        value = mb.outputs[index]
                        if isinstance(value, torch.Tensor):
                            keep = not scalars_only or value.dim() == 0
                            mb.outputs[index] = value.detach() if keep else None
                else:
                    program.backward_stage(mb, stage)

        order = self.order(micro)
        if self.threads:
            self._run_threaded(order, run)
        else:
            for action in order:
                run(action)
        return [program.finish_outputs(mb) for mb in runs]

    def _run_threaded(self, order: list[Action], run: Callable[[Action], None]) -> None:
        program = self.program
        by_device: dict[str, list[Action]] = {}
        for action in order:
            device = program.stage_device[program.stages[action[1]]]
            by_device.setdefault(str(device), []).append(action)
        finished = {action: threading.Event() for action in order}
        failed = threading.Event()
        errors: list[BaseException] = []

        def worker(device: str, actions: list[Action]) -> None:
            try:
                if device.startswith("cuda"):
                    torch.cuda.set_device(torch.device(device))
                for action in actions:
                    for dep in _dependencies(action, self._producers, self._consumers):
                        while not finished[dep].wait(self.poll_s):
                            if failed.is_set():
                                return
                    run(action)
                    finished[action].set()
            except BaseException as error:  # noqa: BLE001 - re-raised in the caller
                errors.append(error)
                failed.set()

        workers = [threading.Thread(target=worker, args=item, name=f"pipeline-{item[0]}",
                                    daemon=True) for item in by_device.items()]
        for thread in workers:
            thread.start()
        for thread in workers:
            thread.join()
        if errors:
            raise errors[0]

