"""What dropout costs on CPU: torch's ``bernoulli_`` masks against popbert's hashed ones
(`popbert.lowering.dropout`), as one op and inside whole fine-tuning steps.

1. The op alone, forward and backward, at the shapes of a MiniLM fine-tuning micro-batch
   (32 rows of 88 tokens, hidden 384, 12 heads): the hidden-state dropout and the attention
   probabilities' dropout. Interleaved, minimum of `--repeats`.
2. Whole training steps of a MiniLM-shaped classifier (L6 H384, 12 heads, FFN 1536, dropout
   0.1, the bundled vocabulary) on the topic leads (`benchmarks/data/topic-train.jsonl`, 128
   tokens), micro-batch 32, rows grouped by length and trimmed (`execution.trim_padding`, as
   `popbert finetune` runs them), AdamW. One session; each step is run with torch's masks and
   then with hashed ones (who goes first alternates), on the same batch: the step's other work
   is identical, so the ratio is dropout's share.

    python benchmarks/dropout.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import popbert.lowering.dropout as hashed
import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig, TaskConfig
from popbert.data.classification import encode_classification, read_classification_file
from popbert.data.loader import length_grouped_order
from popbert.data.tokenization import WordPieceTokenizer, bundled_vocab_path
from popbert.optimizers import AdamW, param_groups_by_name
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import TrainingSession

DATA = Path(__file__).resolve().parent / "data"
P = 0.1  # BERT's hidden and attention dropout


def op_alone(repeats: int) -> list[dict]:
    """Forward + backward of one dropout, torch's against hashed, interleaved."""
    results = []
    for name, shape in (("hidden states [32, 88, 384]", (32, 88, 384)),
                        ("attention probabilities [32, 12, 88, 88]", (32, 12, 88, 88))):
        x = torch.randn(shape, requires_grad=True)
        grad = torch.randn(shape)
        ways = {"torch": lambda v: F.dropout(v, P, True), "hashed": lambda v: hashed.dropout(v, P)}
        times: dict[str, list[float]] = {k: [] for k in ways}
        for _ in range(repeats + 2):
            for kind, fn in ways.items():
                start = time.perf_counter()
                fn(x).backward(grad)
                times[kind].append(time.perf_counter() - start)
        best = {k: min(v[2:]) * 1e3 for k, v in times.items()}
        results.append({"op": name, **{f"{k}_ms": v for k, v in best.items()}})
        print(f"| {name} | {best['torch']:.2f} | {best['hashed']:.2f} | "
              f"{best['torch'] / best['hashed']:.1f}× |", flush=True)
    return results


def minilm_rows(rows: int) -> tuple[BertConfig, dict]:
    data = read_classification_file(DATA / "topic-train.jsonl")
    arrays = encode_classification(data, WordPieceTokenizer(bundled_vocab_path()), 128)
    labels = sorted(set(data.labels or []))
    arrays["labels"] = np.array([labels.index(label) for label in data.labels or []], np.int64)
    order = length_grouped_order(np.arange(rows), arrays["input_mask"][:rows].sum(axis=1), 32,
                                 np.random.default_rng(0))
    config = BertConfig(vocab_size=8192, hidden_size=384, num_layers=6, num_heads=12,
                        intermediate_size=1536, max_position_embeddings=512,
                        sequence_length=128, hidden_dropout=P, attention_dropout=P)
    config.task = TaskConfig(name="classification", lowercase=True, num_labels=len(labels),
                             labels=labels)
    return config, {k: np.asarray(v)[order].astype(np.int64) for k, v in arrays.items()}


def alternating_steps(config: BertConfig, rows: dict, toggle: Callable[[bool], None],
                      steps: int, warmup: int) -> dict[bool, float]:
    """Mean ms of a trimmed, length-grouped training step of `config` with `toggle(False)` and
    with `toggle(True)`: one session, each batch run both ways (who goes first alternates), so
    only what the toggle switches differs. Prints the table's row; leaves `toggle(True)` on."""
    torch.manual_seed(0)
    graph = build_bert(config, task="classification", seed=1, dynamic_sequence=True)
    session = TrainingSession(
        graph.model(), graph.loss,
        lambda named: AdamW(param_groups_by_name(named, weight_decay=0.01), lr=1e-5),
        SessionOptions(device="cpu", trim_padding=True))
    times: dict[bool, list[float]] = {False: [], True: []}
    for index in range(steps + warmup):
        batch = {k: v[index * 32:(index + 1) * 32] for k, v in rows.items()}
        for on in ((False, True) if index % 2 else (True, False)):
            toggle(on)
            start = time.perf_counter()
            session.run(batch)
            if index >= warmup:
                times[on].append(time.perf_counter() - start)
    toggle(True)
    mean = {k: statistics.fmean(v) * 1e3 for k, v in times.items()}
    print(f"| MiniLM-shaped classifier step, topic leads | {mean[False]:.0f} | "
          f"{mean[True]:.0f} | {mean[False] / mean[True]:.2f}× |", flush=True)
    return mean


def whole_steps(steps: int, warmup: int) -> dict:
    """Mean step time with torch's masks and with hashed ones, the same batches."""
    config, rows = minilm_rows((steps + warmup) * 32)

    def use_hash(on: bool) -> None:
        hashed.HASHED = on

    mean = alternating_steps(config, rows, use_hash, steps, warmup)
    return {"torch_ms": mean[False], "hashed_ms": mean[True], "steps": steps}


def run_a_against_b(description: str, a: str, b: str, op_alone: Callable[[int], object],
                    whole_steps: Callable[[int, int], object]) -> None:
    """The command line of an A-against-B benchmark of this shape: its flags, then the table
    (columns `a` and `b`) of `op_alone(repeats)` and `whole_steps(steps, warmup)`."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=20, help="op timings of each kind")
    parser.add_argument("--steps", type=int, default=20, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"threads {torch.get_num_threads()}", file=sys.stderr)
    print(f"| what | {a}, ms | {b}, ms | speed-up |")
    print("| --- | ---: | ---: | ---: |")
    op_alone(args.repeats)
    whole_steps(args.steps, args.warmup)


def main() -> None:
    run_a_against_b(__doc__.split("\n\n")[0], "torch's masks", "hashed masks", op_alone,
                    whole_steps)


if __name__ == "__main__":
    main()
