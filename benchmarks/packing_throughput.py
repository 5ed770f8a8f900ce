"""Packed vs padded pre-training: real (non-padding) tokens per second, side by side.

The same model trains on the same sequences three ways, steps interleaved so load from elsewhere
on the machine hits all alike:

* **padded**: one sequence per row, `input_mask` (what the instance shards hold);
* **packed, dense mask**: up to K sequences per row (`pack_instance_arrays`, the pipeline's
  pack stage) with the graph's block-diagonal mask applied to full ``S × S`` attention;
* **packed, per sequence**: the same packed rows, attention within each sequence only
  (`popbert.lowering.block_attention`, the default).

Every configuration runs the same number of rows per step; the figure to compare is real
tokens/s (tokens under `input_mask` / `sequence_index > 0`). The ceiling of packing alone is
the padding it removes: ``(1 - padding after) / (1 - padding before)`` at equal cost per row.

Data: instance shard directories from `popbert prepare-data wikipedia ... --no-pack` (or with
packing; only the instances are read), and/or `--bundled` (the corpus shipped in the repo:
short article leads, much padding at 512).

    python benchmarks/packing_throughput.py --instances DIR128 DIR512 --bundled 128 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from step_time import timed  # noqa: E402  (the one timing routine of the benchmarks)

from popbert.builders.bert import build_bert  # noqa: E402
from popbert.builders.bert_config import BertConfig  # noqa: E402
from popbert.config import load_config  # noqa: E402
from popbert.data.hdf5 import read_shard  # noqa: E402
from popbert.data.packing import pack_instance_arrays  # noqa: E402
from popbert.data.pretraining import load_training_data  # noqa: E402
from popbert.lowering.block_attention import BlockDiagonalAttention  # noqa: E402
from popbert.runtime.session import TrainingSession  # noqa: E402

MODELS = {
    "l4": ("L4 H256 A4", dict(hidden_size=256, num_layers=4, num_heads=4,
                             intermediate_size=1024)),
    "base": ("BERT-Base L12 H768 A12", dict()),
}
CONFIGS = ("padded", "packed, dense mask", "packed, per sequence")


def instance_arrays(directory: Path) -> dict[str, np.ndarray]:
    parts = sorted(directory.glob("part-*.h5"))
    if not parts:
        sys.exit(f"packing_throughput: no part-*.h5 in {directory}")
    shards = [read_shard(p, packed=False) for p in parts]
    return {k: np.concatenate([s[k] for s in shards]) for k in shards[0]}


def bundled_arrays(sequence_length: int) -> tuple[dict[str, np.ndarray], int]:
    predictions = max(20, round(sequence_length * 0.15))
    cfg = load_config("tiny", [f"model.sequence_length={sequence_length}",
                               f"model.max_position_embeddings={sequence_length}",
                               f"model.max_predictions_per_seq={predictions}"])
    return load_training_data(cfg), cfg.model.vocab_size


def batches(arrays: dict[str, np.ndarray], rows: int, count: int, seed: int
            ) -> list[dict[str, np.ndarray]]:
    """`count` batches of `rows` rows drawn without replacement (seeded)."""
    order = np.random.default_rng(seed).permutation(len(arrays["input_ids"]))
    if len(order) < rows * count:
        sys.exit(f"packing_throughput: {len(order)} rows, need {rows * count}")
    return [{k: v[order[i * rows:(i + 1) * rows]].astype(np.int64) for k, v in arrays.items()}
            for i in range(count)]


def real_tokens(batch: dict[str, np.ndarray]) -> int:
    real = batch["sequence_index"] if "sequence_index" in batch else batch["input_mask"]
    return int((real > 0).sum())


def session_for(config: BertConfig, threads: int) -> TrainingSession:
    torch.set_num_threads(threads)
    return TrainingSession(build_bert(config, seed=0).model(), "loss",
                           lambda p: torch.optim.AdamW([x for _, x in p], lr=1e-4, foreach=True))


def run_case(name: str, arrays: dict[str, np.ndarray], vocab_size: int,
             args: argparse.Namespace) -> dict:
    seq = arrays["input_ids"].shape[1]
    packed, stats = pack_instance_arrays(arrays, max_sequences_per_pack=args.per_pack)
    rows = max(1, args.batch_tokens // seq)
    label, shape = MODELS[args.model]
    common = dict(**shape, vocab_size=vocab_size, sequence_length=seq,
                  max_position_embeddings=max(512, seq), hidden_dropout=args.dropout,
                  attention_dropout=args.dropout)
    padded_config = BertConfig(**common, max_predictions_per_seq=arrays["masked_lm_ids"].shape[1])
    packed_config = BertConfig(**common, max_predictions_per_seq=packed["masked_lm_ids"].shape[1],
                               packed=True, max_sequences_per_pack=args.per_pack)
    feeds = {"padded": batches(arrays, rows, args.batches, seed=1),
             "packed": batches(packed, rows, args.batches, seed=1)}
    sessions = {"padded": session_for(padded_config, args.threads),
                "packed": session_for(packed_config, args.threads)}
    attention = [m for m in sessions["packed"].module.modules()
                 if isinstance(m, BlockDiagonalAttention)]
    assert attention, "the packed graph's attention was not lowered per sequence"

    def step(config: str, i: int) -> float:
        kind = "padded" if config == "padded" else "packed"
        for m in attention:
            m.varlen = config == "packed, per sequence"
        batch = feeds[kind][i % args.batches]
        return timed(lambda: sessions[kind].run(batch), "cpu")

    for i in range(args.warmup):
        for config in CONFIGS:
            step(config, i)
    times: dict[str, list[float]] = {c: [] for c in CONFIGS}
    for i in range(args.steps):
        for config in CONFIGS:
            times[config].append(step(config, i))
    tokens = {"padded": statistics.mean(real_tokens(b) for b in feeds["padded"]),
              "packed": statistics.mean(real_tokens(b) for b in feeds["packed"])}
    result = {"data": name, "sequence_length": seq, "rows_per_step": rows, "model": label,
              "padding_before": stats.padding_before, "padding_after": stats.padding_after,
              "ceiling": stats.speedup, "sequences_per_row": stats.sequences / stats.packs,
              "configs": {}}
    for config in CONFIGS:
        seconds = statistics.median(times[config])
        real = tokens["padded" if config == "padded" else "packed"]
        result["configs"][config] = {"seconds": seconds, "real_tokens": real,
                                     "tokens_per_s": real / seconds}
    base = result["configs"]["padded"]["tokens_per_s"]
    for config in CONFIGS:
        result["configs"][config]["vs_padded"] = result["configs"][config]["tokens_per_s"] / base
    return result


def print_result(r: dict) -> None:
    print(f"\n{r['data']}, seq {r['sequence_length']}, {r['model']}, {r['rows_per_step']} rows "
          f"per step: padding {r['padding_before']:.1%} → {r['padding_after']:.1%} packed "
          f"({r['sequences_per_row']:.2f} sequences per row; ceiling at equal cost per row "
          f"{r['ceiling']:.2f}x)")
    print("| configuration | s/step | real tokens/step | real tokens/s | vs padded |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for config, c in r["configs"].items():
        print(f"| {config} | {c['seconds']:.3f} | {c['real_tokens']:.0f} | "
              f"{c['tokens_per_s']:.0f} | {c['vs_padded']:.2f} |", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--instances", nargs="*", type=Path, default=[],
                        help="instance shard directories (prepare-data's instances-s*-p*)")
    parser.add_argument("--vocab-size", type=int, default=None,
                        help="the shards' vocabulary size (default: read from the shards)")
    parser.add_argument("--bundled", nargs="*", type=int, default=[],
                        help="sequence lengths at which to use the bundled corpus")
    parser.add_argument("--model", choices=sorted(MODELS), default="l4")
    parser.add_argument("--batch-tokens", type=int, default=4096,
                        help="token slots per step (rows = this / sequence length)")
    parser.add_argument("--per-pack", type=int, default=3, help="max sequences per row")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batches", type=int, default=4, help="distinct batches cycled")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args()
    if not args.instances and not args.bundled:
        parser.error("give --instances DIR... and/or --bundled SEQ...")
    print(f"torch {torch.__version__}, {args.threads} thread(s), dropout {args.dropout}, FP32, "
          f"AdamW; median of {args.steps} interleaved steps after {args.warmup}")
    results = []
    for directory in args.instances:
        arrays = instance_arrays(directory)
        vocab = args.vocab_size or int(max(arrays["input_ids"].max(),
                                           arrays["masked_lm_ids"].max())) + 1
        results.append(run_case(f"{directory.name}", arrays, vocab, args))
        print_result(results[-1])
    for seq in args.bundled:
        arrays, vocab = bundled_arrays(seq)
        results.append(run_case("bundled corpus", arrays, vocab, args))
        print_result(results[-1])
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
