"""Fault injection for tests/train/test_fault_injection.py: a `popbert` command in a child
process that SIGKILLs itself at the n-th event of one kind (a step, a checkpoint file, another
file, an evaluation, a metrics line, a delete, the export's check).

Nothing of this is in popbert: the hooks wrap its functions in the child only. The children are
forked from a forkserver that imported popbert, torch and ONNX Runtime once (`preload`), so a
child starts in a fraction of a second instead of the two seconds of a fresh interpreter.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

# Imported here so that the forkserver has them loaded before it forks any child (what a run
# imports on its way, matplotlib and the graph lowering among them).
import matplotlib.backends.backend_agg  # noqa: F401
import matplotlib.figure  # noqa: F401
import onnxruntime  # noqa: F401
import safetensors.numpy  # noqa: F401
import torch  # noqa: F401
import torch._dynamo  # noqa: F401  (a training step imports it)
from tqdm import tqdm

import popbert.backends.sessions  # noqa: F401
import popbert.cli.data  # noqa: F401
import popbert.cli.main
import popbert.cli.sweep  # noqa: F401
import popbert.data.pretraining  # noqa: F401
import popbert.distributed.elastic  # noqa: F401
import popbert.export.inference
import popbert.lowering.lower  # noqa: F401
import popbert.observe.plots  # noqa: F401
import popbert.train.trainer  # noqa: F401
from popbert import atomic
from popbert.observe.tracking import MetricsLogger
from popbert.runtime.session import TrainingSession
from popbert.train import loop

# What a fault can hit, and in which function of popbert the child dies.
KINDS = ("step", "checkpoint", "output", "eval", "metrics", "delete", "export")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def install(kind: str, n: int) -> None:
    """Make this process SIGKILL itself at the `n`-th event of `kind` (1: the first)."""
    if kind not in KINDS:
        raise ValueError(kind)
    seen = [0]

    def hit() -> bool:
        seen[0] += 1
        return seen[0] == n

    def wrap(owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
             ) -> None:
        setattr(owner, name, make(getattr(owner, name)))

    if kind == "step":  # after the step's update, before the loop saw its loss
        def step(real: Callable[..., Any]) -> Callable[..., Any]:
            def run(self: Any, *args: Any, **kwargs: Any) -> Any:
                outputs = real(self, *args, **kwargs)
                if hit():
                    die()
                return outputs
            return run
        wrap(TrainingSession, "run", step)
    elif kind in ("checkpoint", "output"):  # half a file written, then dead
        def create(real: Callable[[Path, bytes], None]) -> Callable[[Path, bytes], None]:
            def write(path: Path, data: bytes) -> None:
                in_checkpoint = path.parent.name.startswith(".tmp-step-")
                if in_checkpoint == (kind == "checkpoint") and hit():
                    real(path, data[: len(data) // 2])
                    die()
                real(path, data)
            return write
        wrap(atomic, "_create", create)
    elif kind == "eval":  # in the middle of an evaluation
        def evaluate(real: Callable[..., Any]) -> Callable[..., Any]:
            def run(session: Any, validation: Sequence[Any]) -> Any:
                if hit():
                    real(session, validation[: max(1, len(validation) // 2)])
                    die()
                return real(session, validation)
            return run
        wrap(loop, "evaluate", evaluate)
    elif kind == "metrics":  # half a line reached the disk (as at a power cut)
        def append(real: Callable[..., Any]) -> Callable[..., Any]:
            def write(self: MetricsLogger, line: str) -> None:
                if hit():
                    assert self._file is not None
                    self._file.write(line[: len(line) // 2])
                    self._file.flush()
                    die()
                real(self, line)
            return write
        wrap(MetricsLogger, "_append", append)
    elif kind == "delete":  # one file of a tree deleted, the rest not
        def rmtree(real: Callable[..., Any]) -> Callable[..., Any]:
            def remove(path: Any, *args: Any, **kwargs: Any) -> None:
                if hit():
                    files = sorted(p for p in Path(path).rglob("*") if p.is_file())
                    if files:
                        files[0].unlink()
                    die()
                real(path, *args, **kwargs)
            return remove
        wrap(atomic.shutil, "rmtree", rmtree)
    else:  # export: while ONNX Runtime checks the written model
        def outputs(real: Callable[..., Any]) -> Callable[..., Any]:
            def run(*args: Any, **kwargs: Any) -> Any:
                if hit():
                    die()
                return real(*args, **kwargs)
            return run
        wrap(popbert.export.inference, "ort_outputs", outputs)


def run_popbert(argv: list[str], fault: tuple[str, int] | None, log: str) -> None:
    """The child: `popbert ARGV` with its output in `log`, dying at `fault` if it comes."""
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    # A thread lock for the progress bar: tqdm's default is a multiprocessing one, whose
    # semaphore a killed child would leave to the resource tracker's warnings.
    tqdm.set_lock(threading.RLock())
    if fault is not None:
        install(*fault)
    status = popbert.cli.main.main(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
