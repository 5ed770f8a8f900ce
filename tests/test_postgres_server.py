"""The `postgres_url` fixture: a real PostgreSQL server that concurrent Optuna workers share."""

from __future__ import annotations

import multiprocessing

import optuna

STUDY = "fixture-check"


def _worker(url: str) -> None:
    """One agent in its own process: its own connection pool, two trials of the shared study."""
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    storage = optuna.storages.RDBStorage(url)
    study = optuna.load_study(study_name=STUDY, storage=storage)
    study.optimize(lambda trial: (trial.suggest_float("x", -1.0, 1.0) - 0.25) ** 2, n_trials=2)


def test_two_processes_share_a_study(postgres_url: str) -> None:
    assert postgres_url.startswith("postgresql+psycopg2://")
    storage = optuna.storages.RDBStorage(postgres_url)
    optuna.create_study(study_name=STUDY, storage=storage, direction="minimize")
    ctx = multiprocessing.get_context("spawn")  # no inherited connections or torch threads
    workers = [ctx.Process(target=_worker, args=(postgres_url,)) for _ in range(2)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
    assert [w.exitcode for w in workers] == [0, 0]
    study = optuna.load_study(study_name=STUDY, storage=optuna.storages.RDBStorage(postgres_url))
    trials = study.get_trials(deepcopy=False)
    assert len(trials) == 4
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    assert sorted(t.number for t in trials) == [0, 1, 2, 3]
    assert study.best_value == min(t.value for t in trials)
