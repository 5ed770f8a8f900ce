"""The time-to-quality presets as a user runs them: a time budget and plain-text files, nothing
else. `fast` (ModernBERT) and `groupbert-fast` (GroupBERT, `fast` until ModernBERT beat it).

    popbert pretrain --config fast --set training.time_budget=600 \
        --set data.input_files=[train.txt] --set data.validation_files=[heldout.txt] -o DIR

(here with an 8 s budget, 2 validation batches and each preset's model at a quarter of its width
with micro-batches of 8, to keep the test short, on documents of the bundled corpus split into
two text files: the data layout, budget, evaluation points and export are the preset's own).
The budget is kept on a `CountingClock`, so the run trains the same steps however loaded the
machine is.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from trainer_helpers import count_budget_time

from popbert.cli.main import main
from popbert.data import bundled_corpus_path
from popbert.io.run_dir import checkpoint_dirs

pytestmark = pytest.mark.e2e
BUDGET = 8.0
# A quarter of each preset's width (GroupBERT's convolution groups of 16 channels still divide it).
NARROW = {"fast": ["model.hidden_size=64", "model.intermediate_size=96", "model.num_heads=2",
                   "execution.micro_batch_size=8"],
          "groupbert-fast": ["model.hidden_size=64", "model.intermediate_size=256",
                             "model.num_heads=2", "execution.micro_batch_size=8"]}


def split_corpus(tmp_path: Path) -> tuple[Path, Path]:
    """Train on 300 documents of the bundled corpus, validate on 40 others (whole documents)."""
    documents = bundled_corpus_path().read_text(encoding="utf-8").strip().split("\n\n")
    train, heldout = tmp_path / "train.txt", tmp_path / "heldout.txt"
    train.write_text("\n\n".join(documents[:300]) + "\n", encoding="utf-8")
    heldout.write_text("\n\n".join(documents[300:340]) + "\n", encoding="utf-8")
    return train, heldout


@pytest.mark.parametrize("preset", sorted(NARROW))
def test_fast_trains_on_text_files_within_its_budget(tmp_path: Path, preset: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    count_budget_time(monkeypatch)
    train, heldout = split_corpus(tmp_path)
    run = tmp_path / "run"
    assert main(["pretrain", "--config", preset, "--set", f"training.time_budget={BUDGET:g}",
                 "--set", f"data.input_files=[{train}]",
                 "--set", f"data.validation_files=[{heldout}]", "--set", "training.eval_batches=2",
                 *[arg for key in NARROW[preset] for arg in ("--set", key)], "-o", str(run)]) == 0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert records and all("elapsed_s" in r for r in records)
    elapsed = [r["elapsed_s"] for r in records]
    assert elapsed == sorted(elapsed) and elapsed[-1] <= BUDGET
    # Evaluated at tenths of the budget (eval_points: 10) and on the final weights.
    evaluated = [r for r in records if "val_mlm_loss" in r]
    assert len(evaluated) >= 3 and evaluated[-1]["step"] == records[-1]["step"]
    assert evaluated[-1]["val_mlm_loss"] < evaluated[0]["val_mlm_loss"]
    assert "nsp_loss" not in records[-1]  # MLM only
    assert (run / "model.inference.onnx").is_file() and (run / "metrics.png").is_file()
    final = checkpoint_dirs(run)[-1]
    state = json.loads((final / "state.json").read_text())
    assert state["trainer"]["elapsed_s"] <= BUDGET
