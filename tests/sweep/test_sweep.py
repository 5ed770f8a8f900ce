"""`popbert sweep`: grid, random and Bayesian sweeps on the embedded study store, agents that
share a sweep, Hyperband pruning, a killed agent's trial retried, phase 2 from phase 1's best.

Every trial is a pre-training run of a BERT far below the tiny preset (1 layer, hidden 32,
sequence 32) for a dozen steps, so a trial takes a couple of seconds.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import optuna
import pytest
import safetensors.numpy
import yaml
from optuna.trial import TrialState

from popbert.cli import main as cli
from popbert.sweep.agent import Agent, run_agent
from popbert.sweep.study import OUTCOME, create_sweep, open_sweep

SMALL = {"model.num_layers": 1, "model.hidden_size": 32, "model.num_heads": 2,
         "model.intermediate_size": 64, "model.sequence_length": 32,
         "model.max_position_embeddings": 64, "model.max_predictions_per_seq": 5,
         "execution.micro_batch_size": 8, "execution.threads": 1, "execution.device": "cpu",
         "training.steps": 12, "training.log_every": 4, "optimizer.warmup_steps": 0}
SENTIMENT = Path(__file__).parent.parent / "fixtures" / "classification" / "sentiment.tsv"
VALIDATION = {"data.validation_fraction": 0.1, "training.eval_every": 4,
              "training.eval_batches": 2}


def sweep_file(tmp_path: Path, name: str = "sweep.yaml", **content: Any) -> Path:
    body = {"job": "pretrain", "config": "tiny", "set": dict(SMALL),
            "method": "grid", "metric": {"name": "loss", "goal": "minimize"},
            "parameters": {"optimizer.lr": {"values": [1e-3]}}}
    body.update(content)
    body = {k: v for k, v in body.items() if v is not None}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(body))
    return path


def trials(directory: Path) -> list[optuna.trial.FrozenTrial]:
    return open_sweep(directory).load_study().get_trials()


@pytest.mark.parametrize("agents", ["0", "100000"])
def test_agents_past_what_a_machine_runs_are_one_line(agents: str, tmp_path: Path,
                                                      capsys) -> None:
    """Each agent is a process here: 0 is nothing to run, 100000 a typo that would start
    them all."""
    out = tmp_path / "sweep"
    assert cli.main(["sweep", "run", str(sweep_file(tmp_path)), "--agents", agents, "-o",
                     str(out)]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line == f"popbert: error: --agents: expected a number from 1 to 1024, got {agents}"
    assert not out.exists()


@pytest.mark.e2e
def test_grid_sweep_two_agents_share_the_grid(tmp_path: Path, capsys) -> None:
    lrs = [3e-4, 1e-3, 3e-3, 1e-2]
    path = sweep_file(tmp_path, parameters={"optimizer.lr": {"values": lrs}})
    out = tmp_path / "grid"
    assert cli.main(["sweep", "run", str(path), "--agents", "2", "-o", str(out)]) == 0

    done = trials(out)
    finished = [t for t in done if t.state == TrialState.COMPLETE]
    assert len(finished) == 4, [(t.number, t.state, t.user_attrs) for t in done]
    # Anything else is a trial taken in a race and never run (its grid point was held).
    assert all(t.user_attrs[OUTCOME] == "skipped" for t in done if t not in finished)
    assert sorted(t.params["optimizer.lr"] for t in finished) == lrs  # each point once
    assert len({t.user_attrs["pid"] for t in finished}) == 2  # both agents ran trials
    for t in finished:
        run = Path(t.user_attrs["run_dir"])
        assert run == out / "trials" / f"trial-{t.number:04d}"
        assert (run / "checkpoints" / "step-000012" / "state.json").is_file()
        logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
        assert t.value == pytest.approx(logged[-1]["loss"])
        assert yaml.safe_load((run / "config.yaml").read_text())["optimizer"]["lr"] == \
            t.params["optimizer.lr"]
    capsys.readouterr()

    assert cli.main(["sweep", "show", str(out)]) == 0
    shown = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in shown[2:6]]
    values = [float(r[2]) for r in rows]
    assert values == sorted(values)  # best first
    best = min(finished, key=lambda t: t.value)
    assert rows[0][0] == str(best.number)
    for png in ("metric_by_trial.png", "metric_vs_params.png", "param_importance.png"):
        assert (out / "plots" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    # The sweep is done: another agent finds nothing left to run.
    assert run_agent(out).trials == {}
    assert len(trials(out)) == len(done)


@pytest.mark.e2e
@pytest.mark.parametrize("method", ["random", "bayes"])
def test_run_cap_holds_across_agents(tmp_path: Path, method: str) -> None:
    path = sweep_file(tmp_path, method=method, run_cap=2, seed=1,
                      set={**SMALL, "training.steps": 4},
                      parameters={"optimizer.lr": {"distribution": "log_uniform_values",
                                                   "min": 1e-4, "max": 1e-2},
                                  "execution.micro_batch_size": {"values": [4, 8]}})
    sweep = create_sweep(path, tmp_path / method)
    assert Agent(sweep, count=1).run().trials.keys() == {0}  # --count stops this agent
    second = Agent(open_sweep(tmp_path / method)).run()  # a second agent: only the cap is left
    assert list(second.trials) == [1]
    assert second.stopped == "the sweep is done"
    done = trials(tmp_path / method)
    assert [t.state for t in done] == [TrialState.COMPLETE] * 2
    assert all(1e-4 <= t.params["optimizer.lr"] <= 1e-2 for t in done)


@pytest.mark.e2e
def test_hyperband_prunes_a_hopeless_trial_at_once(tmp_path: Path) -> None:
    steps = 16
    # seed 1: the grid runs lr 3e-3 first, so Hyperband has a good trial to compare with.
    path = sweep_file(tmp_path, seed=1, metric={"name": "val_mlm_loss", "goal": "minimize"},
                      set={**SMALL, **VALIDATION, "training.steps": steps,
                           "execution.replicas": 2},
                      parameters={"optimizer.lr": {"values": [3e-3, 1e-7]}},
                      early_terminate={"type": "hyperband", "min_iter": 1, "max_iter": 2})
    sweep = create_sweep(path, tmp_path / "hb")
    # One agent under torchrun drives 2-replica trials; replica 0 talks to the store.
    torchrun = Path(sys.executable).with_name("torchrun")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    result = subprocess.run(
        [str(torchrun), "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-backend", "c10d",
         "--rdzv-endpoint", f"127.0.0.1:{port}", "-m", "popbert", "sweep", "agent",
         str(sweep.directory)], capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    good, bad = sorted(trials(tmp_path / "hb"), key=lambda t: -t.params["optimizer.lr"])
    assert good.number < bad.number, "the seed should run the good learning rate first"
    assert good.state == TrialState.COMPLETE
    assert bad.state == TrialState.PRUNED and bad.user_attrs[OUTCOME] == "pruned"
    run = Path(bad.user_attrs["run_dir"])
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    # Stopped at once, at its first evaluation (step 4 of 16): worse than the good trial there.
    assert logged[-1]["step"] == bad.user_attrs["stopped_step"] == 4
    assert bad.value == pytest.approx(logged[-1]["val_mlm_loss"])  # its last reported value
    assert (run / "metrics.png").is_file()  # the partial run is kept, with its plot
    assert yaml.safe_load((run / "config.yaml").read_text())["execution"]["replicas"] == 2


@pytest.mark.e2e
def test_killed_agent_trial_fails_and_is_retried(tmp_path: Path) -> None:
    path = sweep_file(tmp_path, heartbeat=1, set={**SMALL, "training.steps": 60,
                                                  "training.log_every": 1})
    sweep = create_sweep(path, tmp_path / "kill")
    agent = subprocess.Popen([sys.executable, "-m", "popbert", "sweep", "agent",
                              str(sweep.directory)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, env=os.environ.copy())
    metrics = sweep.trial_dir(0) / "metrics.jsonl"
    try:
        deadline = time.monotonic() + 60
        while not (metrics.is_file() and len(metrics.read_text().splitlines()) >= 3):
            assert agent.poll() is None and time.monotonic() < deadline, "trial never started"
            time.sleep(0.05)
        os.kill(agent.pid, signal.SIGKILL)  # mid-trial
    finally:
        agent.wait()
    (first,) = trials(sweep.directory)
    assert first.state == TrialState.RUNNING  # nobody has noticed yet
    # Until the store holds the trial stale (its last heartbeat older than the grace period):
    # the condition Optuna's fail_stale_trials reads, asked without acting on it; the deadline
    # only guards against a hang.
    storage = sweep.storage()
    study_id = storage.get_study_id_from_name(sweep.id)
    deadline = time.monotonic() + 120
    while first._trial_id not in storage._get_stale_trial_ids(study_id):
        assert time.monotonic() < deadline, "the killed agent's trial never went stale"
        time.sleep(0.1)

    report = Agent(open_sweep(sweep.directory)).run()
    failed, retried = trials(sweep.directory)
    assert failed.state == TrialState.FAIL and OUTCOME not in failed.user_attrs
    assert retried.state == TrialState.COMPLETE and report.trials == {1: "COMPLETE"}
    assert retried.system_attrs["failed_trial"] == 0 and retried.params == failed.params
    assert Path(retried.user_attrs["run_dir"]).name == "trial-0001"
    assert (sweep.trial_dir(1) / "checkpoints" / "step-000060").is_dir()


@pytest.mark.e2e
def test_phase_two_starts_from_phase_one_best_trial(tmp_path: Path) -> None:
    phase1 = sweep_file(tmp_path, "phase1.yaml",
                        parameters={"optimizer.lr": {"values": [1e-7, 3e-3]}})
    first = create_sweep(phase1, tmp_path / "p1")

    bad_init = sweep_file(tmp_path, "early.yaml", init_from={"sweep": str(tmp_path / "p1")})
    with pytest.raises(Exception, match="has no finished trial"):
        create_sweep(bad_init, tmp_path / "early")

    Agent(first).run()
    best = min(trials(tmp_path / "p1"), key=lambda t: t.value)
    assert best.params["optimizer.lr"] == 3e-3

    # Phase 2 at twice the sequence length, with a vanishing learning rate: its weights after
    # two steps are still those of phase 1's best trial.
    phase2 = sweep_file(tmp_path, "phase2.yaml", init_from={"sweep": str(tmp_path / "p1"),
                                                            "trial": "best"},
                        set={**SMALL, "model.sequence_length": 64,
                             "model.max_predictions_per_seq": 10, "training.steps": 2,
                             "optimizer.decay": "none", "optimizer.weight_decay": 0.0},
                        parameters={"optimizer.lr": {"values": [1e-9]}})
    second = create_sweep(phase2, tmp_path / "p2")
    recorded = yaml.safe_load((second.directory / "sweep.yaml").read_text())
    assert recorded["init_from_resolved"]["trial"] == best.number
    Agent(second).run()
    (trial,) = trials(tmp_path / "p2")
    assert trial.state == TrialState.COMPLETE
    run = Path(trial.user_attrs["run_dir"])
    assert yaml.safe_load((run / "config.yaml").read_text())["model"]["sequence_length"] == 64

    def weights(run_dir: Path, step: int) -> dict[str, np.ndarray]:
        return safetensors.numpy.load_file(
            str(run_dir / "checkpoints" / f"step-{step:06d}" / "weights.safetensors"))

    before = weights(Path(best.user_attrs["run_dir"]), 12)
    after = weights(run, 2)
    other = next(t for t in trials(tmp_path / "p1") if t.number != best.number)
    assert before.keys() == after.keys()
    for name in before:
        np.testing.assert_allclose(after[name], before[name], rtol=0, atol=1e-6, err_msg=name)
    far = weights(Path(other.user_attrs["run_dir"]), 12)
    assert max(np.abs(after[k] - far[k]).max() for k in far) > 1e-4

    # A fine-tuning sweep from the same trial: sequence classification, sweeping the job's own
    # epochs under fixed config keys; the metric is the job's end-of-run evaluation.
    classify = sweep_file(tmp_path, "classify.yaml", job="finetune classify", config=None,
                          init_from={"sweep": str(tmp_path / "p1")},
                          args={"train": str(SENTIMENT), "max_seq_length": 32},
                          set={"optimizer.lr": 1e-3, "execution.micro_batch_size": 4,
                               "execution.threads": 1, "execution.device": "cpu"},
                          metric={"name": "accuracy", "goal": "maximize"},
                          parameters={"args.epochs": {"values": [1, 2]}})
    third = create_sweep(classify, tmp_path / "cls")
    Agent(third).run()
    runs = trials(tmp_path / "cls")
    assert [t.state for t in runs] == [TrialState.COMPLETE] * 2
    for t in runs:
        run = Path(t.user_attrs["run_dir"])
        assert t.value == json.loads((run / "eval_results.json").read_text())["accuracy"]
        cfg = yaml.safe_load((run / "config.yaml").read_text())
        assert cfg["training"]["steps"] == 4 * t.params["args.epochs"]  # 16 examples, batch 4
        assert cfg["optimizer"]["lr"] == 1e-3 and cfg["model"]["sequence_length"] == 32


FINETUNE = {"job": "finetune classify", "config": None, "set": {},
            "args": {"train": str(SENTIMENT), "checkpoint": str(SENTIMENT.parent)}}
BAD = [
    ({"method": "hill_climb"}, "method: expected grid, random or bayes, got 'hill_climb'"),
    ({"parameters": {"optimizer.lrr": {"values": [1e-3]}}},
     "parameters.optimizer.lrr: unknown key optimizer.lrr"),
    ({"parameters": {"optimizer.lr": {"distribution": "log_uniform_values", "min": 1e-4,
                                      "max": 1e-2}}},
     "parameters.optimizer.lr: method grid needs discrete values"),
    ({"method": "random", "parameters": {"optimizer.lr": {"min": 1e-2, "max": 1e-4}}},
     "parameters.optimizer.lr: min (0.01) is greater than max (0.0001)"),
    ({"metric": {"name": "val_f1", "goal": "minimize"}},
     "metric.name: pretrain does not write 'val_f1'; expected one of loss"),
    ({"metric": {"name": "val_mlm_loss", "goal": "minimize"}},
     "metric.name: val_mlm_loss is a validation metric: set training.eval_every"),
    ({"metric": {"name": "loss", "goal": "lowest"}},
     "metric.goal: expected minimize or maximize, got 'lowest'"),
    ({"parameters": {"optimizer.lr": {"values": ["fast"]}}},
     "parameters.optimizer.lr: optimizer.lr: expected float"),
    ({"early_terminate": {"type": "median"}}, "early_terminate.type: expected hyperband"),
    ({"run_cap": 0}, "run_cap: expected a positive integer, got 0"),
    ({"method": "bayes", "seed": -1}, "seed: expected an integer from 0 to 2147483647"),
    ({**FINETUNE, "parameters": {"model.hidden_size": {"values": [64]}}},
     "parameters.model.hidden_size: model.hidden_size is a config key fine-tuning does not "
     "take"),
    ({**FINETUNE, "parameters": {"optimizer.lr": {"values": ["fast"]}}},
     "parameters.optimizer.lr: optimizer.lr: expected float"),
    ({**FINETUNE, "parameters": {"args.train": {"values": ["a.tsv"]}}},
     "parameters.args.train: args.train is not an option finetune classify sweeps"),
]


@pytest.mark.parametrize(("change", "message"), BAD, ids=[m.split(":")[0] for _, m in BAD])
def test_bad_sweep_files_are_one_line_exit_2(tmp_path: Path, capsys, change: dict,
                                             message: str) -> None:
    path = sweep_file(tmp_path, **change)
    assert cli.main(["sweep", "create", str(path), "-o", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert err.startswith(f"popbert: error: {path}: {message}"), err
    assert not (tmp_path / "s").exists()  # nothing created


def test_init_from_a_sweep_without_finished_trials_is_refused(tmp_path: Path, capsys) -> None:
    assert cli.main(["sweep", "create", str(sweep_file(tmp_path)), "-o",
                     str(tmp_path / "p1")]) == 0
    capsys.readouterr()
    path = sweep_file(tmp_path, "p2.yaml", init_from={"sweep": str(tmp_path / "p1")})
    assert cli.main(["sweep", "create", str(path), "-o", str(tmp_path / "p2")]) == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"popbert: error: {path}: init_from.sweep {tmp_path / 'p1'}: has no "
                   "finished trial to start from"), err
    assert cli.main(["sweep", "agent", str(tmp_path / "nowhere")]) == 2
    assert "no such sweep directory" in capsys.readouterr().err
    endless = sweep_file(tmp_path, "endless.yaml", method="random",
                         parameters={"optimizer.lr": {"min": 1e-4, "max": 1e-2}})
    assert cli.main(["sweep", "run", str(endless), "-o", str(tmp_path / "endless")]) == 2
    assert "without run_cap never ends: set run_cap in the sweep file or pass --count" in \
        capsys.readouterr().err
    assert not (tmp_path / "endless").exists()


@pytest.mark.e2e
def test_agent_by_id_in_a_shared_store_pinned_to_a_device(tmp_path: Path, capsys) -> None:
    """A store outside the sweep directory (as a PostgreSQL server would be): an agent elsewhere
    needs only the id and the URL; --device overrides the config's execution.device."""
    url = f"sqlite:///{tmp_path / 'shared.db'}"
    path = sweep_file(tmp_path, set={**SMALL, "execution.device": "auto"})
    assert cli.main(["sweep", "create", str(path), "-o", str(tmp_path / "made"),
                     "--storage", url]) == 0
    sweep_id = capsys.readouterr().out.strip()
    assert not (tmp_path / "made" / "study.db").exists()
    elsewhere = tmp_path / "elsewhere"
    assert cli.main(["sweep", "agent", sweep_id, "--storage", url, "-o", str(elsewhere),
                     "--device", "cpu", "--count", "1"]) == 0
    (trial,) = open_sweep(sweep_id, url).load_study().get_trials()
    assert trial.state == TrialState.COMPLETE and trial.user_attrs["device"] == "cpu"
    run = Path(trial.user_attrs["run_dir"])
    assert run == elsewhere / "trials" / "trial-0000"
    assert yaml.safe_load((run / "config.yaml").read_text())["execution"]["device"] == "cpu"
    capsys.readouterr()
    assert cli.main(["sweep", "show", sweep_id, "--storage", url, "--no-plots"]) == 0
    assert f"sweep {sweep_id} (grid, minimize loss)" in capsys.readouterr().out
    assert cli.main(["sweep", "agent", "no-such-id", "--storage", url]) == 2
    assert f"no sweep of that id in {url}" in capsys.readouterr().err


