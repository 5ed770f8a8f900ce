"""What `execution.trim_padding` buys: training steps on real batches of unpacked rows, each
micro-batch run padded to the full sequence length or cut to its longest row.

Same graph (symbolic sequence axis), same weights, same rows, same threads: padded random
micro-batches, the same micro-batches trimmed, and the rows grouped by length into micro-batches
(`finetune.group_by_length`, pools of 50) and trimmed. The three kinds' steps are interleaved so
machine noise hits all alike; mean step times are compared as ratios to the padded one (< 1 =
faster). Real rows, in the order a shuffled loader gives
them (trimming pays only when a whole micro-batch is short):

- **topic**: Wikipedia article leads (`benchmarks/data/topic-train.jsonl`) encoded for sequence
  classification at 128 and 256 tokens (long leads truncated, short ones padded);
- **nsp**: Google's NSP pre-training rows from the Wikipedia text (`wiki-vital-train.txt.gz`),
  128 tokens, 20 prediction slots (10% of them deliberately short, `short_seq_prob`).

    python benchmarks/trim_padding.py                       # L4 H256, micro-batch 32, FP32
    python benchmarks/trim_padding.py --compute bfloat16 --steps 30
    python benchmarks/trim_padding.py --device cuda --compute bfloat16
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig, TaskConfig
from popbert.data.classification import encode_classification, read_classification_file
from popbert.data.loader import length_grouped_order, load_or_create_instances
from popbert.data.tokenization import WordPieceTokenizer, bundled_vocab_path
from popbert.optimizers import AdamW, param_groups_by_name
from popbert.runtime.inputs import PaddingTrimmer
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import TrainingSession

DATA = Path(__file__).resolve().parent / "data"


def model_config(sequence_length: int, task: TaskConfig | None = None) -> BertConfig:
    """BERT-Mini's shape (L4 H256), the bundled 8192-token vocabulary."""
    config = BertConfig(vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4,
                        intermediate_size=1024, max_position_embeddings=512,
                        sequence_length=sequence_length, max_predictions_per_seq=20)
    if task is not None:
        config.task = task
    return config


def topic_rows(sequence_length: int, rows: int, seed: int) -> tuple[BertConfig, dict]:
    data = read_classification_file(DATA / "topic-train.jsonl")
    arrays = encode_classification(data, WordPieceTokenizer(bundled_vocab_path()),
                                   sequence_length)
    labels = sorted(set(data.labels or []))
    arrays["labels"] = np.array([labels.index(label) for label in data.labels or []], np.int64)
    task = TaskConfig(name="classification", lowercase=True, num_labels=len(labels),
                      labels=labels)
    return model_config(sequence_length, task), _shuffled(arrays, rows, seed)


def nsp_rows(rows: int, seed: int) -> tuple[BertConfig, dict]:
    with tempfile.TemporaryDirectory() as work:
        text = Path(work) / "wiki-vital-train.txt"
        text.write_bytes(gzip.decompress((DATA / "wiki-vital-train.txt.gz").read_bytes()))
        arrays = load_or_create_instances(text, None, 128, 20, seed=1, use_cache=False)
    return model_config(128), _shuffled(arrays, rows, seed)


def _shuffled(arrays: dict[str, np.ndarray], rows: int, seed: int) -> dict[str, np.ndarray]:
    order = np.random.default_rng(seed).permutation(len(next(iter(arrays.values()))))[:rows]
    return {k: np.asarray(v)[order].astype(np.int64) for k, v in arrays.items()}


def session(config: BertConfig, task: str, trim: bool, compute: str, device: str
            ) -> TrainingSession:
    torch.manual_seed(0)
    graph = build_bert(config, task=task, seed=1, dynamic_sequence=True)
    return TrainingSession(
        graph.model(), graph.loss,
        lambda named: AdamW(param_groups_by_name(named, weight_decay=0.01), lr=1e-4),
        SessionOptions(device=device, trim_padding=trim, compute_dtype=compute))


def measure(name: str, config: BertConfig, task: str, rows: dict, args: argparse.Namespace
            ) -> dict:
    """Mean step time of the same rows three ways: padded random batches, the same batches
    trimmed, and batches grouped by length (`finetune.group_by_length`) trimmed."""
    sessions = {trim: session(config, task, trim, args.compute, args.device)
                for trim in (False, True)}
    cuda = sessions[True].device.type == "cuda"
    micro = args.micro_batch_size
    count = len(rows["input_ids"]) // micro
    grouped_order = length_grouped_order(np.arange(count * micro),
                                         rows["input_mask"].sum(axis=1), micro,
                                         np.random.default_rng(0))
    orders = {"padded": np.arange(count * micro), "trimmed": np.arange(count * micro),
              "grouped": grouped_order}
    trimmer = PaddingTrimmer(sessions[True].inputs.specs)
    times: dict[str, list[float]] = {kind: [] for kind in orders}
    widths: dict[str, list[int]] = {kind: [] for kind in orders}
    for index in range(count):
        kinds = list(orders)
        for kind in kinds[index % 3:] + kinds[:index % 3]:  # rotate who goes first
            chosen = orders[kind][index * micro:(index + 1) * micro]
            batch = {k: v[chosen] for k, v in rows.items()}
            trim = kind != "padded"
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            sessions[trim].run(batch)
            if cuda:
                torch.cuda.synchronize()
            if index >= args.warmup:
                times[kind].append(time.perf_counter() - start)
                widths[kind].append(trimmer(sessions[True].inputs.check(batch))["input_ids"]
                                    .shape[1] if trim else config.sequence_length)
    mean = {kind: statistics.fmean(t) for kind, t in times.items()}
    real = float(np.mean(rows["input_mask"]))
    result = {"rows": name, "real_tokens": real, "full_width": config.sequence_length,
              **{f"{kind}_s": value for kind, value in mean.items()},
              **{f"{kind}_width": statistics.fmean(w) for kind, w in widths.items()}}
    print(f"| {name} | {real:.0%} | {mean['padded'] * 1e3:.0f} | "
          f"{statistics.fmean(widths['trimmed']):.0f}: {mean['trimmed'] * 1e3:.0f} "
          f"({mean['trimmed'] / mean['padded']:.2f}) | "
          f"{statistics.fmean(widths['grouped']):.0f}: {mean['grouped'] * 1e3:.0f} "
          f"({mean['grouped'] / mean['padded']:.2f}) |", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30, help="timed steps of each kind")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--micro-batch-size", type=int, default=32)
    parser.add_argument("--compute", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = (args.steps + args.warmup) * args.micro_batch_size
    print(f"threads {torch.get_num_threads()}, micro-batch {args.micro_batch_size}, "
          f"compute {args.compute}, {args.steps} steps each (mean)", file=sys.stderr)
    print("| rows | real tokens | padded: ms/step | trimmed: width, ms/step (ratio) | "
          "grouped by length and trimmed: width, ms/step (ratio) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for length in (128, 256):
        config, batch = topic_rows(length, rows, seed=0)
        measure(f"topic classification, {length}", config, "classification", batch, args)
    config, batch = nsp_rows(rows, seed=0)
    measure("NSP pre-training, 128", config, "pretraining", batch, args)


if __name__ == "__main__":
    main()
