"""`backend: wandb`: what can be tested without a W&B server.

The W&B sweep configuration derived from grid, random, bayes and hyperband sweep files equals
W&B's format written out by hand (popbert's own keys left out); W&B's agent, replaced by one that
does what `wandb.agents.pyagent` does for one run (the run's parameters in a config file named by
WANDB_SWEEP_PARAM_PATH, WANDB_SWEEP_ID and WANDB_RUN_ID set, the function called, `wandb.finish`)
in W&B's offline mode, runs a real tiny pre-training trial whose offline run file holds the
parameters and every value of the sweep's metric; and the one-line errors: wandb not installed,
offline mode, no API key.

(W&B's schema validator is the `sweeps` package of the `wandb[sweeps]` extra; it pins numpy<2,
so it is not installed here and the expected configurations are written against its schema by
hand.)
"""

from __future__ import annotations

import builtins
import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml
from wandb_offline import offline_records

from popbert.cli import main as cli
from popbert.errors import ConfigError
from popbert.sweep import wandb_backend
from popbert.sweep.spec import load_spec
from popbert.sweep.wandb_backend import (
    open_wandb_sweep,
    trial_function,
    wandb_agent,
    wandb_sweep_config,
)

wandb = pytest.importorskip("wandb")

SMALL = {"model.num_layers": 1, "model.hidden_size": 32, "model.num_heads": 2,
         "model.intermediate_size": 64, "model.sequence_length": 32,
         "model.max_position_embeddings": 64, "model.max_predictions_per_seq": 5,
         "execution.micro_batch_size": 8, "execution.threads": 1, "execution.device": "cpu",
         "training.steps": 8, "training.log_every": 4, "optimizer.warmup_steps": 0}
SENTIMENT = Path(__file__).parent.parent / "fixtures" / "classification" / "sentiment.tsv"


@pytest.fixture(autouse=True)
def fresh_wandb():
    """wandb reads its WANDB_* environment once per process setup: each test here starts and
    leaves it unset (as W&B's agent does before each run), so no test sees another's."""
    wandb.teardown()
    yield
    wandb.teardown()


