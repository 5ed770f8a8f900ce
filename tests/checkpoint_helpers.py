"""Small random task models saved as a fine-tuning run saves them, and ONNX Runtime on a file:
shared by the export tests (tests/io) and the serving tests (tests/serve); and a run SIGKILLed
once it has saved a checkpoint (the resume tests)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import torch

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.config import dump_config
from popbert.graph.annotations import trainable_initializers
from popbert.io.checkpoint import Checkpoint, save_checkpoint


def random_task_run(directory: Path, cfg, task: str, *, seed: int, step: int = 1,
                    scale: Callable[[str], float] = lambda name: 3) -> dict[str, np.ndarray]:
    """Save a random `task` model of `cfg` (its `model.task` and vocabulary already set) as the
    checkpoint at `step` of the run `directory`; return its trainable weights. Each weight is its
    initial value times `scale(name)` (3: logits of O(1))."""
    model = build_bert(cfg.model, task=task, seed=seed).model()
    values = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    weights = {n: values[n] * scale(n) for n in trainable_initializers(model)}
    save_checkpoint(directory / "checkpoints" / f"step-{step:06d}",
                    Checkpoint(step=step, weights={n: torch.from_numpy(w)
                                                   for n, w in weights.items()}),
                    dump_config(cfg))
    return weights


def run_ort(path: Path, batch) -> dict[str, np.ndarray]:
    """The outputs of the ONNX file at `path` on `batch`, by name (CPU execution provider)."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, batch)))


def run_records(run: Path) -> list[dict]:
    """The run's metrics.jsonl, one dict a logged step."""
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def final_step_weights(run: Path) -> dict[str, np.ndarray]:
    """The weights of the run's newest checkpoint, by ONNX name."""
    import safetensors.numpy

    step = max((run / "checkpoints").iterdir())
    return safetensors.numpy.load_file(str(step / "weights.safetensors"))



def kill_after_checkpoint(argv: list[str], run: Path, step: int,
                          env: dict[str, str] | None = None) -> None:
    """`python -m popbert *argv` in a child, SIGKILLed as soon as `run` holds the checkpoint
    of `step` (it fails the test if the child ends or takes 4 minutes first)."""
    process = subprocess.Popen([sys.executable, "-m", "popbert", *argv],
                               env=env if env is not None else os.environ.copy(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (run / "checkpoints" / f"step-{step:06d}" / "state.json").exists():
        assert process.poll() in (None, 0) and time.monotonic() < deadline
        time.sleep(0.02)
    process.send_signal(signal.SIGKILL)
    process.wait()
