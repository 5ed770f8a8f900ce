"""What the task tests share: one small pre-trained checkpoint to fine-tune from."""

from __future__ import annotations

from pathlib import Path

import pytest

from popbert.cli.main import main


@pytest.fixture(scope="session")
def pretrained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny BERT (one layer, hidden 64) pre-trained two steps on the bundled corpus."""
    run = tmp_path_factory.mktemp("pretrained") / "run"
    assert main(["pretrain", "--config", "tiny", "--set", "training.steps=2", "--set",
                 "model.num_layers=1", "--set", "model.hidden_size=64", "--set",
                 "model.intermediate_size=128", "--set", "model.num_heads=2", "-o",
                 str(run)]) == 0
    return run