def test_earlier_trials_decide_which_later_one_runs(tmp_path: Path) -> None:
    """The rule agents on several machines share: a trial runs unless earlier live trials hold
    the cap or its grid point. Trials that died (no outcome) free their place for their retry;
    a job that failed by itself keeps it."""
    from optuna.distributions import CategoricalDistribution

    from popbert.sweep.spec import load_spec
    from popbert.sweep.study import holds_slot, why_skip

    spec = load_spec(sweep_file(tmp_path, run_cap=3, parameters={
        "optimizer.lr": {"values": [1e-4, 1e-3, 1e-2, 1e-1]}}))
    study = optuna.create_study()
    dist = {"optimizer.lr": CategoricalDistribution([1e-4, 1e-3, 1e-2, 1e-1])}

    def add(state: TrialState, grid_id: int, **user: Any) -> None:
        study.add_trial(optuna.trial.create_trial(
            state=state, params={"optimizer.lr": dist["optimizer.lr"].choices[grid_id]},
            distributions=dist, value=1.0 if state == TrialState.COMPLETE else None,
            user_attrs=user, system_attrs={"grid_id": grid_id}))

    add(TrialState.COMPLETE, 0)
    add(TrialState.FAIL, 1)                    # 1: its agent died ...
    add(TrialState.RUNNING, 1)                 # 2: ... and this is its retry
    add(TrialState.RUNNING, 1)                 # 3: a race: the same point again
    add(TrialState.FAIL, 2, outcome="error")   # 4: diverged: a run all the same
    add(TrialState.RUNNING, 3)                 # 5: over the cap (0, 2, 4 hold it)
    t = study.get_trials()
    assert [holds_slot(x) for x in t] == [True, False, True, True, True, True]
    assert why_skip(spec, t[2], t) is None
    assert "grid point 1" in why_skip(spec, t[3], t)
    assert why_skip(spec, t[5], t) == "the sweep's 3 trials are taken"


