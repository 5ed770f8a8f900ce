"""Kills at random points (issue 20, item 4): a run SIGKILLed again and again, during steps,
checkpoint writes, other writes, evaluation, metrics lines, deletes and the export, and resumed
each time, ends bit-identical to the run that was never stopped; no checkpoint on disk is ever
unreadable. The faults are hooks of tests/fault_helpers.py, in the child processes only."""

from __future__ import annotations

import json
import multiprocessing
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy

from popbert.io.checkpoint import load_checkpoint
from popbert.io.run_dir import checkpoint_dirs

SEED = 20
# 12 steps: checkpoints at 3, 6, 9, 12 (two kept, so older ones are deleted), evaluation at 4,
# 8 and 12 on held-out articles, a record every step. One thread: every child computes alike.
RUN = ["--set", "model.num_layers=1", "--set", "model.hidden_size=32",
       "--set", "model.num_heads=2", "--set", "model.intermediate_size=64",
       "--set", "model.sequence_length=32", "--set", "model.max_position_embeddings=32",
       "--set", "model.max_predictions_per_seq=5", "--set", "execution.micro_batch_size=8",
       "--set", "model.hidden_dropout=0.1", "--set", "execution.threads=1",
       "--set", "optimizer.warmup_steps=2", "--set", "training.log_every=1",
       "--set", "training.steps=12", "--set", "training.checkpoint_every=3",
       "--set", "training.keep_checkpoints=2", "--set", "training.eval_every=4",
       "--set", "data.validation_fraction=0.05"]
TIMING = ("seq_per_s", "elapsed_s")
# How far into a child each kind of fault may come (the n-th event of its kind).
REACH = {"step": 4, "checkpoint": 6, "output": 3, "eval": 1, "metrics": 3, "delete": 1,
         "export": 2}


def plan(rng: random.Random) -> list[tuple[str, int]]:
    """The faults, in order: the early ones shuffled, then a delete (old checkpoints go after
    step 9) and the export (after the final checkpoint), each at a random event of its kind."""
    early = ["step", "checkpoint", "checkpoint", "output", "eval", "metrics"]
    rng.shuffle(early)
    return [(kind, rng.randint(1, REACH[kind])) for kind in [*early, "delete", "export"]]


def readable_checkpoints(run: Path) -> list[str]:
    """Every `step-*` directory on disk loads in full (a kill may leave `.tmp-`/`.old-` names,
    which the next start tidies, but never a torn checkpoint)."""
    root = run / "checkpoints"
    steps = sorted(p for p in root.glob("step-*")) if root.is_dir() else []
    for step in steps:
        assert load_checkpoint(step).step == int(step.name[len("step-"):]), step
    return [p.name for p in steps]


def outcome(run: Path) -> dict[str, Any]:
    final = run / "checkpoints" / "step-000012"
    return {"weights": safetensors.numpy.load_file(str(final / "weights.safetensors")),
            "records": [{k: v for k, v in json.loads(line).items() if k not in TIMING}
                        for line in (run / "metrics.jsonl").read_text().splitlines()],
            "export": (run / "model.inference.onnx").read_bytes()}


@pytest.mark.e2e
def test_a_run_killed_at_random_points_resumes_to_the_same_numbers(tmp_path: Path) -> None:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["fault_helpers"])
    import fault_helpers

    def child(argv: list[str], fault: tuple[str, int] | None, name: str) -> int:
        log = tmp_path / f"{name}.log"
        process = context.Process(target=fault_helpers.run_popbert,
                                  args=(["pretrain", *RUN, *argv], fault, str(log)))
        process.start()
        process.join(timeout=300)
        assert process.exitcode is not None, f"{name} hung"
        assert process.exitcode in (0, -9), log.read_text()[-3000:]
        return process.exitcode

    reference = tmp_path / "reference"
    assert child(["-o", str(reference)], None, "reference") == 0

    run = tmp_path / "run"
    kills: list[str] = []
    for attempt, fault in enumerate(plan(random.Random(SEED))):
        argv = (["--resume", str(run)] if checkpoint_dirs(run)
                else ["-o", str(run), "--overwrite"])
        status = child(argv, fault, f"attempt-{attempt}")
        if status == 0:  # the run ended before the fault came
            break
        kills.append(f"{fault[0]}#{fault[1]}")
        readable_checkpoints(run)
    else:
        assert child(["--resume", str(run)], None, "last") == 0
    print("killed at:", ", ".join(kills))
    assert len(kills) >= 6, kills
    assert {kill.split("#")[0] for kill in kills} >= {"step", "checkpoint", "eval", "export"}, \
        kills
    assert readable_checkpoints(run)[-1] == "step-000012"
    ours, theirs = outcome(run), outcome(reference)
    assert ours["weights"].keys() == theirs["weights"].keys()
    for name, value in ours["weights"].items():
        np.testing.assert_array_equal(value, theirs["weights"][name], err_msg=name)
    assert ours["records"] == theirs["records"]
    assert ours["export"] == theirs["export"]
    assert (run / "metrics.png").read_bytes()[:4] == b"\x89PNG"
    assert not list(run.glob(".tmp-*")) and not list((run / "checkpoints").glob(".tmp-*"))
