"""What computing the last layer for [CLS] alone saves a classifier (`build_bert`'s first-row
last layer, `Family.first_row_layer`): every row of the last layer (`all_rows=True`) against
[CLS] alone (keys and values still from every row), the same weights and rows.

1. Whole training steps of a MiniLM-shaped classifier (L6 H384, 12 heads, FFN 1536, dropout
   0.1, the 30,522-word vocabulary) on the topic leads (`benchmarks/data/topic-train.jsonl`,
   128 tokens), micro-batch 32, rows grouped by length and trimmed as `popbert finetune` runs
   them, AdamW. Two sessions, one per graph; each batch runs on both (who goes first
   alternates), so only the last layer differs. Mean step time.
2. Inference: ONNX Runtime on the two inference graphs (FP32, as built, no fusions), 32 leads
   a batch padded to their longest, `--threads` intra-op threads; interleaved, median of
   `--repeats`. What `popbert predict` / `popbert serve` run for a classifier or a
   cross-encoder.

    python benchmarks/first_row_layer.py --threads 2
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import onnxruntime as ort
import torch

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.graph.annotations import strip_annotations
from popbert.optimizers import AdamW, param_groups_by_name
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import TrainingSession

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dropout import minilm_rows  # noqa: E402 (the same rows)

VOCAB = 30522  # all-MiniLM-L6-v2
KINDS = {"every row": True, "[CLS] alone": False}  # all_rows


def training_steps(steps: int, warmup: int) -> dict[str, float]:
    config, rows = minilm_rows((steps + warmup) * 32)
    config = dataclasses.replace(config, vocab_size=VOCAB)
    sessions = {}
    for kind, every in KINDS.items():
        graph = build_bert(config, task="classification", seed=1, dynamic_sequence=True,
                           all_rows=every)
        sessions[kind] = TrainingSession(
            graph.model(), graph.loss,
            lambda named: AdamW(param_groups_by_name(named, weight_decay=0.01), lr=1e-5),
            SessionOptions(device="cpu", trim_padding=True))
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    order = list(KINDS)
    for index in range(steps + warmup):
        batch = {k: v[index * 32:(index + 1) * 32] for k, v in rows.items()}
        for kind in (order if index % 2 else order[::-1]):
            start = time.perf_counter()
            sessions[kind].run(batch)
            if index >= warmup:
                times[kind].append(time.perf_counter() - start)
    return {kind: statistics.fmean(v) * 1e3 for kind, v in times.items()}


def inference(repeats: int, threads: int) -> dict[str, float]:
    config, rows = minilm_rows(8 * 32)
    config = dataclasses.replace(config, vocab_size=VOCAB, hidden_dropout=0.0,
                                 attention_dropout=0.0)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    sessions = {kind: ort.InferenceSession(
        strip_annotations(build_bert(config, task="classification", seed=1, with_loss=False,
                                     dynamic_sequence=True, all_rows=every).model()
                          ).SerializeToString(), options, providers=["CPUExecutionProvider"])
        for kind, every in KINDS.items()}
    batches = []
    for index in range(8):
        part = {k: v[index * 32:(index + 1) * 32] for k, v in rows.items()}
        longest = int(part["input_mask"].sum(axis=1).max())
        batches.append({k: part[k][:, :longest] for k in ("input_ids", "segment_ids",
                                                           "input_mask")})
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    for _ in range(repeats + 1):
        for kind, session in sessions.items():
            start = time.perf_counter()
            for feed in batches:
                session.run(["logits"], feed)
            times[kind].append((time.perf_counter() - start) / len(batches))
    return {kind: statistics.median(v[1:]) * 1e3 for kind, v in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--steps", type=int, default=20, help="timed training steps each way")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10, help="inference passes each way")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    print(f"threads {threads}", file=sys.stderr)
    print("| what | every row, ms | [CLS] alone, ms | speed-up |")
    print("| --- | ---: | ---: | ---: |")
    for what, result in (
            ("MiniLM-shaped classifier training step, topic leads",
             lambda: training_steps(args.steps, args.warmup)),
            ("ONNX Runtime FP32 inference, batch of 32 leads",
             lambda: inference(args.repeats, threads))):
        ms = result()
        every, alone = ms["every row"], ms["[CLS] alone"]
        print(f"| {what} | {every:.1f} | {alone:.1f} | {every / alone:.2f}× |", flush=True)


if __name__ == "__main__":
    main()
