"""A real run tracked by real W&B in offline mode (no account, no network): the offline run file
holds the run's group, name and config, every logged step, the final metrics in its summary and
the final checkpoint as a model artifact.

wandb 0.31 writes no `files/config.yaml` or `wandb-summary.json` for an offline run (those come
from `wandb sync`); everything is in the run's `.wandb` file, a LevelDB-style log of protobuf
`Record`s, which `offline_records` (tests/wandb_offline.py) reads with wandb's own protobuf classes.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from wandb_offline import offline_records

from popbert.cli.main import main
from popbert.observe.tracking import read_metrics

pytestmark = pytest.mark.e2e

wandb = pytest.importorskip("wandb")
wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

GROUP = "sweep-test-group"
RUN_NAME = "trial-0007"
TINY = ["model.num_layers=1", "model.hidden_size=64", "model.intermediate_size=128",
        "model.sequence_length=64", "model.max_position_embeddings=64",
        "model.max_predictions_per_seq=10", "execution.micro_batch_size=8",
        "optimizer.lr=0.002", "optimizer.warmup_steps=1", "training.steps=4",
        "training.log_every=2", "data.validation_fraction=0.02", "training.eval_batches=1",
        "training.eval_every=2"]
TRACKING = ["tracking.backend=wandb", f"tracking.group={GROUP}",
            f"tracking.run_name={RUN_NAME}", "tracking.log_checkpoint=true"]

def _key(item: Any) -> str:
    return item.key or "/".join(item.nested_key)


@contextlib.contextmanager
def offline_wandb(directory: Path) -> Iterator[Path]:
    """W&B in offline mode, writing under `directory`; yields the one run file it wrote.
    wandb reads WANDB_* once per process setup, hence the teardown on both sides."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("WANDB_MODE", "offline")
        mp.setenv("WANDB_DIR", str(directory))
        mp.setenv("WANDB_SILENT", "true")
        directory.mkdir()
        wandb.teardown()
        try:
            yield directory
        finally:
            wandb.teardown()


def parse_offline_run(directory: Path) -> dict[str, Any]:
    """The records of the one offline run under `directory`, by kind."""
    files = sorted(directory.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(files) == 1, files
    parsed: dict[str, Any] = {"run": None, "summary": {}, "history": [], "artifacts": []}
    for record in offline_records(files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            parsed["run"] = record.run
        elif kind == "summary":
            for item in record.summary.update:
                parsed["summary"][_key(item)] = json.loads(item.value_json)
        elif kind == "history":
            parsed["history"].append({_key(i): json.loads(i.value_json)
                                      for i in record.history.item})
        elif kind == "artifact":
            parsed["artifacts"].append(record.artifact)
    return parsed


@pytest.fixture(scope="module")
def tracked(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """ONE tracked run for the file (each W&B run costs a service round trip); its parsed
    offline records."""
    root = tmp_path_factory.mktemp("wandb")
    run_dir = root / "run"
    with offline_wandb(root / "wandb-dir"):
        args = ["pretrain", "--output-dir", str(run_dir)]
        for override in TINY + TRACKING:
            args += ["--set", override]
        assert main(args) == 0
    return {"run_dir": run_dir, **parse_offline_run(root / "wandb-dir")}


def test_run_has_group_name_and_the_whole_config(tracked: dict[str, Any]) -> None:
    run = tracked["run"]
    assert run is not None
    assert run.run_group == GROUP and run.display_name == RUN_NAME
    assert run.project == "popbert"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    saved = yaml.safe_load((tracked["run_dir"] / "config.yaml").read_text())
    for section in ("model", "optimizer", "training", "tracking"):
        assert config[section] == saved[section], section
    assert config["optimizer"]["lr"] == 0.002 and config["model"]["hidden_size"] == 64
    # The resumable link from the run directory to its W&B run.
    assert (tracked["run_dir"] / "wandb_run_id").read_text() == run.run_id


def test_every_step_and_the_final_metrics(tracked: dict[str, Any]) -> None:
    records = read_metrics(tracked["run_dir"] / "metrics.jsonl")
    assert [r["step"] for r in records] == [2, 4]
    history = {row["_step"]: row for row in tracked["history"]}
    assert sorted(history) == [2, 4]
    for record in records:
        row = history[record["step"]]
        for key in ("loss", "mlm_loss", "val_mlm_loss", "lr"):
            assert row[key] == pytest.approx(record[key], rel=1e-12), key
    summary, last = tracked["summary"], records[-1]
    assert summary["step"] == 4
    for key in ("loss", "mlm_loss", "nsp_loss", "val_loss", "val_mlm_loss", "mlm_accuracy"):
        assert summary[key] == pytest.approx(last[key], rel=1e-12), key


def test_final_checkpoint_is_a_model_artifact(tracked: dict[str, Any]) -> None:
    (artifact,) = tracked["artifacts"]
    run = tracked["run"]
    assert artifact.type == "model" and artifact.name == f"checkpoint-{run.run_id}"
    assert json.loads(artifact.metadata) == {"step": 4, "checkpoint": "step-000004"}
    checkpoint = tracked["run_dir"] / "checkpoints" / "step-000004"
    on_disk = {p.relative_to(checkpoint).as_posix(): p.stat().st_size
               for p in checkpoint.rglob("*") if p.is_file()}
    uploaded = {entry.path: entry.size for entry in artifact.manifest.contents}
    assert uploaded == on_disk and "weights.safetensors" in uploaded


def test_finetuning_checkpoint_and_scores_reach_the_run(tracked: dict[str, Any],
                                                   tmp_path: Path) -> None:
    """Fine-tuning from the tracked run inherits its tracking (W&B, log_checkpoint): the
    fine-tuned checkpoint is saved and scored before the run's logger closes, so it is uploaded
    and the scores are in the run's summary."""
    import popbert

    sentiment = Path(__file__).parent.parent / "fixtures" / "classification" / "sentiment.tsv"
    out = tmp_path / "classify"
    cfg = popbert.finetune_config("classification", tracked["run_dir"], sentiment, overrides=[
        "finetune.max_seq_length=32", "finetune.epochs=1", "execution.micro_batch_size=8",
        "execution.device=cpu", "execution.threads=1", "training.log_every=1"])
    with offline_wandb(tmp_path / "wandb-dir"), popbert.Trainer.from_config(cfg, out) as trainer:
        result = trainer.train()
    parsed = parse_offline_run(tmp_path / "wandb-dir")
    run = parsed["run"]
    (artifact,) = parsed["artifacts"]
    assert artifact.type == "model" and artifact.name == f"checkpoint-{run.run_id}"
    assert result.checkpoint == out / "checkpoints" / f"step-{result.steps:06d}"
    assert json.loads(artifact.metadata) == {"step": result.steps,
                                             "checkpoint": result.checkpoint.name}
    on_disk = {p.relative_to(result.checkpoint).as_posix(): p.stat().st_size
               for p in result.checkpoint.rglob("*") if p.is_file()}
    uploaded = {entry.path: entry.size for entry in artifact.manifest.contents}
    assert uploaded == on_disk and "weights.safetensors" in uploaded
    # The evaluation is scored before the logger closes, so its results reach the summary.
    summary = parsed["summary"]
    assert summary["eval_accuracy"] == pytest.approx(result.metrics["accuracy"])
    assert summary["eval_f1"] == pytest.approx(result.metrics["f1"])
