"""A fine-tuned classifier's FP32 export against `BertForSequenceClassification` eager, same
weights, fixed shapes: does the classification export run faster than the encoder export does?

Both take the same rows (sequence 128, full masks, batch 1 and 32) at the same thread count,
timed in alternating blocks of calls; the export is `popbert export --task classification`
(plain FP32) and the Hugging Face model is `popbert export-hf` of the same run.

    python benchmarks/classification_latency.py --run RUN_DIR   # a `popbert finetune classify` run
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--blocks", type=int, default=8)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import onnxruntime as ort
    import torch
    import transformers

    from popbert.export.inference import export_checkpoint
    from popbert.hf.checkpoint import export_hf

    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        onnx_file = export_checkpoint(args.run, "classification", Path(tmp) / "fp32.onnx")
        export_hf(args.run, Path(tmp) / "hf")
        model = transformers.BertForSequenceClassification.from_pretrained(
            str(Path(tmp) / "hf"), attn_implementation="sdpa").eval()
        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = args.threads, 1
        session = ort.InferenceSession(str(onnx_file), options,
                                       providers=["CPUExecutionProvider"])
        print(f"load average {os.getloadavg()[0]:.2f}, {args.threads} threads, sequence 128")
        for rows in (1, 32):
            ids = np.random.default_rng(0).integers(1000, 8000, (rows, 128))
            feeds = {"input_ids": ids, "segment_ids": np.zeros_like(ids),
                     "input_mask": np.ones_like(ids)}
            tensors = {"input_ids": torch.from_numpy(ids),
                       "token_type_ids": torch.zeros(rows, 128, dtype=torch.long),
                       "attention_mask": torch.ones(rows, 128, dtype=torch.long)}

            def eager(tensors=tensors) -> np.ndarray:
                with torch.no_grad():
                    return model(**tensors).logits.numpy()

            def exported(feeds=feeds) -> np.ndarray:
                return session.run(None, feeds)[0]

            difference = float(np.abs(eager() - exported()).max())
            times: dict[str, list[float]] = {"eager": [], "export": []}
            calls = 10 if rows == 1 else 2
            for block in range(args.blocks):
                pair = [("eager", eager), ("export", exported)]
                for name, run in pair if block % 2 == 0 else pair[::-1]:
                    run()  # a warm call after the other one ran
                    started = time.perf_counter()
                    for _ in range(calls):
                        run()
                    times[name].append((time.perf_counter() - started) / calls * 1000)
            eager_ms, export_ms = (statistics.median(times[k]) for k in ("eager", "export"))
            print(f"batch {rows}: eager {eager_ms:.1f} ms, export {export_ms:.1f} ms, "
                  f"{eager_ms / export_ms:.2f}x; logits differ by {difference:.1e}")


if __name__ == "__main__":
    main()
