"""The one door for a run: `Trainer.from_config` assembles a run, `train()` runs it, its state
round-trips, failures leave nothing behind, and fine-tuning is a config like any other (a run of
`popbert finetune` repeated from Python with public names only gives the same numbers)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
import torch
from trainer_helpers import count_budget_time

import popbert
from popbert.cli.main import main
from popbert.io import checkpoint as ckpt
from popbert.io.run_dir import checkpoint_dirs
from popbert.train.trainer import CheckpointManager

# A tiny BERT on the bundled corpus: a step takes a fraction of a second on 2 CPU cores.
SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=32",
         "model.max_position_embeddings=32", "model.max_predictions_per_seq=5",
         "execution.micro_batch_size=8", "execution.device=cpu", "training.log_every=1",
         "optimizer.warmup_steps=2"]
FRESH_HEAD = ["Classifier/W", "Classifier/B"]  # the classifier starts fresh; the rest is loaded
SENTIMENT = Path(__file__).resolve().parents[1] / "fixtures" / "classification" / "sentiment.tsv"


def small(*overrides: str) -> popbert.RunConfig:
    return popbert.load_config("tiny", [*SMALL, *overrides])


def weights_of(checkpoint: Path) -> dict[str, np.ndarray]:
    return safetensors.numpy.load_file(str(checkpoint / "weights.safetensors"))


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_from_config_assembles_the_run_and_train_finishes_it(tmp_path: Path) -> None:
    cfg = small("training.steps=4", "training.checkpoint_every=2")
    with popbert.Trainer.from_config(cfg, tmp_path / "run") as trainer:
        assert isinstance(trainer.session, popbert.Session)
        assert trainer.session.step == 0 and trainer.loader.num_samples > 0
        assert (tmp_path / "run" / "config.yaml").is_file()  # written once assembled
        assert popbert.load_config(tmp_path / "run" / "config.yaml") == cfg
        result = trainer.train()
    assert isinstance(result, popbert.RunResult)
    assert result.steps == 4 and result.steps_trained == 4 and result.seconds > 0
    assert result.checkpoint == tmp_path / "run" / "checkpoints" / "step-000004"
    assert [p.name for p in checkpoint_dirs(tmp_path / "run")] == ["step-000002", "step-000004"]
    assert result.inference_model == tmp_path / "run" / "model.inference.onnx"
    assert result.inference_model.is_file() and result.plot.is_file()
    logged = [json.loads(line) for line in
              (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in logged] == [1, 2, 3, 4]
    assert result.final_metrics["loss"] == pytest.approx(logged[-1]["loss"])
    assert set(result.final_metrics) <= set(logged[-1])


def test_state_dict_round_trips_to_the_same_numbers(tmp_path: Path) -> None:
    """A second trainer given the first one's state at step 2 (`load_state_dict`) trains to the
    very weights the first one reached at step 4."""
    cfg = small("training.steps=4", "training.checkpoint_every=2")
    with popbert.Trainer.from_config(cfg, tmp_path / "a") as first:
        first.train()
        assert set(first.state_dict()) == {"session", "loader", "trainer"}
    state = ckpt.load_checkpoint(tmp_path / "a" / "checkpoints" / "step-000002").state()
    with popbert.Trainer.from_config(cfg, tmp_path / "b") as second:
        second.load_state_dict(state)
        assert second.session.step == 2
        assert second.state_dict()["loader"] == state["loader"]
        second.train()
    ours = weights_of(tmp_path / "b" / "checkpoints" / "step-000004")
    theirs = weights_of(tmp_path / "a" / "checkpoints" / "step-000004")
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)


def test_evaluate_is_the_validation_means_or_nothing(tmp_path: Path) -> None:
    held_out = small("training.steps=2", "data.validation_fraction=0.05",
                     "training.eval_batches=1")
    with popbert.Trainer.from_config(held_out, tmp_path / "a") as trainer:
        scores = trainer.evaluate()
        assert {"val_loss", "val_mlm_loss", "val_mlm_accuracy", "val_nsp_accuracy"} <= set(scores)
        assert all(np.isfinite(v) for v in scores.values())
        assert trainer.evaluate() == scores  # no step between: the same weights, no dropout
    with popbert.Trainer.from_config(small("training.steps=2"), tmp_path / "b") as trainer:
        assert trainer.evaluate() == {}


def test_a_failure_before_training_leaves_no_directory(tmp_path: Path) -> None:
    with pytest.raises(RuntimeError, match="stop here"), \
            popbert.Trainer.from_config(small("training.steps=2"), tmp_path / "run"):
        raise RuntimeError("stop here")
    assert not (tmp_path / "run").exists()
    missing = f"data.input_files=['{tmp_path / 'none' / '*.hdf5'}']"
    with pytest.raises(popbert.PopbertError, match="none"):
        popbert.Trainer.from_config(small(missing), tmp_path / "bad-data")
    assert not (tmp_path / "bad-data").exists()


def test_the_checkpoint_manager_keeps_the_newest_good_ones(tmp_path: Path) -> None:
    manager = CheckpointManager(tmp_path, every=2, keep=1, is_main=True, config_yaml="{}\n")
    state = {"session": {"step": 0, "weights": {"w": torch.zeros(2)}}}
    assert manager.due(2, 1, 10) and not manager.due(3, 1, 10) and not manager.due(10, 1, 10)
    first = manager.save(2, state)
    assert manager.pending == first and manager.last_good is None
    manager.confirm()
    assert manager.last_good == first and manager.pending is None
    second = manager.save(4, state)
    manager.confirm()  # keep=1: the older good one goes
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step-000004"]
    third = manager.save(6, state)
    assert manager.diverged() == second and not third.exists()
    with pytest.raises(RuntimeError, match="finalize"):
        manager.finalize()
    final = manager.save(7, state)
    assert manager.finalize() == final == manager.last_good
    assert [p.name for p in checkpoint_dirs(tmp_path)] == ["step-000004", "step-000007"]


def test_a_fine_tuning_config_names_its_inputs_from_anywhere(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Relative paths given to a fine-tuning run are stored absolute in its config, so its
    config.yaml still names the checkpoint and data when read from another directory."""
    monkeypatch.chdir(tmp_path)
    cfg = popbert.finetune_config("classification", "pre", "data/train.tsv", "data/dev.tsv")
    f = cfg.finetune
    assert (f.checkpoint, f.train_file, f.eval_file) == (
        str(tmp_path / "pre"), str(tmp_path / "data" / "train.tsv"),
        str(tmp_path / "data" / "dev.tsv"))


