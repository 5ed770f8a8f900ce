"""Training-step time: popbert's lowered ONNX graph vs Hugging Face `BertForPreTraining`.

Both train the same model (same weights, same batch, same device, same `torch.optim.AdamW`):
one step = forward + backward + optimizer step. Steps of the two are interleaved so machine
noise hits both alike; the table prints medians and the ratio popbert / HF (< 1 = faster).

Note what differs by design: popbert computes the MLM head on the masked positions only
(Graphcore's layout); Hugging Face projects every token onto the vocabulary.

    python benchmarks/step_time.py                  # CPU: tiny and 4-layer H=256
    python benchmarks/step_time.py --gpu            # + BERT-Base/Large seq 128 on CUDA
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from bert_helpers import hf_labels, hf_model, padded_batch  # noqa: E402

from popbert import hf  # noqa: E402
from popbert.builders.bert import build_bert  # noqa: E402
from popbert.builders.bert_config import BertConfig  # noqa: E402
from popbert.runtime.session import SessionOptions, TrainingSession  # noqa: E402

CPU_CASES = {
    "tiny (L2 H128 A2, seq 128, batch 32)": (
        dict(vocab_size=8192, hidden_size=128, num_layers=2, num_heads=2, intermediate_size=512,
             max_position_embeddings=128), 32),
    "L4 H256 A4 (seq 128, batch 16)": (
        dict(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4, intermediate_size=1024,
             max_position_embeddings=128), 16),
}
GPU_CASES = {
    "BERT-Base (seq 128, batch 64)": (dict(), 64),
    "BERT-Large (seq 128, batch 32)": (
        dict(hidden_size=1024, num_layers=24, num_heads=16, intermediate_size=4096), 32),
}


def make_pair(shape: dict, batch_size: int, device: str, dropout: float, compute: str,
              compile_: bool):
    config = BertConfig(**shape, sequence_length=128, max_predictions_per_seq=20,
                        hidden_dropout=dropout, attention_dropout=dropout)
    model = build_bert(config, seed=0).model()
    weights = {t.name: __import__("onnx").numpy_helper.to_array(t)
               for t in model.graph.initializer}
    options = SessionOptions(device=device, compute_dtype=compute, compile=compile_)
    ours = TrainingSession(model, "loss",
                           lambda p: torch.optim.AdamW([x for _, x in p], lr=1e-4, foreach=True),
                           options)
    theirs = hf_model(config, hf.to_hf(weights, config))
    theirs.config._attn_implementation = "sdpa"  # HF's default, fastest path
    theirs.to(device).train()
    hf_optimizer = torch.optim.AdamW(theirs.parameters(), lr=1e-4, foreach=True)
    hf_forward = torch.compile(theirs) if compile_ else theirs
    batch = padded_batch(config, batch_size=batch_size, seed=1)
    hf_batch = dict(input_ids=torch.from_numpy(batch["input_ids"]),
                    attention_mask=torch.from_numpy(batch["input_mask"]),
                    token_type_ids=torch.from_numpy(batch["segment_ids"]),
                    labels=hf_labels(batch, config.sequence_length),
                    next_sentence_label=torch.from_numpy(batch["next_sentence_labels"]))
    hf_batch = {k: v.to(device) for k, v in hf_batch.items()}
    ours_batch = {k: torch.from_numpy(v).to(device) for k, v in batch.items()}
    dtype = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}[compute]

    def step_ours() -> None:
        ours.run(ours_batch)

    def step_theirs() -> None:
        hf_optimizer.zero_grad(set_to_none=True)
        if dtype is None:
            loss = hf_forward(**hf_batch).loss
        else:
            with torch.autocast(torch.device(device).type, dtype=dtype):
                loss = hf_forward(**hf_batch).loss
        loss.backward()
        hf_optimizer.step()

    return step_ours, step_theirs


def timed(fn, device: str) -> float:
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return time.perf_counter() - start


def measure(step_ours, step_theirs, device: str, warmup: int, steps: int) -> tuple[float, float]:
    for _ in range(warmup):
        step_ours()
        step_theirs()
    ours, theirs = [], []
    for _ in range(steps):
        ours.append(timed(step_ours, device))
        theirs.append(timed(step_theirs, device))
    return statistics.median(ours), statistics.median(theirs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpu", action="store_true", help="also run BERT-Base/Large on CUDA")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--compile", action="store_true", help="also time torch.compile")
    args = parser.parse_args()

    runs = [(name, shape, batch, "cpu", "float32", False)
            for name, (shape, batch) in CPU_CASES.items()]
    if args.gpu:
        if not torch.cuda.is_available():
            sys.exit("--gpu: CUDA is not available on this machine")
        for name, (shape, batch) in GPU_CASES.items():
            for compute in ("float32", "bfloat16"):
                runs.append((name, shape, batch, "cuda", compute, False))
                if args.compile:
                    runs.append((name, shape, batch, "cuda", compute, True))
    elif args.compile:
        runs += [(name, shape, batch, "cpu", "float32", True)
                 for name, (shape, batch) in CPU_CASES.items()]

    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}, dropout "
          f"{args.dropout}, median of {args.steps} interleaved steps")
    print(f"{'model':40s} {'device':6s} {'compute':9s} {'compile':7s} "
          f"{'popbert ms':>10s} {'HF ms':>8s} {'ratio':>6s}")
    for name, shape, batch, device, compute, compile_ in runs:
        torch.manual_seed(0)
        np.random.seed(0)
        ours, theirs = measure(*make_pair(shape, batch, device, args.dropout, compute, compile_),
                               device, args.warmup, args.steps)
        print(f"{name:40s} {device:6s} {compute:9s} {str(compile_):7s} {ours * 1e3:10.1f} "
              f"{theirs * 1e3:8.1f} {ours / theirs:6.2f}", flush=True)


if __name__ == "__main__":
    main()
