"""Which weights to leave in FP32, and per-channel or per-tensor scales: measured, not assumed.

For a fine-tuned classification run (the topic classifier of benchmarks/inference.py, say) this
exports the plain FP32 model, then quantizes its optimized graph (dynamic INT8,
`popbert.export.quantize`, on what `--optimize` writes, as `popbert export --quantize int8` does)
with every choice of roles kept in FP32 below and with per-tensor and per-channel weight scales, and
scores each on a labelled file against the FP32 export: held-out accuracy, agreement of labels
with FP32, and the median latency of a batch in ONNX Runtime (2 threads). The default of
`popbert export --quantize int8` is the fastest choice within 1 point of FP32 accuracy.

    python benchmarks/quantization_choice.py --run RUN_DIR --eval benchmarks/data/topic-test.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import onnx

CHOICES = [(), ("head",), ("head", "ffn-out"), ("head", "qkv"), ("head", "ffn-in"),
           ("head", "attention-out")]


def latency(path: Path, rows: int, threads: int, calls: int) -> float:
    """Median ms per call of the model at `path` on `rows` full rows of 128 tokens."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = threads, 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    ids = np.random.default_rng(0).integers(1000, 8000, (rows, 128))
    feeds = {"input_ids": ids, "segment_ids": np.zeros_like(ids),
             "input_mask": np.ones_like(ids)}
    session.run(None, feeds)
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        session.run(None, feeds)
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="fine-tuned classification run")
    parser.add_argument("--eval", type=Path, required=True, help="labelled rows to score on")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rows", type=int, default=32, help="batch of the latency figure")
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()

    from popbert.config import load_config
    from popbert.export.accuracy import accuracy_cost
    from popbert.export.fused import CPU_FUSIONS, fuse_for_ort
    from popbert.export.inference import export_checkpoint
    from popbert.export.quantize import quantize_int8

    results = []
    with tempfile.TemporaryDirectory() as tmp:
        reference = export_checkpoint(args.run, "classification", Path(tmp) / "fp32.onnx")
        fp32 = accuracy_cost(reference, reference, "classification", args.eval)
        results.append({"weights": "fp32", "kept": "all", "accuracy": fp32.reference["accuracy"],
                        "agreement": 100.0, "ms": latency(reference, args.rows, args.threads,
                                                          args.calls)})
        # What `popbert export --quantize int8` quantizes: the graph `--optimize` writes.
        heads = load_config(args.run / "config.yaml").model.num_heads
        optimized, _ = fuse_for_ort(onnx.load(str(reference)), heads, CPU_FUSIONS)
        for per_channel in (False, True):
            for kept in CHOICES:
                model, _ = quantize_int8(optimized, kept, per_channel)
                path = Path(tmp) / "int8.onnx"
                onnx.save(model, str(path))
                cost = accuracy_cost(reference, path, "classification", args.eval)
                results.append({"weights": "int8 per channel" if per_channel else
                                "int8 per tensor", "kept": ",".join(kept) or "none",
                                "accuracy": cost.candidate["accuracy"],
                                "agreement": 100 * cost.agreement,
                                "ms": latency(path, args.rows, args.threads, args.calls)})
                print(json.dumps(results[-1]), flush=True)
    print(f"\nrun {args.run}, {args.eval} ({fp32.examples} rows), {args.threads} threads, "
          f"latency at batch {args.rows} x 128, load average {os.getloadavg()[0]:.1f}\n")
    print("| weights | kept in FP32 | accuracy | agreement with FP32 | ms / batch |")
    print("| --- | --- | ---: | ---: | ---: |")
    for r in results:
        print(f"| {r['weights']} | {r['kept']} | {r['accuracy']:.2f} | {r['agreement']:.2f}% | "
              f"{r['ms']:.1f} |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
