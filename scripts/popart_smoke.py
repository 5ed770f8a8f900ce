#!/usr/bin/env python3
"""Smoke test of the PopART backend, for machines with Graphcore's Poplar SDK.

Trains the tiny BERT for a few steps (3 by default) on PopART's IPU Model (the simulator shipped
in the SDK; ``--device ipu`` for IPUs) and on popbert's torch backend, from the same weights on the
same batches with dropout off, and compares the losses step by step and the weights at the end.
Exit status 0 when every loss agrees within ``--rtol``, 1 when not, 2 when the SDK is missing.

It has NOT been run: the machines popbert is developed on have no Poplar SDK (the PyPI packages
named popart/poplar are unrelated projects). It imports cleanly without the SDK and says so in
one line when asked to run. Run it as the first thing where the SDK is:

    source <poplar_sdk>/enable.sh
    python scripts/popart_smoke.py                 # IPU Model
    python scripts/popart_smoke.py --device ipu    # one IPU
"""

from __future__ import annotations

import argparse
import sys
import tempfile

import numpy as np
import torch

from popbert.backends import BackendUnavailable, import_popart
from popbert.backends.popart_options import IPU_MODEL_TILES, PopartOptions
from popbert.config import load_config
from popbert.train.trainer import Trainer, micro_batches


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="3 training steps of the tiny BERT on PopART's IPU Model (or IPUs), "
                    "compared with popbert's torch backend. Needs the Poplar SDK.")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--micro-batch-size", type=int, default=4)
    parser.add_argument("--device", choices=("ipu-model", "ipu"), default="ipu-model")
    parser.add_argument("--tiles-per-ipu", type=int, default=IPU_MODEL_TILES,
                        help="IPU Model tiles per IPU (default: a Mk2 IPU's)")
    parser.add_argument("--rtol", type=float, default=1e-3,
                        help="allowed relative difference of each step's loss")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="further config overrides (as for popbert pretrain)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        import_popart()
    except BackendUnavailable as error:
        print(f"popart_smoke: {error}", file=sys.stderr)
        return 2
    # The popart dialect (ai.onnx opset 11 + ai.graphcore, static micro batch) on both backends:
    # the torch lowering runs the ai.graphcore ops too, so both train the very same graph.
    overrides = ["model.dialect=popart", f"execution.micro_batch_size={args.micro_batch_size}",
                 "model.hidden_dropout=0.0", "model.attention_dropout=0.0",
                 f"training.steps={args.steps}", *args.set]
    popart = PopartOptions(device=args.device, tiles_per_ipu=args.tiles_per_ipu)
    with tempfile.TemporaryDirectory() as out:
        runs = {backend: Trainer.from_config(
                    load_config("tiny", [f"execution.backend={backend}", *overrides]),
                    f"{out}/{backend}",
                    backend_options={"popart_options": popart} if backend == "popart" else None)
                for backend in ("torch", "popart")}
        sessions = {name: run.session for name, run in runs.items()}
        start = {name: s.weights() for name, s in sessions.items()}
        for name in start["torch"]:  # same initial weights (the graph's), read back from PopART
            if not torch.equal(start["torch"][name].float(), start["popart"][name].float()):
                print(f"popart_smoke: initial weight {name} differs between the backends",
                      file=sys.stderr)
                return 1
        feed = micro_batches(runs["popart"].loader, sessions["popart"].micro_batches_per_run())
        losses: dict[str, list[float]] = {"torch": [], "popart": []}
        while sessions["popart"].step < args.steps:
            batch = next(feed)
            for name, session in sessions.items():
                losses[name].extend(session.run(batch)[session.loss_name].tolist())
        for run in runs.values():
            run.close()
    ok = True
    print(f"{'step':>4} {'torch':>10} {'popart':>10} {'rel diff':>9}")
    for step, (ours, theirs) in enumerate(zip(losses["torch"], losses["popart"]), start=1):
        diff = abs(theirs - ours) / max(abs(ours), 1e-12)
        ok &= diff <= args.rtol
        print(f"{step:>4} {ours:>10.5f} {theirs:>10.5f} {diff:>9.2e}")
    end = {name: s.weights() for name, s in sessions.items()}
    worst = max(float((end["torch"][n].float() - end["popart"][n].float()).abs().max()
                      / max(float(end["torch"][n].float().abs().max()), 1e-12))
                for n in end["torch"])
    print(f"largest weight difference after {args.steps} steps, relative to the tensor's "
          f"largest value: {worst:.2e}")
    print("agree" if ok and np.isfinite(worst) else f"DIFFER (rtol {args.rtol})")
    sessions["popart"].close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
