"""The one training loop on a scripted session: what it logs, when it evaluates and
checkpoints, and how it stops (batches run out, divergence, a caller's request).

The session here returns losses written in the test, so each rule is checked on its own,
without a model; `tests/train/test_run_lifecycle.py` checks the same rules on whole runs.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from popbert.distributed import Replicas
from popbert.train.loop import (
    LoopSettings,
    RunInterrupted,
    RunStopped,
    StopSignals,
    TrainingClock,
    TrainingDiverged,
    train_loop,
)
from popbert.train.trainer import CheckpointManager


class ScriptedSession:
    """A session whose step `i` (1-based) has the loss `losses[i - 1]`; `evaluate` returns the
    batch's `x` as its loss. What the loop reads of `popbert.runtime.protocol.Session`."""

    loss_name = "loss"
    loss_scaler = None
    device = torch.device("cpu")

    def __init__(self, losses: list[float], steps_per_run: int = 1, seconds_per_run: float = 0,
                 seconds_per_evaluation: float = 0):
        self.losses = losses
        self.seconds_per_run = seconds_per_run
        self.seconds_per_evaluation = seconds_per_evaluation
        self.now = 0.0  # a clock each run advances by `seconds_per_run`
        self.steps_per_run = steps_per_run
        self.step = 0
        self.replicas = Replicas.single()
        self.evaluated: list[int] = []

    def run(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        losses = self.losses[self.step:self.step + self.steps_per_run]
        self.step += len(losses)
        self.now += self.seconds_per_run
        return {"loss": torch.tensor(losses), "accuracy": torch.full((len(losses),), 0.5)}

    def evaluate(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        self.evaluated.append(self.step)
        self.now += self.seconds_per_evaluation
        return {"loss": batch["x"].float().mean()}

    def weights(self) -> dict[str, torch.Tensor]:
        return {"w": torch.ones(2)}


def batches(count: int = 1000) -> Iterator[dict[str, torch.Tensor]]:
    for _ in range(count):
        yield {"x": torch.zeros(1)}


class Tracker:
    def __init__(self) -> None:
        self.records: list[dict] = []

    def log(self, record: dict) -> None:
        self.records.append(dict(record))


def test_logs_window_means_every_log_every_steps_and_the_last() -> None:
    session = ScriptedSession([float(i) for i in range(1, 8)])
    tracker = Tracker()
    result = train_loop(session, batches(), LoopSettings(steps=7, log_every=3,
                                                         samples_per_step=4),
                        schedule=lambda step: 0.1 * step, tracker=tracker)
    assert [r["step"] for r in tracker.records] == [3, 6, 7]
    assert [r["loss"] for r in tracker.records] == [2.0, 5.0, 7.0]  # each window's mean
    assert [r["lr"] for r in tracker.records] == pytest.approx([0.2, 0.5, 0.6])  # step - 1
    assert all(r["seq_per_s"] > 0 and r["accuracy"] == 0.5 for r in tracker.records)
    assert result.steps_trained == 7 and result.record == tracker.records[-1]


def test_several_steps_per_run_count_as_several_steps() -> None:
    session = ScriptedSession([1.0] * 8, steps_per_run=2)
    tracker = Tracker()
    result = train_loop(session, batches(), LoopSettings(steps=8, log_every=3), tracker=tracker)
    assert session.step == 8 and result.steps_trained == 8
    assert [r["step"] for r in tracker.records] == [4, 6, 8]  # runs that crossed 3, 6 and the end


def test_stops_when_the_batches_run_out() -> None:
    session = ScriptedSession([1.0] * 10)
    result = train_loop(session, batches(4), LoopSettings(steps=10, log_every=1))
    assert result.steps_trained == 4 and session.step == 4


def test_evaluates_every_eval_every_steps_and_logs_those_steps() -> None:
    session = ScriptedSession([1.0] * 6)
    tracker = Tracker()
    validation = [{"x": torch.tensor([2.0])}, {"x": torch.tensor([4.0])}]
    train_loop(session, batches(), LoopSettings(steps=6, log_every=5, eval_every=2),
               tracker=tracker, validation=validation)
    assert session.evaluated == [2, 2, 4, 4, 6, 6]  # both batches at each evaluated step
    assert [r["step"] for r in tracker.records] == [2, 4, 5, 6]
    assert [r.get("val_loss") for r in tracker.records] == [3.0, 3.0, None, 3.0]
    with pytest.raises(ValueError, match="eval_every .*needs validation"):
        train_loop(ScriptedSession([1.0]), batches(), LoopSettings(steps=1, eval_every=1))


def manager(tmp_path: Path, every: int) -> CheckpointManager:
    return CheckpointManager(tmp_path, every=every, keep=0, is_main=True, config_yaml="{}\n")


def saver(session: ScriptedSession, checkpoints: CheckpointManager):
    def save() -> Path:
        return checkpoints.save(session.step, {"session": {"step": session.step,
                                                           "weights": session.weights()}})
    return save


def test_checkpoints_when_due_but_not_at_the_last_step(tmp_path: Path) -> None:
    session = ScriptedSession([1.0] * 7)
    checkpoints = manager(tmp_path, every=3)
    result = train_loop(session, batches(), LoopSettings(steps=6, log_every=10),
                        checkpoints=checkpoints, save=saver(session, checkpoints))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000003"]
    assert result.checkpoint == tmp_path / "checkpoints" / "step-000003"  # step 4's loss passed


@pytest.mark.parametrize(("losses", "factor", "what"), [
    ([2.0, 2.0, 2.0, math.nan], 0.0, "the loss is not finite"),
    ([2.0, 2.0, 2.0, 250.0], 100.0, "exceeds 100× the first step's"),
])
def test_divergence_stops_at_once_and_drops_the_checkpoint_it_followed(
        tmp_path: Path, losses: list[float], factor: float, what: str) -> None:
    session = ScriptedSession(losses)
    checkpoints, tracker = manager(tmp_path, every=1), Tracker()
    with pytest.raises(TrainingDiverged, match=what) as error:
        train_loop(session, batches(), LoopSettings(steps=4, log_every=10,
                                                    divergence_factor=factor),
                   tracker=tracker, checkpoints=checkpoints, save=saver(session, checkpoints))
    assert error.value.step == 4
    assert error.value.last_good == tmp_path / "checkpoints" / "step-000002"
    assert "step-000002" in str(error.value)
    # step 3's checkpoint holds the weights the bad loss came from: removed.
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "step-000001", "step-000002"]
    assert tracker.records[-1]["step"] == 4  # the diverged step is on the record


def test_a_caller_can_stop_the_run_after_a_record() -> None:
    session = ScriptedSession([1.0] * 10)
    tracker = Tracker()
    seen: list[int] = []

    def on_record(step: int, record: dict) -> str | None:
        seen.append(step)
        return "pruned" if step == 4 else None

    with pytest.raises(RunStopped, match="run stopped at step 4: pruned"):
        train_loop(session, batches(), LoopSettings(steps=10, log_every=2), tracker=tracker,
                   on_record=on_record)
    assert seen == [2, 4] and [r["step"] for r in tracker.records] == [2, 4]


@pytest.mark.parametrize("name", ["SIGTERM", "SIGUSR1"])
def test_a_stop_signal_ends_the_loop_after_the_current_step(name: str) -> None:
    """What a scheduler sends before it kills a job: the step under way finishes, the loop
    ends and says which signal (the caller checkpoints); the handlers go again after."""
    import os
    import signal

    number = getattr(signal, name)
    before = signal.getsignal(number)

    class Signalled(ScriptedSession):
        def run(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            if self.step == 3:
                os.kill(os.getpid(), number)  # arrives during step 4
            return super().run(batch)

    session = Signalled([1.0] * 10)
    with StopSignals() as stop:
        result = train_loop(session, batches(), LoopSettings(steps=10, log_every=1),
                            stop=stop)
        os.kill(os.getpid(), number)  # a second one changes nothing
    assert session.step == 4 and result.stop_signal == number and stop.received == number
    assert signal.getsignal(number) is before
    # At the last step there is nothing left to stop: the run finishes.
    session = Signalled([1.0] * 4)
    with StopSignals() as stop:
        result = train_loop(session, batches(), LoopSettings(steps=4, log_every=1), stop=stop)
    assert session.step == 4 and result.stop_signal == 0 and stop.received == number


def test_an_interrupted_run_says_where_and_exits_for_a_requeue() -> None:
    import signal

    stopped = RunInterrupted(12, signal.SIGTERM, Path("runs/a/checkpoints/step-000012"),
                             Path("runs/a"))
    assert str(stopped) == ("stopped by SIGTERM at step 12; checkpoint "
                            "runs/a/checkpoints/step-000012; resume with --resume runs/a")
    assert stopped.exit_status == 143 and isinstance(stopped, KeyboardInterrupt)
    finetuned = RunInterrupted(3, signal.SIGUSR1, Path("ft/checkpoints/step-000003"),
                               Path("ft"), resumable=False)
    assert str(finetuned) == "stopped by SIGUSR1 at step 3; checkpoint ft/checkpoints/step-000003"
    assert finetuned.exit_status == 138


def test_a_time_budget_stops_before_a_run_would_overrun_it() -> None:
    """Runs of 1 s, a 10 s budget with 2 s kept for the final checkpoint: 8 runs (the 9th would
    end at 9 s, into the reserve); `training.steps` (3 here) does not stop a budgeted run."""
    session = ScriptedSession([1.0] * 50, seconds_per_run=1.0)
    clock = TrainingClock(budget=10.0, now=lambda: session.now)
    clock.reserve = 2.0
    tracker = Tracker()
    result = train_loop(session, batches(), LoopSettings(steps=3, log_every=2), tracker=tracker,
                        clock=clock)
    assert session.step == 8 and result.steps_trained == 8 and clock.elapsed == 8.0
    assert [r["step"] for r in tracker.records] == [2, 4, 6, 8]
    assert [r["elapsed_s"] for r in tracker.records] == [2.0, 4.0, 6.0, 8.0]
    odd = ScriptedSession([1.0] * 50, seconds_per_run=1.0)  # stops between two logged steps
    clock = TrainingClock(budget=7.0, now=lambda: odd.now)
    tracker = Tracker()
    train_loop(odd, batches(), LoopSettings(steps=3, log_every=2), tracker=tracker, clock=clock)
    assert [r["step"] for r in tracker.records] == [2, 4, 6, 7]  # the last window is logged
    # Without a budget the same loop stops at training.steps.
    unbudgeted = ScriptedSession([1.0] * 50, seconds_per_run=1.0)
    assert train_loop(unbudgeted, batches(), LoopSettings(steps=3, log_every=2)).steps_trained == 3


def test_validation_seconds_are_not_training_seconds() -> None:
    """Runs of 1 s and an evaluation of 5 s every 2 steps: elapsed_s counts the runs only, and a
    10 s budget still trains 10 steps (how often a run is measured does not move its curve);
    the negative control is the same loop without validation, whose clock reads the same.
    (Evaluations may take up to 10x the budget here; two are timed before the first step.)"""
    session = ScriptedSession([1.0] * 50, seconds_per_run=1.0, seconds_per_evaluation=5.0)
    clock = TrainingClock(budget=10.0, now=lambda: session.now)
    tracker = Tracker()
    validation = [{"x": torch.tensor([2.0])}]
    train_loop(session, batches(),
               LoopSettings(steps=100, log_every=1, eval_every=2, eval_share=10.0),
               tracker=tracker, validation=validation, clock=clock)
    assert session.step == 10 and session.evaluated == [0, 0, 2, 4, 6, 8, 10]
    assert [r["elapsed_s"] for r in tracker.records] == [float(i) for i in range(1, 11)]
    assert session.now == 10.0 + 7 * 5.0  # the evaluations did take (scripted) time
    plain = ScriptedSession([1.0] * 50, seconds_per_run=1.0)
    plain_tracker = Tracker()
    train_loop(plain, batches(), LoopSettings(steps=100, log_every=1), tracker=plain_tracker,
               clock=TrainingClock(budget=10.0, now=lambda: plain.now))
    assert [r["elapsed_s"] for r in plain_tracker.records] == \
        [r["elapsed_s"] for r in tracker.records]


def test_eval_points_measure_at_fractions_of_the_budget_and_at_the_end() -> None:
    """Runs of 1 s, a 10 s budget with 1 s kept back, eval_points=4: evaluations when 2.5, 5
    and 7.5 s are spent (after the runs ending at 3, 5 and 8 s), and once more on the final
    weights (step 9); steps are not what decides it. (Evaluations of 0.7 s may take up to 10x
    the budget here, so none is left out; two are timed before the first step.)"""
    session = ScriptedSession([1.0] * 50, seconds_per_run=1.0, seconds_per_evaluation=0.7)
    clock = TrainingClock(budget=10.0, now=lambda: session.now)
    clock.reserve = 1.0
    tracker = Tracker()
    settings = LoopSettings(steps=100, log_every=100, eval_points=4, eval_share=10.0)
    train_loop(session, batches(), settings,
               tracker=tracker, validation=[{"x": torch.tensor([2.0])}], clock=clock)
    assert session.step == 9 and session.evaluated == [0, 0, 3, 5, 8, 9]
    assert [(r["step"], r["elapsed_s"]) for r in tracker.records] == [
        (3, 3.0), (5, 5.0), (8, 8.0), (9, 9.0)]
    assert all(r["val_loss"] == 2.0 for r in tracker.records)
    # Resumed at 6 s: the next point is 7.5 s, then the end.
    resumed = ScriptedSession([1.0] * 50, seconds_per_run=1.0)
    clock = TrainingClock(budget=10.0, elapsed=6.0, now=lambda: resumed.now)
    train_loop(resumed, batches(), settings,
               validation=[{"x": torch.tensor([2.0])}], clock=clock)
    assert resumed.evaluated == [0, 0, 2, 4]


def test_a_resumed_clock_continues_the_same_budget() -> None:
    session = ScriptedSession([1.0] * 50, seconds_per_run=1.0)
    clock = TrainingClock(budget=10.0, elapsed=6.0, now=lambda: session.now)  # 6 s already spent
    tracker = Tracker()
    train_loop(session, batches(), LoopSettings(steps=100, log_every=1), tracker=tracker,
               clock=clock)
    assert session.step == 4  # the runs ending at 7, 8, 9 and 10 s; the next would overrun
    assert [r["elapsed_s"] for r in tracker.records] == [7.0, 8.0, 9.0, 10.0]
    assert clock.progress() == 1.0
