"""Fine-tuning's learning rate and epochs suit the checkpoint's size when the user names neither:
BERT-Base (and wider) keeps the BERT paper's recipe, a small model gets the far larger rate
and the more epochs measured for it (`benchmarks/finetune_defaults.py`), said in one log line;
whatever the command line, `--set` or a `--config` file names wins."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from trainer_helpers import run_pretraining

import popbert
from popbert.cli.main import main
from popbert.train.finetune import (
    BASE_WIDTH,
    SIZE_DEFAULTS,
    SMALL_WIDTH,
    finetune_config,
    finetune_defaults,
)

SENTIMENT = Path(__file__).resolve().parents[1] / "fixtures" / "classification" / "sentiment.tsv"
# A tiny BERT (hidden 32: a small model) pre-trained for one step.
SMALL = ["model.num_layers=1", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=32",
         "model.max_position_embeddings=32", "model.max_predictions_per_seq=5",
         "execution.micro_batch_size=8", "execution.device=cpu", "execution.threads=1",
         "training.steps=1"]


@pytest.fixture(scope="module")
def small_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("small") / "pre"
    run_pretraining(popbert.load_config("tiny", SMALL), run)
    return run


def test_the_defaults_follow_the_width_of_the_checkpoints_config() -> None:
    """From the config alone (no checkpoint, no training): BERT-Base keeps the presets' recipe,
    `fast` (hidden 256) and narrower take the small-model values, a MiniLM-wide model (384)
    lies between, log-linear in the width."""
    base = popbert.load_config("base-128").model
    assert base.hidden_size == BASE_WIDTH
    presets = {task: (popbert.load_config(f"finetune-{task}").optimizer.lr,
                      popbert.load_config(f"finetune-{task}").finetune.epochs)
               for task in SIZE_DEFAULTS}
    for task in SIZE_DEFAULTS:
        assert finetune_defaults(task, base) == SIZE_DEFAULTS[task][1] == presets[task]
    fast = popbert.load_config("fast").model
    tiny = popbert.load_config("tiny").model
    assert fast.hidden_size == SMALL_WIDTH and tiny.hidden_size < SMALL_WIDTH
    assert finetune_defaults("classification", fast) == SIZE_DEFAULTS["classification"][0] \
        == finetune_defaults("classification", tiny) == (1e-3, 10)
    minilm = popbert.load_config("fast", ["model.hidden_size=384", "model.num_heads=6"]).model
    lr, epochs = finetune_defaults("classification", minilm)
    assert 2e-5 < lr < 1e-3 and 3 < epochs < 10
    assert (lr, epochs) == (2.4e-4, 7)  # 1e-3 x (2e-5 / 1e-3)^(ln 1.5 / ln 3), to 2 digits


def test_a_small_checkpoint_gets_its_defaults_said_in_one_line(
        small_checkpoint: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cfg = finetune_config("classification", small_checkpoint, SENTIMENT, overrides=[
        "finetune.max_seq_length=32", "execution.micro_batch_size=8", "execution.device=cpu"])
    assert (cfg.optimizer.lr, cfg.finetune.epochs) == (1e-3, 10)
    assert cfg.finetune.chosen_by_size == ["lr", "epochs"]
    with caplog.at_level(logging.INFO, logger="popbert"), \
            popbert.Trainer.from_config(cfg, tmp_path / "run") as trainer:
        assert trainer.cfg.training.steps == 10 * 2  # 16 examples in batches of 8, 10 epochs
    said = [r.getMessage() for r in caplog.records if "to choose" in r.getMessage()]
    assert len(said) == 1 and said[0].startswith(
        "lr 0.001, epochs 10: defaults for a checkpoint of hidden size 32 (") and \
        said[0].endswith("M parameters); --lr/--epochs to choose"), said


@pytest.mark.parametrize(("overrides", "lr", "epochs", "chosen"), [
    (["optimizer.lr=5e-5"], 5e-5, 10, ["epochs"]),
    (["finetune.epochs=2"], 1e-3, 2, ["lr"]),
    (["optimizer.lr=2e-5", "finetune.epochs=3"], 2e-5, 3, []),
])
def test_what_the_user_names_wins(small_checkpoint: Path, overrides: list[str], lr: float,
                                  epochs: int, chosen: list[str]) -> None:
    """--lr and --epochs are these overrides (`FLAG_KEYS`), as --set is: each one named is
    kept, even at the presets' own value, and only the other is chosen."""
    cfg = finetune_config("classification", small_checkpoint, SENTIMENT, overrides=overrides)
    assert (cfg.optimizer.lr, cfg.finetune.epochs) == (lr, epochs)
    assert cfg.finetune.chosen_by_size == chosen


