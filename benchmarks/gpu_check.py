"""popbert's jobs on a GPU, once per model family: does the whole path work there, and resume?

For each family (BERT `tiny`, GroupBERT `groupbert-mini`, ModernBERT `fast`, and BERT with BF16
weights and stochastic rounding) a short `popbert pretrain` on CUDA with BF16 compute and
`torch.compile`, as users would run it:

* a straight run of `--steps` steps, with checkpoints every half and the ONNX export (which
  verifies itself against the torch backend and says so in its log line);
* the same run again (GPU kernels such as the embedding's backward add in any order, so two
  straight runs need not agree to the bit: their difference is the yardstick);
* the same run SIGKILLed once its half-way checkpoint is on disk, then `--resume`d;
* the straight run's weights exported for sentence embeddings and served as `popbert serve
  --device cuda` serves them (popbert's torch backend on the ONNX graph), against ONNX Runtime
  on the CPU on the same file.

It prints one table (wall time, steady steps/s, first and last loss, the resumed run's and the
rerun's largest weight difference from the straight run, the export's verification) and writes
the rows as JSON. Families run side by side (the GPU is idle most of a tiny model's step), so the
steps/s are a check that nothing is pathologically slow, not a benchmark: `benchmarks/gpu.sh`
holds the measured throughput.

    python benchmarks/gpu_check.py --json gpu_check.json             # on a CUDA machine
    python benchmarks/gpu_check.py --dry-run                         # anywhere: CPU, no compile
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

import numpy as np
import safetensors.torch

FAMILIES = {  # name: the preset and its extra settings
    "bert": ("tiny", {}),
    "groupbert": ("groupbert-mini", {}),
    "modernbert": ("fast", {}),
    "bert-bf16-weights": ("tiny", {"execution.weight_dtype": "bfloat16",
                                   "execution.stochastic_rounding": "true"}),
}


def settings(device: str, compile_: bool, steps: int, extra: dict[str, str]) -> list[str]:
    values = {"execution.device": device, "execution.compute_dtype": "bfloat16",
              "execution.compile": str(compile_).lower(), "training.steps": str(steps),
              "training.checkpoint_every": str(steps // 2), "training.log_every": "1",
              "training.time_budget": "null", "training.eval_points": "0",
              "optimizer.warmup_steps": str(max(steps // 10, 1)), **extra}
    return [a for key, value in values.items() for a in ("--set", f"{key}={value}")]


def run(argv: list[str], log: Path, timeout: float, kill_at: Path | None = None) -> float:
    """`python -m popbert *argv`, its output in `log`; SIGKILLed once `kill_at` exists."""
    start = time.monotonic()
    with log.open("a") as out:
        process = subprocess.Popen([sys.executable, "-m", "popbert", *argv], stdout=out,
                                   stderr=subprocess.STDOUT)
        while process.poll() is None:
            if time.monotonic() - start > timeout:
                process.kill()
                raise RuntimeError(f"timed out after {timeout:.0f} s (log {log})")
            if kill_at is not None and kill_at.exists():
                process.send_signal(signal.SIGKILL)
                process.wait()
                return time.monotonic() - start
            time.sleep(0.05)
    if process.returncode != 0 or kill_at is not None:
        tail = "\n".join(log.read_text().splitlines()[-15:])
        raise RuntimeError(f"exit {process.returncode} before it was due to stop:\n{tail}")
    return time.monotonic() - start


def weights(directory: Path) -> dict[str, np.ndarray]:
    newest = max((directory / "checkpoints").iterdir())
    loaded = safetensors.torch.load_file(str(newest / "weights.safetensors"))  # BF16 too
    return {name: value.double().numpy() for name, value in loaded.items()}


def largest_difference(a: Path, b: Path) -> float:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    return max(float(np.abs(wa[k] - wb[k]).max()) for k in wa)


def served_on_device(run_dir: Path, work: Path, device: str, timeout: float) -> float:
    """The largest difference between the vectors and token states of an embedding export of
    `run_dir`, run as `popbert serve --device` runs it and in ONNX Runtime on the CPU."""
    from popbert.serve.embed import EmbedPredictor

    model = work / "embedding.onnx"
    run(["export", "--checkpoint", str(run_dir), "--task", "embedding", "--output", str(model)],
        work / "export-embedding.log", timeout)
    texts = ["a short text", "the cat sat on the mat while the dog slept by the door " * 3]
    on_device, on_cpu = EmbedPredictor(model, device=device), EmbedPredictor(model)
    differences = [np.abs(on_device.embed(texts) - on_cpu.embed(texts)).max()]
    differences += [np.abs(a - b).max() for a, b in zip(on_device.token_states(texts),
                                                        on_cpu.token_states(texts))]
    return float(max(differences))


def records(directory: Path) -> list[dict]:
    return [json.loads(line) for line in (directory / "metrics.jsonl").read_text().splitlines()]


def check_family(family: str, work: Path, device: str, compile_: bool, steps: int,
                 timeout: float) -> dict:
    preset, extra = FAMILIES[family]
    root = work / family
    root.mkdir(parents=True, exist_ok=True)
    argv = ["pretrain", "--config", preset, *settings(device, compile_, steps, extra)]
    row: dict = {"family": family, "preset": preset}
    try:
        log = root / "straight.log"
        row["wall_s"] = round(run([*argv, "-o", str(root / "straight")], log, timeout), 1)
        verified = re.search(r"matches the torch backend to (\S+)", log.read_text())
        row["export"] = f"ORT ≡ torch to {verified.group(1)}" if verified else "not verified"
        history = records(root / "straight")
        row["first_loss"], row["last_loss"] = history[0]["loss"], history[-1]["loss"]
        steady = [r["seq_per_s"] for r in history[len(history) // 2:]]
        row["steady_seq_per_s"] = round(float(np.median(steady)), 0)
        run([*argv, "-o", str(root / "rerun")], root / "rerun.log", timeout)
        row["rerun_max_dweight"] = largest_difference(root / "straight", root / "rerun")
        half = root / "killed" / "checkpoints" / f"step-{steps // 2:06d}" / "state.json"
        run([*argv, "-o", str(root / "killed")], root / "killed.log", timeout, kill_at=half)
        run(["pretrain", "--resume", str(root / "killed")], root / "resume.log", timeout)
        row["resume_max_dweight"] = largest_difference(root / "straight", root / "killed")
        row["resume_last_loss"] = records(root / "killed")[-1]["loss"]
        # FP32 on both sides, so rounding only: 1e-3 would still pass TF32 matmuls
        row["served_max_diff"] = served_on_device(root / "straight", root, device, timeout)
        row["ok"] = (verified is not None and row["last_loss"] < row["first_loss"]
                     and row["resume_max_dweight"] <= max(10 * row["rerun_max_dweight"], 1e-6)
                     and row["served_max_diff"] <= 1e-3)
    except Exception as error:  # one family's failure must not hide the others' results
        row["ok"], row["error"] = False, str(error)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", type=Path, default=Path("/tmp/popbert-gpu-check"))
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=180, help="seconds per command")
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=FAMILIES)
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--dry-run", action="store_true", help="CPU, no compile, 6 steps")
    args = parser.parse_args()
    device, compile_, steps = ("cpu", False, 6) if args.dry_run else ("cuda", True, args.steps)
    if not args.dry_run:
        import torch

        print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    shutil.rmtree(args.work, ignore_errors=True)  # this script's own scratch, from a last time
    rows = []
    with ThreadPoolExecutor(len(args.families)) as pool:
        futures = [pool.submit(check_family, f, args.work, device, compile_, steps, args.timeout)
                   for f in args.families]
        for future in as_completed(futures):  # each as it ends, in case the rest are cut off
            rows.append(future.result())
            print(json.dumps(rows[-1]), flush=True)
    print(f"| family | wall s | steady seq/s | loss first → last | resumed: last loss, "
          f"max Δweight | rerun max Δweight | export | served on {device} vs ORT | ok |\n"
          f"{'| --- ' * 9}|")
    for r in rows:
        if "error" in r:
            print(f"| {r['family']} | failed: {r['error']} ||||||| no |")
            continue
        print(f"| {r['family']} | {r['wall_s']} | {r['steady_seq_per_s']:.0f} | "
              f"{r['first_loss']:.3f} → {r['last_loss']:.3f} | {r['resume_last_loss']:.3f}, "
              f"{r['resume_max_dweight']:.2g} | {r['rerun_max_dweight']:.2g} | {r['export']} | "
              f"{r['served_max_diff']:.2g} | {'yes' if r['ok'] else 'NO'} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
