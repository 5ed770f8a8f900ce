"""`popbert sweep create | agent | run | show`: hyperparameter sweeps (popbert.sweep).

A SWEEP argument is a sweep directory (made by `create`, holding `sweep.yaml` and the embedded
store), or a sweep id together with `--storage URL` of the store it lives in, or for a sweep
file with `backend: wandb` the W&B sweep's `entity/project/id` (`create` prints it).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from popbert.errors import UsageError
from popbert.io import paths

logger = logging.getLogger("popbert")


def _sweep_file(path: Path, args: object = None) -> str | None:
    from popbert.sweep.spec import TOP_LEVEL

    return paths.yaml_keys(path, TOP_LEVEL)


# A sweep file, as its path flags declare it (`popbert.io.paths`).
SWEEP_FILE = paths.PathKind("a sweep YAML file", sniff=_sweep_file)


def _optuna_logs_through_logging() -> None:
    """Optuna's own lines ("Trial 3 finished ...") through the CLI's log handler, like ours,
    instead of Optuna's separate stderr handler."""
    import optuna

    optuna.logging.disable_default_handler()
    optuna.logging.enable_propagation()


def _backend(path: Path) -> str:
    """The sweep file's `backend` (the file is checked in full by whoever creates it)."""
    from popbert.sweep.spec import load_spec

    return load_spec(path, check=False).backend


def _cmd_create(args: argparse.Namespace) -> int:
    _optuna_logs_through_logging()
    if _backend(args.file) == "wandb":
        from popbert.sweep.wandb_backend import create_wandb_sweep

        if args.storage is not None:
            raise UsageError("--storage: a sweep of backend wandb lives on the W&B server")
        sweep = create_wandb_sweep(args.file, args.output_dir)
        logger.info("W&B sweep %s (popbert's side in %s); run agents with: popbert sweep "
                    "agent %s", sweep.id, sweep.directory, sweep.id)
        sys.stdout.write(sweep.id + "\n")
        return 0
    from popbert.sweep.study import create_sweep

    sweep = create_sweep(args.file, args.output_dir, args.storage)
    logger.info("sweep %s in %s; run agents with: popbert sweep agent %s", sweep.id,
                sweep.directory, sweep.directory)
    sys.stdout.write(sweep.id + "\n")
    return 0


def _cmd_agent(args: argparse.Namespace) -> int:
    _optuna_logs_through_logging()
    from popbert.sweep.wandb_backend import is_wandb_sweep, run_wandb_agent

    if is_wandb_sweep(args.sweep, args.storage):
        run_wandb_agent(args.sweep, count=args.count, device=args.device,
                        output_dir=args.output_dir, sweep_file=args.file)
        return 0
    if args.file is not None:
        raise UsageError("--file: only for a W&B sweep given by its path (entity/project/id)")
    from popbert.sweep.agent import run_agent

    run_agent(args.sweep, storage=args.storage, count=args.count, device=args.device,
              output_dir=args.output_dir)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    _optuna_logs_through_logging()
    from popbert.sweep.agent import run_sweep
    from popbert.sweep.show import table

    if _backend(args.file) == "wandb":
        raise UsageError(f"{args.file}: backend wandb: W&B's controller runs the sweep; create "
                         "it with popbert sweep create and start agents with popbert sweep agent")
    devices = [d.strip() for d in args.devices.split(",") if d.strip()] if args.devices else None
    sweep = run_sweep(args.file, args.agents, output_dir=args.output_dir, storage=args.storage,
                      count=args.count, devices=devices)
    sys.stdout.write(table(sweep, sweep.load_study()))
    return 0


def _cmd_show(args: argparse.Namespace) -> int:
    _optuna_logs_through_logging()
    from popbert.io.paths import check_output_directory
    from popbert.sweep.show import (
        best_so_far,
        check_comparable,
        plot_best_so_far,
        plot_sweep,
        table,
    )
    from popbert.sweep.study import open_sweep

    check_output_directory(args.plots_dir, "--plots-dir")
    opened = []
    for ref in args.sweep:
        sweep = open_sweep(ref, args.storage)
        opened.append((sweep, sweep.load_study()))
    check_comparable([sweep for sweep, _ in opened])
    for sweep, study in opened:
        sys.stdout.write(table(sweep, study))
        if not args.no_plots:
            plots_dir = args.plots_dir / sweep.id if args.plots_dir and len(opened) > 1 \
                else args.plots_dir
            for path in plot_sweep(sweep, study, plots_dir):
                logger.info("wrote %s", path)
    if len(opened) > 1:
        for sweep, study in opened:
            best = best_so_far(study, sweep.spec.goal)
            if best:
                sys.stdout.write(f"{sweep.id}: best {sweep.spec.metric} {best[-1]:.4g} first "
                                 f"reached after {best.index(best[-1]) + 1} of {len(best)} "
                                 "finished trials\n")
        if not args.no_plots:
            out = (args.plots_dir or opened[0][0].directory / "plots") / "best_so_far.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            logger.info("wrote %s", plot_best_so_far(opened, out))
    return 0


