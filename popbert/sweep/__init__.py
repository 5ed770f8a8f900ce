"""`popbert sweep`: hyperparameter sweeps over any popbert job on an Optuna study store.

`spec` reads and checks sweep files (W&B's format plus popbert's keys), `study` creates and
opens sweeps (the study, its store, samplers, pruner, the cap across agents), `agent` runs
trials as popbert runs, `show` reports them.
"""
