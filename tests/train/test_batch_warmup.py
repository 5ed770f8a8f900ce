"""Batch-size warmup (`training.batch_warmup`): the micro-batches per optimizer step ramp from 1 to
`execution.gradient_accumulation`. The ramp's values, a step of fewer micro-batches against a
gradient computed by hand, a run that consumes what the ramp says and logs it, resume in the
middle of the ramp, and the settings it refuses."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import safetensors.numpy
import torch
from bert_helpers import one_thread, padded_batch, small_config  # noqa: F401 (one_thread: autouse)

import popbert
from popbert.builders.bert import build_bert
from popbert.config import load_config
from popbert.distributed import Replicas
from popbert.errors import ConfigError, InputError
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import TrainingSession
from popbert.train.factories import warmup_micro_batches
from popbert.train.loop import LoopSettings, PartialBatch, train_loop

# A tiny BERT on the bundled corpus (as tests/train/test_trainer.py): 2-sequence micro-batches,
# 4 of them per full step, the ramp over the first 80% of 10 steps.
SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=32",
         "model.max_position_embeddings=32", "model.max_predictions_per_seq=5",
         "execution.device=cpu", "training.log_every=1", "optimizer.warmup_steps=2",
         "execution.micro_batch_size=2", "execution.gradient_accumulation=4",
         "training.steps=10", "training.batch_warmup=0.8"]
RAMP = [1, 1, 2, 2, 3, 3, 4, 4, 4, 4]  # ceil(4 (s + 1) / 8), at most 4


def small(*overrides: str) -> popbert.RunConfig:
    return popbert.load_config("tiny", [*SMALL, *overrides])


# ---------------------------------------------------------------------------------------------
# The ramp


def test_the_ramp_starts_at_one_reaches_the_accumulation_at_the_warmups_end_and_stays() -> None:
    assert [warmup_micro_batches(s, 4, 0.8, 10) for s in range(10)] == RAMP
    values = [warmup_micro_batches(s, 8, 0.25, 100) for s in range(100)]
    # Full from ceil(8 (s + 1) / 25) = 8, i.e. s = 21, at the latest at the warmup's last step
    # (s + 1 = 0.25 x 100); each of 1..8 in turn, about 25 / 8 steps each.
    assert values[0] == 1 and values.index(8) == 21 and values[24] == 8
    assert sorted(set(values)) == list(range(1, 9))
    assert values == sorted(values) and set(values[24:]) == {8}
    assert min(values) >= 1
    # Never 0, whatever the lengths: a ramp longer than the accumulation starts at 1 too.
    assert all(warmup_micro_batches(s, 2, 0.9, 1000) >= 1 for s in range(1000))
    # Off: the full accumulation from the first step.
    assert [warmup_micro_batches(s, 4, 0.0, 10) for s in range(3)] == [4, 4, 4]
    # A span that is whole in exact arithmetic but not in floats (0.29 x 100 =
    # 28.999999999999996) does not round a step up early: step 28 is the span's last.
    assert [warmup_micro_batches(s, 29, 0.29, 100) for s in (0, 27, 28)] == [1, 28, 29]


# ---------------------------------------------------------------------------------------------
# A step of fewer micro-batches


CONFIG = small_config(num_layers=1)
MICRO, ACCUMULATION, LR = 2, 4, 0.5


def sgd_session(model: Any) -> TrainingSession:
    return TrainingSession(model, "loss",
                           lambda named: torch.optim.SGD([p for _, p in named], lr=LR),
                           SessionOptions(gradient_accumulation=ACCUMULATION))


def test_a_step_of_k_micro_batches_is_the_gradient_of_their_mean_loss() -> None:
    """k = 2 of 4: the SGD update is lr x the gradient of the mean loss over exactly those two
    micro-batches (computed here with autograd); dividing by the accumulation (4) instead of k,
    the negative control, would give half of it."""
    model = build_bert(CONFIG, seed=1).model()
    session, reference = sgd_session(model), sgd_session(model)
    k = 2
    batch = padded_batch(CONFIG, MICRO * k, seed=3)
    micros = [{n: v[i * MICRO:(i + 1) * MICRO] for n, v in batch.items()} for i in range(k)]
    params = dict(reference.named_parameters)
    mean_loss = sum(reference.forward(m)["loss"] for m in micros) / k
    grads = dict(zip(params, torch.autograd.grad(mean_loss, list(params.values()))))

    before = {n: w.clone() for n, w in session.weights().items()}
    outputs = session.run(batch, micro_batches=k)
    assert session.step == 1 and outputs["loss"].shape == (1,)
    torch.testing.assert_close(outputs["loss"][0], mean_loss.detach(), rtol=1e-6, atol=0)
    moved = torch.cat([(session.weights()[n] - before[n]).flatten() for n in params])
    expected = torch.cat([(-LR * grads[n]).flatten() for n in params])
    assert expected.norm() > 1e-3  # a real update, not a vanishing one
    torch.testing.assert_close(moved, expected, rtol=1e-4, atol=1e-6)
    divided_by_accumulation = expected * k / ACCUMULATION  # the negative control
    assert (moved - divided_by_accumulation).norm() > 0.4 * expected.norm()


def test_a_step_takes_1_to_the_accumulation_micro_batches_and_says_so_otherwise() -> None:
    session = sgd_session(build_bert(CONFIG, seed=1).model())
    for wrong in (0, 5, True):
        with pytest.raises(InputError, match=r"^micro_batches is .*: an optimizer step takes 1 "
                           r"to gradient_accumulation \(4\) micro-batches$"):
            session.run(padded_batch(CONFIG, 4), micro_batches=wrong)
    with pytest.raises(InputError, match=r"input 'input_ids' has 6 rows, which do not divide "
                       r"into 4 micro-batches per run \(device_iterations 1 × "
                       r"gradient_accumulation 4\)"):  # all of them: the usual words
        session.run(padded_batch(CONFIG, 6), micro_batches=4)
    with pytest.raises(InputError, match=r"has 5 rows, which do not divide into 2 "
                       r"micro-batches per run \(device_iterations 1 × 2 of "):
        session.run(padded_batch(CONFIG, 5), micro_batches=2)
    assert session.step == 0
    assert session.run(padded_batch(CONFIG, 3), micro_batches=3)["loss"].shape == (1,)


# ---------------------------------------------------------------------------------------------
# Runs


class Counting:
    """The run's loader, counting the micro-batches it hands out (the rest is the loader's)."""

    def __init__(self, loader: Any):
        self.loader = loader
        self.handed = 0

    def __iter__(self) -> Counting:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        self.handed += 1
        return next(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


def count_per_step(trainer: popbert.Trainer) -> list[int]:
    """Wrap the trainer's loader and session: the list filled with the micro-batches each step
    consumed (what the loader handed out since the previous step)."""
    counting = trainer.loader = Counting(trainer.loader)
    session, run = trainer.session, trainer.session.run
    per_step: list[int] = []

    def counted_run(batch: Any, micro_batches: int | None = None) -> dict[str, torch.Tensor]:
        per_step.append(counting.handed - sum(per_step))
        rows = len(batch["input_ids"])
        assert rows == 2 * per_step[-1]  # the stacked batch is what was handed out
        assert micro_batches == (per_step[-1] if per_step[-1] < 4 else None)
        return run(batch, micro_batches)

    session.run = counted_run
    return per_step


def weights_of(checkpoint: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(checkpoint / "weights.safetensors"))


def test_a_run_consumes_what_the_ramp_says_and_logs_the_batch_size(tmp_path: Path) -> None:
    with popbert.Trainer.from_config(small(), tmp_path / "run") as trainer:
        per_step = count_per_step(trainer)
        result = trainer.train()
    assert result.steps == 10
    assert per_step == RAMP == [warmup_micro_batches(s, 4, 0.8, 10) for s in range(10)]
    records = [json.loads(line)
               for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 11))
    # The global batch of each warming-up step (micro-batches x 2 sequences), while it is below
    # the full 8; then no more.
    assert [r.get("batch_size") for r in records] == [2, 2, 4, 4, 6, 6] + [None] * 4
    assert all(r["seq_per_s"] > 0 for r in records)


class ScriptedSession:
    """What the loop reads of a session: each run is one step of loss 1.0 and advances a clock
    by one second; it records the micro-batches per step it was given."""

    loss_name = "loss"
    loss_scaler = None
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.step = 0
        self.now = 0.0
        self.replicas = Replicas.single()
        self.given: list[int | None] = []

    def run(self, batch: Any, micro_batches: int | None = None) -> dict[str, torch.Tensor]:
        self.given.append(micro_batches)
        self.step += 1
        self.now += 1.0
        return {"loss": torch.ones(1)}


def test_seq_per_s_counts_the_sequences_actually_trained_on(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Windows of 3 steps, 1 s each: 2 + 4 + 8 sequences (two warming-up steps, then a full
    one of 8), then 3 full steps: 14 / 3 and 24 / 3 sequences per second; the first window's
    record carries the batch of its last step."""
    import types

    import popbert.train.loop as loop

    session = ScriptedSession()
    monkeypatch.setattr(loop, "time", types.SimpleNamespace(perf_counter=lambda: session.now))
    items = [PartialBatch({"x": torch.zeros(1)}, 1, 2), PartialBatch({"x": torch.zeros(2)}, 2, 4),
             *[{"x": torch.zeros(4)}] * 4]
    records: list[dict] = []
    tracker = types.SimpleNamespace(log=lambda record: records.append(dict(record)))
    train_loop(session, iter(items), LoopSettings(steps=6, log_every=3, samples_per_step=8),
               tracker=tracker)
    assert session.given == [1, 2, None, None, None, None]
    assert [r["step"] for r in records] == [3, 6]
    assert records[0]["seq_per_s"] == pytest.approx(14 / 3)
    assert records[1]["seq_per_s"] == pytest.approx(24 / 3)
    assert records[0]["batch_size"] == 8 and "batch_size" not in records[1]


