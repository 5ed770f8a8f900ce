"""What scoring a fine-tuned model on its evaluation file costs with and without the padding
(`popbert.train.finetune.infer`, the end-of-run score of every `popbert finetune` task).

Before: the evaluation rows in file order, `finetune.eval_batch_size` (64) a batch, every row at
the full `max_seq_length` (128). Now: rows longest first, each batch cut to its longest row
(`popbert.runtime.buckets.run_by_length`), per-token outputs padded back. The same
MiniLM-shaped graph (L6 H384, 12 heads, FFN 1536, the 30,522-word vocabulary; speed does not
depend on the weights), the same weights, the same rows, `--threads` threads; the two ways
interleaved (who goes first alternates), median of `--repeats`.

- token classification: every sentence of `benchmarks/data/wiki-links-ner-test.conll`
  (Wikipedia sentences, 5 entity types), the windows `finetune token-classification` scores;
- classification: every lead of `benchmarks/data/topic-test.jsonl` (11 topics).

Also checked: the two ways' outputs agree (largest difference over the largest value).

    python benchmarks/evaluation.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.builders.bert import build_bert
from popbert.builders.bert_config import BertConfig, TaskConfig
from popbert.data.classification import encode_classification, read_classification_file
from popbert.data.token_classification import encode_tagged, label_list, read_tagged
from popbert.data.tokenization import WordPieceTokenizer, bundled_vocab_path
from popbert.runtime.buckets import run_by_length
from popbert.runtime.options import SessionOptions
from popbert.runtime.session import InferenceSession
from popbert.tasks import task_named
from popbert.train.finetune import infer

DATA = Path(__file__).resolve().parent / "data"
LENGTH = 128
EVAL_BATCH = 64  # finetune.eval_batch_size's default


def task_rows(task: str) -> tuple[TaskConfig, dict[str, np.ndarray]]:
    """The head and the evaluation rows `popbert finetune` scores for `task`."""
    tokenizer = WordPieceTokenizer(bundled_vocab_path())
    if task == "token-classification":
        data = read_tagged(DATA / "wiki-links-ner-test.conll")
        labels = label_list(data)
        arrays, _ = encode_tagged(data, tokenizer, labels, LENGTH)
        return TaskConfig(name=task, num_labels=len(labels), labels=labels), arrays
    data = read_classification_file(DATA / "topic-test.jsonl")
    labels = sorted(set(data.labels or []))
    arrays = encode_classification(data, tokenizer, LENGTH)
    return TaskConfig(name=task, num_labels=len(labels), labels=labels), arrays


def padded(config: BertConfig, task: str, weights: dict, arrays: dict[str, np.ndarray]
           ) -> dict[str, np.ndarray]:
    """The evaluation as it ran before: file order, every row at the full length."""
    graph = build_bert(config, task=task, with_loss=False, zeros=True)
    session = InferenceSession(graph.model(), SessionOptions(device="cpu"))
    session.load_weights(weights, strict=False)

    def run_batch(feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        outputs = session.run({k: torch.from_numpy(v) for k, v in feeds.items()})
        return {k: v.float().numpy() for k, v in outputs.items()}

    result, _ = run_by_length(run_batch, arrays, EVAL_BATCH,
                              inputs=("input_ids", "segment_ids", "input_mask"),
                              bucket=False, cut=False, desc="padded")
    return result


def measure(task: str, repeats: int) -> dict[str, float]:
    head, arrays = task_rows(task)
    arrays = {k: v for k, v in arrays.items() if k in ("input_ids", "segment_ids", "input_mask")}
    config = BertConfig(vocab_size=30522, hidden_size=384, num_layers=6, num_heads=12,
                        intermediate_size=1536, max_position_embeddings=512,
                        sequence_length=LENGTH, task=head)
    torch.manual_seed(0)
    weights = InferenceSession(build_bert(config, task=task, with_loss=False).model(),
                               SessionOptions()).weights()
    ways: dict[str, Callable[[], dict[str, np.ndarray]]] = {
        "padded": lambda: padded(config, task, weights, arrays),
        "cut": lambda: infer(config, task, weights, arrays, EVAL_BATCH, "cpu")}
    times: dict[str, list[float]] = {way: [] for way in ways}
    outputs: dict[str, dict[str, np.ndarray]] = {}
    order = list(ways)
    for index in range(repeats):
        for way in (order if index % 2 else order[::-1]):
            started = time.perf_counter()
            outputs[way] = ways[way]()
            times[way].append(time.perf_counter() - started)
    fills = task_named(task).per_token_outputs
    masked = arrays["input_mask"] == 0
    worst = 0.0
    for name, reference in outputs["padded"].items():
        reference = reference.copy()
        if name in fills:
            reference[masked] = fills[name]
        worst = max(worst, float(np.abs(outputs["cut"][name] - reference).max()
                                 / np.abs(reference).max()))
    real = float(arrays["input_mask"].mean())
    padded_s, cut_s = (statistics.median(times[way]) for way in ways)
    row = {"rows": len(arrays["input_ids"]), "real_tokens": real, "padded_s": padded_s,
           "cut_s": cut_s, "speedup": padded_s / cut_s, "relative_difference": worst}
    print(f"| {task} | {row['rows']} | {real:.0%} | {padded_s:.2f} | {cut_s:.2f} | "
          f"{row['speedup']:.2f}x | {worst:.1e} |", flush=True)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tasks", nargs="+", default=["token-classification", "classification"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print("| task | rows | real tokens | padded s | cut s | speed-up | max rel. difference |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for task in args.tasks:
        measure(task, args.repeats)


if __name__ == "__main__":
    main()