def add_commands(sub, common: argparse.ArgumentParser) -> None:
    """Register `popbert sweep` and its verbs on the top-level subparsers."""
    group = sub.add_parser(
        "sweep", parents=[common], help="hyperparameter sweeps (W&B sweep files, Optuna store)",
        description="Sweep config keys over any job (pretrain, finetune squad, finetune "
                    "classify) with grid, random or Bayesian search; every trial is a popbert "
                    "run directory.")
    verbs = group.add_subparsers(dest="sweep_verb", metavar="VERB", required=True)

    p = verbs.add_parser("create", parents=[common], help="check a sweep file, create the sweep "
                         "and print its id")
    p.add_argument("file", type=SWEEP_FILE, metavar="FILE.yaml")
    p.add_argument("--output-dir", "-o", type=paths.OUTPUT_DIR, default=None, metavar="DIR",
                   help="sweep directory (default sweeps/<id>)")
    p.add_argument("--storage", default=None, metavar="URL",
                   help="Optuna RDB store (e.g. postgresql://user:pw@host/db) for agents on "
                        "several machines; default: DIR/study.db (SQLite)")
    p.set_defaults(handler=_cmd_create)

    p = verbs.add_parser("agent", parents=[common], help="run trials of a sweep until it is "
                         "done (or --count trials)")
    p.add_argument("sweep", metavar="SWEEP", help="sweep directory, or id with --storage, or "
                   "a W&B sweep's entity/project/id (backend wandb)")
    p.add_argument("--storage", default=None, metavar="URL")
    p.add_argument("--count", type=int, default=None, metavar="N",
                   help="run at most N trials in this agent")
    p.add_argument("--file", type=SWEEP_FILE, default=None, metavar="FILE.yaml",
                   help="a W&B sweep given by entity/project/id: its sweep file (popbert's "
                        "job, config, set, args), where its sweep directory is not here")
    p.add_argument("--device", default=None, metavar="DEVICE",
                   help="pin this agent's trials to a device (cpu, cuda, cuda:1)")
    p.add_argument("--output-dir", "-o", type=paths.OUTPUT_DIR, default=None, metavar="DIR",
                   help="where the trials' run directories go for a sweep given by id "
                        "(default: its directory if it exists here, else sweeps/<id>)")
    p.set_defaults(handler=_cmd_agent)

    p = verbs.add_parser("run", parents=[common], help="create a sweep and run N local agents "
                         "to the end")
    p.add_argument("file", type=SWEEP_FILE, metavar="FILE.yaml")
    p.add_argument("--agents", type=int, default=1, metavar="N")
    p.add_argument("--output-dir", "-o", type=paths.OUTPUT_DIR, default=None, metavar="DIR")
    p.add_argument("--storage", default=None, metavar="URL")
    p.add_argument("--count", type=int, default=None, metavar="N",
                   help="trials per agent (needed without run_cap for random and bayes)")
    p.add_argument("--devices", default=None, metavar="D1,D2,...",
                   help="pin agent i to device i modulo the list (e.g. cuda:0,cuda:1)")
    p.set_defaults(handler=_cmd_run)

    p = verbs.add_parser("show", parents=[common], help="the trials best first, and PNG plots; "
                         "several sweeps: also their best-so-far curves in one plot")
    p.add_argument("sweep", metavar="SWEEP", nargs="+",
                   help="sweep directory, or id with --storage")
    p.add_argument("--storage", default=None, metavar="URL")
    p.add_argument("--plots-dir", type=paths.OUTPUT_DIR, default=None, metavar="DIR",
                   help="where the PNG plots go (default SWEEP/plots)")
    p.add_argument("--no-plots", action="store_true", help="only the table")
    p.set_defaults(handler=_cmd_show)


__all__ = ["add_commands"]
