"""What a word-embedding gradient costs on CPU when a micro-batch runs as length groups: the dense
backward (a zero-filled 47 MB table per group, then added into `.grad`) against row-by-row
accumulation (`popbert.lowering.embedding`).

1. The op alone: all-MiniLM-L6-v2's 30,522 × 384 table, one micro-batch of 32 topic leads
   (`benchmarks/data/topic-train.jsonl`, 128 tokens, the bundled vocabulary) cut into the
   groups `popbert.runtime.groups.length_groups` chooses; per group the lookup and its
   backward into `.grad`, upstream gradients random. Both ways interleaved, minimum of
   `--repeats`.
2. Whole training steps of a MiniLM-shaped classifier with that vocabulary (L6 H384, 12 heads,
   FFN 1536, dropout 0.1), micro-batch 32, trimmed and grouped as `popbert finetune` runs them,
   AdamW: each batch run with dense gradients and with row accumulation (who goes first
   alternates), so the ratio is the embedding gradient's share.

    python benchmarks/embedding_grad.py --threads 2
"""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import popbert.lowering.embedding as embedding

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dropout import (  # noqa: E402 (the same rows, step harness and command line)
    alternating_steps,
    minilm_rows,
    run_a_against_b,
)

from popbert.runtime.groups import length_groups, text_lengths  # noqa: E402

VOCAB, HIDDEN = 30522, 384  # all-MiniLM-L6-v2


def op_alone(repeats: int) -> dict:
    """Lookup + backward of every group of one micro-batch, dense against row accumulation."""
    _, rows = minilm_rows(32)
    ids, mask = torch.from_numpy(rows["input_ids"]), torch.from_numpy(rows["input_mask"])
    lengths = text_lengths(mask)
    cut = [ids[g, :int(lengths[g].max())] for g in length_groups(lengths)]
    groups = [(g, torch.randn(*g.shape, HIDDEN)) for g in cut]
    table = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN) * 0.02)
    ways = {"dense": lambda i: F.embedding(i, table),
            "rows": lambda i: embedding.embedding(i, table)}
    times: dict[str, list[float]] = {k: [] for k in ways}
    for _ in range(repeats + 2):
        for kind, lookup in ways.items():
            table.grad = None
            start = time.perf_counter()
            for group, upstream in groups:
                lookup(group).backward(upstream)
            times[kind].append(time.perf_counter() - start)
    best = {k: min(v[2:]) * 1e3 for k, v in times.items()}
    print(f"| word-embedding gradient of one micro-batch in {len(groups)} groups | "
          f"{best['dense']:.1f} | {best['rows']:.1f} | {best['dense'] / best['rows']:.1f}× |",
          flush=True)
    return {"groups": len(groups), **{f"{k}_ms": v for k, v in best.items()}}


def whole_steps(steps: int, warmup: int) -> dict:
    config, rows = minilm_rows((steps + warmup) * 32)
    config = dataclasses.replace(config, vocab_size=VOCAB)

    def rows_on(on: bool) -> None:
        embedding.SPARSE = on

    mean = alternating_steps(config, rows, rows_on, steps, warmup)
    return {"dense_ms": mean[False], "rows_ms": mean[True], "steps": steps}


def main() -> None:
    run_a_against_b(__doc__.split("\n\n")[0], "dense gradient", "row accumulation", op_alone,
                    whole_steps)


if __name__ == "__main__":
    main()