def test_resume_in_the_middle_of_the_ramp_gives_bit_identical_weights(tmp_path: Path) -> None:
    """10 steps straight == resumed from the step-3 checkpoint (its next step takes 2
    micro-batches) and trained to 10, bit for bit, with dropout on."""
    cfg = small("training.checkpoint_every=3", "training.keep_checkpoints=0",
                "model.hidden_dropout=0.1", "model.attention_dropout=0.1")
    with popbert.Trainer.from_config(cfg, tmp_path / "straight") as trainer:
        straight = trainer.train()
    with popbert.Trainer.from_config(
            cfg, tmp_path / "resumed",
            resume=tmp_path / "straight" / "checkpoints" / "step-000003") as trainer:
        assert trainer.session.step == 3
        per_step = count_per_step(trainer)
        resumed = trainer.train()
    assert per_step == RAMP[3:]
    ours, theirs = weights_of(resumed.checkpoint), weights_of(straight.checkpoint)
    assert resumed.checkpoint.name == straight.checkpoint.name == "step-000010"
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_under_a_time_budget_the_ramp_follows_the_clock(tmp_path: Path) -> None:
    """As the learning rate does: at a spent fraction f the ramp is at step f x training.steps,
    whatever step the run is at."""
    cfg = small("training.steps=100", "training.time_budget=1h")
    with popbert.Trainer.from_config(cfg, tmp_path / "run") as trainer:
        for fraction, micro_batches in ((0.0, 1), (0.2, 2), (0.6, 4), (0.79, 4), (2.0, 4)):
            trainer.clock.elapsed = fraction * 3600
            for step in (0, 7, 5000):  # the optimizer's step does not matter
                trainer.session.step = step
                assert trainer.micro_batches_per_step() == micro_batches, (fraction, step)
                assert micro_batches == warmup_micro_batches(
                    trainer.schedule_step(step), 4, 0.8, 100)