@pytest.mark.e2e
def test_a_cli_finetuning_run_repeats_from_python(tmp_path: Path) -> None:
    """`popbert finetune classify` and the same run made with public names only
    (`popbert.finetune_config`, `popbert.Trainer`): the same scores and the same weights."""
    assert main(["pretrain", *[x for s in SMALL for x in ("--set", s)],
                 "--set", "training.steps=2", "-o", str(tmp_path / "pre")]) == 0
    flags = ["--epochs", "1", "--batch-size", "8", "--max-seq-length", "32", "--lr", "1e-3",
             "--device", "cpu", "--threads", "1", "--log-every", "1"]
    assert main(["finetune", "classify", "--checkpoint", str(tmp_path / "pre"), "--train",
                 str(SENTIMENT), "-o", str(tmp_path / "cli"), *flags]) == 0

    cfg = popbert.finetune_config("classification", tmp_path / "pre", SENTIMENT, overrides=[
        "finetune.epochs=1", "execution.micro_batch_size=8", "finetune.max_seq_length=32",
        "optimizer.lr=1e-3", "execution.device=cpu", "execution.threads=1",
        "training.log_every=1"])
    with popbert.Trainer.from_config(cfg, tmp_path / "api") as trainer:
        result = trainer.train()
    assert result.fresh == FRESH_HEAD
    # The head's starting weights are the user's to set, between assembly and training.
    with popbert.Trainer.from_config(cfg, tmp_path / "head") as trainer:
        assert trainer.fresh == FRESH_HEAD
        trainer.session.load_weights({"Classifier/B": torch.tensor([0.5, -0.5])}, strict=False)
        assert trainer.session.weights()["Classifier/B"].tolist() == [0.5, -0.5]
    cli_scores = json.loads((tmp_path / "cli" / "eval_results.json").read_text())
    assert result.metrics == cli_scores
    assert losses(tmp_path / "api") == losses(tmp_path / "cli")
    ours, theirs = weights_of(result.checkpoint), weights_of(
        tmp_path / "cli" / "checkpoints" / result.checkpoint.name)
    assert ours.keys() == theirs.keys()
    for key in ours:
        np.testing.assert_array_equal(ours[key], theirs[key], err_msg=key)
    configs = [popbert.load_config(tmp_path / run / "config.yaml") for run in ("api", "cli")]
    assert [c.data.vocab_file for c in configs] == [
        str(tmp_path / run / "vocab.txt") for run in ("api", "cli")]  # each run's own copy
    stripped = [dataclasses.replace(c, data=dataclasses.replace(c.data, vocab_file=None))
                for c in configs]
    assert stripped[0] == stripped[1]