def test_the_checkpoint_sized_is_the_one_the_run_starts_from(small_checkpoint: Path) -> None:
    """A `finetune.checkpoint` override replaces the checkpoint given: its size counts; one
    that cannot be read chooses nothing (the run then says what is wrong with it)."""
    cfg = finetune_config("classification", "elsewhere", SENTIMENT,
                          overrides=[f"finetune.checkpoint={small_checkpoint}"])
    assert (cfg.optimizer.lr, cfg.finetune.epochs) == (1e-3, 10)
    cfg = finetune_config("classification", small_checkpoint, SENTIMENT,
                          overrides=["finetune.checkpoint=elsewhere"])
    assert (cfg.optimizer.lr, cfg.finetune.epochs, cfg.finetune.chosen_by_size) == (2e-5, 3, [])


def test_a_config_file_that_names_them_wins(small_checkpoint: Path, tmp_path: Path) -> None:
    """A --config file laid over the task's preset: what it names is the user's; what it does
    not is chosen by size (the preset's own values are BERT-Base's, not the user's)."""
    named = tmp_path / "mine.yaml"
    named.write_text("preset: finetune-classification\noptimizer:\n  lr: 2.0e-5\n")
    cfg = finetune_config("classification", small_checkpoint, SENTIMENT, config=named)
    assert (cfg.optimizer.lr, cfg.finetune.epochs) == (2e-5, 10)
    silent = tmp_path / "silent.yaml"
    silent.write_text("preset: finetune-classification\nexecution:\n  micro_batch_size: 8\n")
    cfg = finetune_config("classification", small_checkpoint, SENTIMENT, config=silent)
    assert (cfg.optimizer.lr, cfg.finetune.epochs) == (1e-3, 10)
    assert cfg.execution.micro_batch_size == 8


def test_squad_takes_the_small_rate_and_its_own_epochs() -> None:
    """SQuAD's small-model rate is classification's (not measured on SQuAD here); its epochs
    stay the preset's 2, BERT-Base keeps 5e-5."""
    assert finetune_defaults("squad", popbert.load_config("fast").model) == (1e-3, 2)
    assert finetune_defaults("squad", popbert.load_config("base-128").model) == (5e-5, 2)


@pytest.mark.e2e
def test_the_cli_writes_the_chosen_values_into_the_runs_config(
        small_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`popbert finetune classify` without --lr/--epochs trains with the size's defaults (the
    run's config.yaml records them, so the run can be repeated); with them, with those."""
    common = ["finetune", "classify", "--checkpoint", str(small_checkpoint), "--train",
              str(SENTIMENT), "--batch-size", "8", "--max-seq-length", "32", "--device", "cpu",
              "--threads", "1"]
    assert main([*common, "-o", str(tmp_path / "defaults")]) == 0
    assert "lr 0.001, epochs 10: defaults for a checkpoint of hidden size 32" in \
        capsys.readouterr().err
    cfg = popbert.load_config(tmp_path / "defaults" / "config.yaml")
    assert (cfg.optimizer.lr, cfg.finetune.epochs, cfg.training.steps) == (1e-3, 10, 20)
    assert main([*common, "--lr", "3e-5", "--epochs", "1", "-o", str(tmp_path / "given")]) == 0
    assert "to choose" not in capsys.readouterr().err
    cfg = popbert.load_config(tmp_path / "given" / "config.yaml")
    assert (cfg.optimizer.lr, cfg.finetune.epochs, cfg.training.steps) == (3e-5, 1, 2)
    assert cfg.finetune.chosen_by_size == []
    # A run refused at its start says one line, the refusal: the choice is said once it starts.
    assert main([*common, "--set", "finetune.label_column=nope", "-o", str(tmp_path / "no")]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and err[0].startswith("popbert: error: "), err
