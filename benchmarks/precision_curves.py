"""Loss curves of the same seeded run with FP32, FP16 and BF16 weights (stochastic rounding on
and off): writes docs/precision_curves.png and prints the final losses and their ratio to FP32.

    python benchmarks/precision_curves.py --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
from precision_run import train_losses  # noqa: E402

RUNS = [("float32", False, "FP32 weights"),
        ("float16", True, "FP16 weights, stochastic rounding"),
        ("float16", False, "FP16 weights, round to nearest"),
        ("bfloat16", True, "BF16 weights, stochastic rounding"),
        ("bfloat16", False, "BF16 weights, round to nearest")]


def smooth(values: list[float], window: int = 10) -> np.ndarray:
    kernel = np.ones(window) / window
    return np.convolve(values, kernel, mode="valid")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--output", type=Path, default=ROOT / "docs" / "precision_curves.png")
    args = parser.parse_args()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = {}
    for dtype, stochastic, label in RUNS:
        curves[label] = train_losses(dtype, stochastic, args.steps)
        print(f"{label:36s} final loss (mean of last 20 steps) "
              f"{np.mean(curves[label][-20:]):.4f}", flush=True)
    reference = np.mean(curves[RUNS[0][2]][-20:])
    print(f"\n{'weights':36s} {'final loss':>10s} {'/ FP32':>7s}")
    for label, losses in curves.items():
        final = np.mean(losses[-20:])
        print(f"{label:36s} {final:10.4f} {final / reference:7.4f}")

    fig, (ax, diff) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                   gridspec_kw={"height_ratios": [3, 2]})
    fp32 = smooth(curves[RUNS[0][2]])
    steps = np.arange(len(fp32)) + 10
    for label, losses in curves.items():
        ax.plot(steps, smooth(losses), label=label)
        diff.plot(steps, smooth(losses) - fp32, label=label)
    ax.set_ylabel("MLM + NSP loss (10-step mean)")
    ax.set_title("Same seeded run, different weight storage (FP32 moments, FP32 compute)")
    diff.set_ylabel("loss minus FP32 loss")
    diff.set_xlabel("step")
    for a in (ax, diff):
        a.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    args.output.with_suffix(".json").write_text(json.dumps(curves))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.output, dpi=100)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