def sweep_file(tmp_path: Path, filename: str = "sweep.yaml", **content: Any) -> Path:
    body = {"job": "pretrain", "config": "tiny", "set": dict(SMALL), "backend": "wandb",
            "method": "grid", "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"optimizer.lr": {"values": [1e-3]}}}
    body.update(content)
    path = tmp_path / filename
    path.write_text(yaml.safe_dump({k: v for k, v in body.items() if v is not None}))
    return path


def test_grid_config_is_wandbs_format_without_popberts_keys(tmp_path: Path) -> None:
    path = sweep_file(tmp_path, "grid.yaml", method="grid", run_cap=6,
                      parameters={"optimizer.lr": {"values": [1e-3, 3e-3]},
                                  "training.log_every": {"value": 2},
                                  "execution.micro_batch_size": {"distribution": "int_uniform",
                                                                 "min": 4, "max": 6}},
                      project="lamb", entity="graphcore", seed=3, heartbeat=5)
    assert wandb_sweep_config(load_spec(path)) == {
        "method": "grid",
        "metric": {"name": "loss", "goal": "minimize"},
        "parameters": {"optimizer.lr": {"values": [1e-3, 3e-3]},
                       "training.log_every": {"value": 2},
                       "execution.micro_batch_size": {"distribution": "int_uniform",
                                                      "min": 4, "max": 6}},
        "run_cap": 6, "project": "lamb", "entity": "graphcore"}


def test_random_and_bayes_configs_keep_wandbs_distributions(tmp_path: Path) -> None:
    parameters = {"optimizer.lr": {"distribution": "log_uniform_values", "min": 1e-5,
                                   "max": 1e-3},
                  "optimizer.weight_decay": {"distribution": "uniform", "min": 0.0, "max": 0.1},
                  "optimizer.max_grad_norm": {"distribution": "q_uniform", "min": 0.5,
                                              "max": 2, "q": 0.5},
                  "optimizer.warmup_steps": {"values": [0, 2]}}
    expected_parameters = {
        "optimizer.lr": {"distribution": "log_uniform_values", "min": 1e-5, "max": 1e-3},
        "optimizer.weight_decay": {"distribution": "uniform", "min": 0.0, "max": 0.1},
        "optimizer.max_grad_norm": {"distribution": "q_uniform", "min": 0.5, "max": 2.0,
                                    "q": 0.5},
        "optimizer.warmup_steps": {"values": [0, 2]}}
    for method in ("random", "bayes"):
        path = sweep_file(tmp_path, f"{method}.yaml", method=method, run_cap=4,
                          parameters=parameters, name=f"lr-{method}", sampler="tpe")
        assert wandb_sweep_config(load_spec(path)) == {
            "method": method, "name": f"lr-{method}",
            "metric": {"name": "loss", "goal": "minimize"},
            "parameters": expected_parameters, "run_cap": 4}


def test_hyperband_in_wandbs_form(tmp_path: Path) -> None:
    validation = {**SMALL, "data.validation_fraction": 0.1, "training.eval_every": 4}
    cases = [({"type": "hyperband", "min_iter": 2, "eta": 2},
              {"type": "hyperband", "min_iter": 2, "eta": 2}),
             ({"type": "hyperband"},  # both backends' defaults, written out for W&B
              {"type": "hyperband", "min_iter": 1, "eta": 3}),
             ({"type": "hyperband", "max_iter": 9, "s": 2, "eta": 3},
              {"type": "hyperband", "max_iter": 9, "s": 2, "eta": 3}),
             # W&B reads max_iter only with s; Optuna's pruner takes it alone.
             ({"type": "hyperband", "min_iter": 1, "max_iter": 9},
              {"type": "hyperband", "min_iter": 1, "eta": 3})]
    for early, expected in cases:
        path = sweep_file(tmp_path, "hb.yaml", method="random", early_terminate=early,
                          set=validation, metric={"name": "val_mlm_loss", "goal": "minimize"},
                          parameters={"optimizer.lr": {"distribution": "log_uniform",
                                                       "min": -9.2, "max": -4.6}})
        assert wandb_sweep_config(load_spec(path)) == {
            "method": "random", "metric": {"name": "val_mlm_loss", "goal": "minimize"},
            "parameters": {"optimizer.lr": {"distribution": "log_uniform", "min": -9.2,
                                            "max": -4.6}},
            "early_terminate": expected}, early


def test_a_finetuning_sweep_sends_no_inputs_to_wandb(tmp_path: Path) -> None:
    path = sweep_file(tmp_path, job="finetune classify", config=None,
                      set={"execution.device": "cpu"},
                      args={"train": str(SENTIMENT), "checkpoint": str(SENTIMENT.parent)},
                      metric={"name": "accuracy", "goal": "maximize"}, method="bayes",
                      parameters={"args.epochs": {"distribution": "int_uniform", "min": 1,
                                                  "max": 4}})
    assert wandb_sweep_config(load_spec(path)) == {
        "method": "bayes", "metric": {"name": "accuracy", "goal": "maximize"},
        "parameters": {"args.epochs": {"distribution": "int_uniform", "min": 1, "max": 4}}}


def fake_agent(params: dict[str, Any], run_id: str):
    """W&B's agent for one run, as wandb.agents.pyagent runs a function (no controller)."""
    calls: list[dict[str, Any]] = []

    def agent(sweep_id: str, function, entity: str | None = None,
              project: str | None = None, count: int | None = None) -> None:
        calls.append({"sweep_id": sweep_id, "entity": entity, "project": project,
                      "count": count})
        base = Path(os.environ["WANDB_DIR"])
        param_file = base / "wandb" / f"sweep-{sweep_id}" / f"config-{run_id}.yaml"
        param_file.parent.mkdir(parents=True)
        param_file.write_text(yaml.safe_dump({"wandb_version": 1, **{
            k: {"value": v} for k, v in params.items()}}))
        env = {"WANDB_RUN_ID": run_id, "WANDB_SWEEP_PARAM_PATH": str(param_file),
               "WANDB_SWEEP_ID": sweep_id}
        os.environ.update(env)
        wandb.teardown()  # as pyagent does before each run: wandb reads the environment anew
        try:
            function()
            wandb.finish()
        finally:
            for key in env:
                os.environ.pop(key, None)

    return agent, calls


@pytest.mark.e2e
def test_agent_runs_a_real_trial_into_the_wandb_run(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    path = sweep_file(tmp_path, method="random", run_cap=3,
                      metric={"name": "mlm_loss", "goal": "minimize"},
                      parameters={"optimizer.lr": {"distribution": "log_uniform_values",
                                                   "min": 1e-4, "max": 1e-2},
                                  "training.log_every": {"values": [2, 4]}})
    monkeypatch.chdir(tmp_path)
    # The W&B sweep is created elsewhere (it needs a server); this machine has its path and
    # the sweep file.
    sweep = open_wandb_sweep("team/lamb/abc123", sweep_file=path)
    assert sweep.directory == (tmp_path / "sweeps" / "abc123").resolve()
    recorded = yaml.safe_load((sweep.directory / "sweep.yaml").read_text())
    assert recorded["id"] == "team/lamb/abc123" and recorded["backend"] == "wandb"
    assert open_wandb_sweep("team/lamb/abc123").spec == sweep.spec  # found again here

    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    params = {"optimizer.lr": 0.004, "training.log_every": 2}
    agent, calls = fake_agent(params, "run0001")
    monkeypatch.setattr(wandb, "agent", agent)
    wandb_agent(sweep, count=1)
    assert calls == [{"sweep_id": "abc123", "entity": "team", "project": "lamb", "count": 1}]

    run_dir = sweep.directory / "trials" / "trial-run0001"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["optimizer"]["lr"] == 0.004 and config["training"]["log_every"] == 2
    assert config["tracking"]["backend"] == "wandb"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in metrics] == [2, 4, 6, 8]

    parsed = offline_run(tmp_path / "wandb-dir")
    run, run_config = parsed["run"], parsed["config"]
    history, summary = parsed["history"], parsed["summary"]
    assert run is not None and run.run_id == "run0001" and run.sweep_id == "abc123"
    # The sweep's parameters as W&B's agent handed them over, and the whole popbert config.
    assert run_config["optimizer.lr"] == 0.004 and run_config["training.log_every"] == 2
    assert run_config["optimizer"]["lr"] == 0.004
    # Every value of the sweep's metric, under its name, at the job's steps; the last in the
    # summary (what W&B's controller reads).
    logged = {row["_step"]: row["mlm_loss"] for row in history if "mlm_loss" in row}
    assert logged == {r["step"]: pytest.approx(r["mlm_loss"], rel=1e-12) for r in metrics}
    assert summary["mlm_loss"] == pytest.approx(metrics[-1]["mlm_loss"], rel=1e-12)


def offline_run(wandb_dir: Path) -> dict[str, Any]:
    """The one offline run under `wandb_dir`: its run record, config, history and summary."""
    (run_file,) = wandb_dir.glob("wandb/offline-run-*/run-*.wandb")
    parsed: dict[str, Any] = {"run": None, "config": {}, "history": [], "summary": {}}

    def items(entries) -> dict[str, Any]:
        return {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in entries}

    for record in offline_records(run_file):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            parsed["run"] = record.run
            parsed["config"].update(items(record.run.config.update))
        elif kind == "config":  # later updates of the run's config
            parsed["config"].update(items(record.config.update))
        elif kind == "history":
            parsed["history"].append(items(record.history.item))
        elif kind == "summary":
            parsed["summary"].update(items(record.summary.update))
    return parsed


@pytest.mark.e2e
def test_a_finetuning_trial_logs_its_records_and_its_evaluation(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    checkpoint = tmp_path / "pretrained"
    args = ["pretrain", "--config", "tiny", "--output-dir", str(checkpoint)]
    for key, value in {**SMALL, "training.steps": 2}.items():
        args += ["--set", f"{key}={value}"]
    assert cli.main(args) == 0
    path = sweep_file(tmp_path, job="finetune classify", config=None,
                      set={"execution.micro_batch_size": 8, "execution.threads": 1,
                           "execution.device": "cpu", "training.log_every": 1},
                      args={"checkpoint": str(checkpoint), "train": str(SENTIMENT),
                            "max_seq_length": 32},
                      metric={"name": "accuracy", "goal": "maximize"},
                      parameters={"optimizer.lr": {"values": [1e-3, 1e-4]},
                                  "args.epochs": {"values": [1, 2]}})
    sweep = open_wandb_sweep("team/lamb/ft42", sweep_file=path, output_dir=tmp_path / "ft")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    agent, _ = fake_agent({"optimizer.lr": 1e-3, "args.epochs": 1}, "ftrun01")
    monkeypatch.setattr(wandb, "agent", agent)
    wandb_agent(sweep)

    run_dir = sweep.directory / "trials" / "trial-ftrun01"
    config = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert config["optimizer"]["lr"] == 1e-3 and config["training"]["steps"] == 2  # 16 / 8
    assert config["tracking"]["backend"] == "none"  # the checkpoint's: the trial logs
    accuracy = json.loads((run_dir / "eval_results.json").read_text())["accuracy"]
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    parsed = offline_run(tmp_path / "wandb-dir")
    assert parsed["run"].run_id == "ftrun01" and parsed["run"].sweep_id == "ft42"
    assert parsed["config"]["optimizer.lr"] == 1e-3 and parsed["config"]["args.epochs"] == 1
    losses = {row["_step"]: row["loss"] for row in parsed["history"] if "loss" in row}
    assert losses == {r["step"]: pytest.approx(r["loss"], rel=1e-12) for r in metrics}
    # The training batches' accuracy as logged, then the evaluation's, last (the summary's).
    accuracies = {row["_step"]: row["accuracy"] for row in parsed["history"]
                  if "accuracy" in row}
    assert accuracies == {1: metrics[0]["accuracy"], 2: metrics[1]["accuracy"], 3: accuracy}
    assert parsed["summary"]["accuracy"] == accuracy

    # A checkpoint whose config tracks to W&B: its job's logger would end the agent's run
    # before the evaluation is scored.
    step = checkpoint / "checkpoints" / "step-000002" / "config.yaml"
    saved = yaml.safe_load(step.read_text())
    saved["tracking"]["backend"] = "wandb"
    step.write_text(yaml.safe_dump(saved))
    with pytest.raises(ConfigError, match="metric.name: accuracy is scored after the job's "
                       "W&B run ends"):
        trial_function(sweep)


def test_errors_are_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                             capsys: pytest.CaptureFixture[str]) -> None:
    path = sweep_file(tmp_path)

    def fails(args: list[str], expected: str) -> None:
        assert cli.main(args) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and expected in err, err

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("WANDB_MODE", "offline")
    fails(["sweep", "create", str(path)], "sweep backend wandb: WANDB_MODE is offline; W&B "
          "sweeps need a W&B server and account: wandb login (or WANDB_API_KEY)")
    fails(["sweep", "agent", "team/lamb/abc123", "--file", str(path)],
          "sweep backend wandb: WANDB_MODE is offline")
    fails(["sweep", "run", str(path)], "backend wandb: W&B's controller runs the sweep")
    fails(["sweep", "agent", "runs/sweeps/lr"], "runs/sweeps/lr: no sweep directory here, nor "
          "popbert's side of a W&B sweep in sweeps/lr; for a W&B sweep pass its sweep file "
          "with --file FILE.yaml")
    fails(["sweep", "create", str(sweep_file(tmp_path, "bad.yaml", backend="ray"))],
          "bad.yaml: backend: expected optuna or wandb, got 'ray'")

    # Online, without an account: W&B's own message, one line.
    monkeypatch.delenv("WANDB_MODE")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "home" / "wandb"))
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    fails(["sweep", "create", str(path)], "sweep backend wandb: creating the sweep: No API key")
    assert not (tmp_path / "sweeps").exists()  # nothing made when W&B refused

    real_import = builtins.__import__

    def no_wandb(name: str, *args: Any, **kwargs: Any):
        if name == "wandb" or name.startswith("wandb."):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_wandb)
    fails(["sweep", "create", str(path)], "sweep backend wandb: wandb is not installed: pip "
          "install wandb")
    with pytest.raises(ConfigError, match="wandb is not installed"):
        wandb_backend.require_server()