def test_under_a_time_budget_the_schedule_follows_the_clock(tmp_path: Path) -> None:
    """Warmup over the first 20% of the budget, then linear decay: the rate at a spent fraction
    f is the schedule's at step f x training.steps, whatever step the run is at."""
    cfg = small("training.steps=100", "training.time_budget=1h", "optimizer.warmup_steps=20",
                "optimizer.lr=1e-3")
    with popbert.Trainer.from_config(cfg, tmp_path / "run") as trainer:
        for fraction, expected_step in ((0.0, 0), (0.1, 10), (0.5, 50), (0.999, 99), (2.0, 99)):
            trainer.clock.elapsed = fraction * 3600
            for step in (0, 7, 5000):  # the optimizer's step does not matter
                trainer.session.step_hook(step)
                assert trainer.lr == pytest.approx(trainer.schedule(expected_step))
        assert trainer.schedule(10) < trainer.schedule(20) > trainer.schedule(50)  # warm, decay
    without = small("training.steps=100", "optimizer.warmup_steps=20")
    with popbert.Trainer.from_config(without, tmp_path / "steps") as trainer:
        trainer.clock.elapsed = 1800
        trainer.session.step_hook(7)
        assert trainer.lr == pytest.approx(trainer.schedule(7))


@pytest.mark.e2e
def test_a_budgeted_run_stops_on_time_and_resumes_the_same_budget(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    count_budget_time(monkeypatch)  # the same steps however loaded the machine is
    run = tmp_path / "run"
    cfg = small("training.steps=1000000", "training.time_budget=3s",
                "training.checkpoint_every=3", "training.keep_checkpoints=0")
    with popbert.Trainer.from_config(cfg, run) as trainer:
        first = trainer.train()
    assert 0 < first.steps < 1000000  # the budget, not training.steps, ended it
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and records[-1]["step"] == first.steps
    saved = json.loads((first.checkpoint / "state.json").read_text())["trainer"]
    assert 0 < saved["elapsed_s"] <= first.elapsed_s <= 3  # saved when written: at most the end
    shorter = small("training.steps=1000000", "training.time_budget=0.5s")
    with pytest.raises(popbert.PopbertError, match="raise training.time_budget"):
        popbert.Trainer.from_config(shorter, run, resume=run)  # that budget is spent
    longer = small("training.steps=1000000", "training.time_budget=6s",
                   "training.checkpoint_every=3", "training.keep_checkpoints=0")
    with popbert.Trainer.from_config(longer, run, resume=run) as trainer:
        assert trainer.clock.elapsed == saved["elapsed_s"]
        second = trainer.train()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    resumed = [r for r in records if r["step"] > first.steps]
    assert second.steps > first.steps and resumed
    assert resumed[0]["elapsed_s"] > saved["elapsed_s"]  # the clock went on from the checkpoint
    assert second.elapsed_s <= 6