@pytest.mark.e2e
def test_two_agents_share_a_grid_on_a_postgresql_store(tmp_path: Path, postgres_url: str
                                                       ) -> None:
    """The multi-machine store: a real PostgreSQL server (started by the fixture in a temporary
    directory); two agents found through it by sweep id, as they would be from other machines."""
    lrs = [1e-3, 1e-2]
    path = sweep_file(tmp_path, parameters={"optimizer.lr": {"values": lrs}},
                      set={**SMALL, "training.steps": 4})
    sweep = create_sweep(path, tmp_path / "made", storage=postgres_url)
    assert not (sweep.directory / "study.db").exists()
    agents = [subprocess.Popen([sys.executable, "-m", "popbert", "sweep", "agent", sweep.id,
                                "--storage", postgres_url, "-o", str(tmp_path / f"machine{i}")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
              for i in range(2)]
    for agent in agents:
        _, err = agent.communicate(timeout=300)
        assert agent.returncode == 0, err[-3000:]
    done = open_sweep(sweep.id, postgres_url).load_study().get_trials()
    finished = [t for t in done if t.state == TrialState.COMPLETE]
    assert sorted(t.params["optimizer.lr"] for t in finished) == lrs
    assert all(t.user_attrs[OUTCOME] == "skipped" for t in done if t not in finished)
    for t in finished:  # each run is on the machine whose agent ran it
        run = Path(t.user_attrs["run_dir"])
        assert run.parent.parent.name.startswith("machine") and (run / "metrics.jsonl").is_file()


@pytest.mark.parametrize("sampler", ["tpe", "gp"])
def test_bayes_samplers_model_the_metric_after_a_third_of_the_cap(sampler: str) -> None:
    """`method: bayes` is TPE, or GP with `sampler: gp`; both stop sampling at random after
    run_cap // 3 trials (at least 3), so a capped sweep is a Bayesian one, not a random one.
    On a toy objective (no popbert run): two studies see the same 3 random start-up points but
    opposite objectives; a sampler that models the metric then proposes different points, one
    still in its random phase (no cap: 10 start-up trials) proposes the same ones."""
    if sampler == "gp":
        pytest.importorskip("scipy", reason="GPSampler needs scipy")
    from popbert.sweep.spec import parse_spec
    from popbert.sweep.study import make_sampler

    def later_points(run_cap: int | None) -> list[list[float]]:
        raw = {"job": "pretrain", "method": "bayes", "sampler": sampler, "seed": 0,
               "metric": {"name": "loss", "goal": "minimize"},
               "parameters": {"optimizer.lr": {"distribution": "log_uniform_values",
                                               "min": 1e-5, "max": 1e-1}}}
        if run_cap:
            raw["run_cap"] = run_cap
        points = []
        for sign in (1.0, -1.0):
            chosen = make_sampler(parse_spec(raw))
            assert type(chosen).__name__ == {"tpe": "TPESampler", "gp": "GPSampler"}[sampler]
            study = optuna.create_study(sampler=chosen)
            study.optimize(lambda t, sign=sign: sign * abs(np.log10(
                t.suggest_float("optimizer.lr", 1e-5, 1e-1, log=True)) + 3), n_trials=6)
            points.append([t.params["optimizer.lr"] for t in study.trials])
        assert points[0][:3] == points[1][:3]  # the same random start
        return [points[0][3:], points[1][3:]]

    modelled = later_points(run_cap=9)
    assert modelled[0] != modelled[1]
    still_random = later_points(run_cap=None)
    assert still_random[0] == still_random[1]


def test_show_compares_sweeps_by_best_so_far(tmp_path: Path, capsys) -> None:
    """Two sweeps of one metric: each gets its table, and one plot holds both best-so-far
    curves (in the order trials finished); sweeps of different metrics are one line, exit 2."""
    from optuna.distributions import FloatDistribution

    from popbert.sweep.show import best_so_far

    dist = {"optimizer.lr": FloatDistribution(1e-5, 1e-1, log=True)}
    lrs = {"optimizer.lr": {"distribution": "log_uniform_values", "min": 1e-5, "max": 1e-1}}
    made = {}
    for method, values in (("random", [3.0, 2.0, 2.5, 1.0]), ("bayes", [3.0, 1.5, 1.6, 1.7])):
        sweep = create_sweep(sweep_file(tmp_path, f"{method}.yaml", method=method, run_cap=4,
                                        parameters=lrs), tmp_path / method)
        study = sweep.load_study()
        for value in values:
            study.add_trial(optuna.trial.create_trial(params={"optimizer.lr": 1e-3},
                                                      distributions=dist, value=value))
        made[method] = study
    assert best_so_far(made["random"], "minimize") == [3.0, 2.0, 2.0, 1.0]
    assert best_so_far(made["bayes"], "maximize") == [3.0, 3.0, 3.0, 3.0]

    assert cli.main(["sweep", "show", str(tmp_path / "random"), str(tmp_path / "bayes"),
                     "--plots-dir", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out
    assert "best loss 1 first reached after 4 of 4" in out
    assert "best loss 1.5 first reached after 2 of 4" in out
    assert (tmp_path / "plots" / "best_so_far.png").stat().st_size > 10_000

    other = create_sweep(sweep_file(tmp_path, "acc.yaml", metric={"name": "mlm_accuracy",
                                                                  "goal": "maximize"}),
                         tmp_path / "acc")
    assert other.spec.metric == "mlm_accuracy"
    capsys.readouterr()
    assert cli.main(["sweep", "show", str(tmp_path / "random"), str(tmp_path / "acc")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "compare sweeps of one metric" in err[0], err