# ---------------------------------------------------------------------------------------------
# What it refuses


def error_of(*overrides: str) -> str:
    with pytest.raises(ConfigError) as info:
        load_config("tiny", list(overrides))
    message = str(info.value)
    assert "\n" not in message, "config errors must be one line"
    return message


@pytest.mark.parametrize(("overrides", "keys", "fragment"), [
    ([], ("training.batch_warmup", "execution.gradient_accumulation"),
     "raise execution.gradient_accumulation"),
    (["execution.gradient_accumulation=4", "execution.pipeline=true",
      "model.layers_per_ipu=[1,1]"],
     ("training.batch_warmup", "execution.pipeline"), "not supported with execution.pipeline"),
    (["execution.gradient_accumulation=4", "execution.backend=popart", "model.dialect=popart"],
     ("training.batch_warmup", "execution.backend"), "needs execution.backend 'torch'"),
    (["execution.gradient_accumulation=4", "execution.device_iterations=2"],
     ("training.batch_warmup", "execution.device_iterations"),
     "set execution.device_iterations=1"),
])
def test_what_batch_warmup_cannot_do_is_refused_in_one_line(
        overrides: list[str], keys: tuple[str, ...], fragment: str) -> None:
    message = error_of("training.batch_warmup=0.1", *overrides)
    assert message.startswith("--set ") and fragment in message
    assert all(key in message for key in keys), message


@pytest.mark.parametrize("value", ["1", "-0.1", "1.5"])
def test_batch_warmup_is_a_fraction_below_one(value: str) -> None:
    message = error_of(f"training.batch_warmup={value}", "execution.gradient_accumulation=4")
    assert f"training.batch_warmup must be in [0, 1) (0 = off), got {float(value)}" in message


def test_the_cli_refuses_it_with_exit_2_and_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    from popbert.cli.main import main

    assert main(["config", "--set", "training.batch_warmup=0.1"]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("popbert: error: --set training.batch_warmup")
    assert "execution.gradient_accumulation, which is 1" in lines[0]
    assert load_config("tiny", ["training.batch_warmup=0.1",
                                "execution.gradient_accumulation=4"]).training.batch_warmup == 0.1
