"""Rows run longest first, each batch cut to its longest row: inference without the padding.

Both inference paths use it: the torch graph scoring a fine-tuned model's evaluation file
(`popbert.train.finetune.infer`) and the exports `popbert predict` runs (`popbert.serve.predict`),
so a task's rows are batched, cut and put back in order in one place. NumPy only: the
torch-free predictors import it.

Cutting a batch to its longest row leaves every row's outputs as they were (attention never
reads a masked position), except the per-token outputs at the masked positions themselves,
which were never a row's own: those are padded back with the value the task names
(`popbert.tasks.task.Task.per_token_outputs`), so no row's outputs depend on the rows batched
with it.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

import numpy as np

RunBatch = Callable[[dict[str, np.ndarray]], Mapping[str, np.ndarray]]


@dataclass
class BucketedRun:
    """What `run_by_length` did: its runs, the row positions computed (padding included) and the
    seconds spent inside `run_batch`."""

    batches: int = 0
    computed: int = 0
    seconds: float = 0.0


def length_order(input_mask: np.ndarray) -> np.ndarray:
    """Row indices longest first (by `input_mask`), ties in input order."""
    return np.argsort(-np.asarray(input_mask).sum(axis=1), kind="stable")


def pad_positions(value: np.ndarray, full: int, fill: float, axis: int = 1) -> np.ndarray:
    """A per-token output cut to its batch's width, padded back to `full` positions along
    `axis` with `fill` (what a masked position holds)."""
    if value.shape[axis] >= full:
        return value
    pad = [(0, 0)] * value.ndim
    pad[axis] = (0, full - value.shape[axis])
    return np.pad(value, pad, constant_values=fill)


def run_by_length(run_batch: RunBatch, arrays: Mapping[str, np.ndarray], batch_size: int, *,
                  inputs: Collection[str], per_token: Mapping[str, float] | None = None,
                  bucket: bool = True, cut: bool = True, fixed_batch: int | None = None,
                  desc: str = "predict") -> tuple[dict[str, np.ndarray], BucketedRun]:
    """Every output of `run_batch` for the rows of `arrays` ([N, S] each, `input_mask` among
    them), `batch_size` rows per run, in the rows' order.

    `bucket`: rows run longest first (else in input order); `cut`: each batch is cut to its
    longest row (a model with a fixed sequence axis runs every row at S); `fixed_batch`: a model
    with a fixed batch gets that many rows each run, the last run filled with copies of its last
    row. The outputs named in `per_token` ([N, S, ...]) are padded back to S and hold the value
    given at every masked position. Only the arrays named in `inputs` are fed. A progress bar
    (`desc`) shows when there is more than one run.
    """
    from tqdm import tqdm

    rows = len(arrays["input_mask"])
    mask = np.asarray(arrays["input_mask"])
    lengths = mask.sum(axis=1)
    order = length_order(mask) if bucket else np.arange(rows)
    full = mask.shape[1]
    per_token = per_token or {}
    step = fixed_batch or batch_size
    parts: dict[str, list[np.ndarray]] = {}
    done = BucketedRun()
    for first in tqdm(range(0, rows, step), desc=desc, unit="batch",
                      total=math.ceil(rows / step), disable=rows <= step, dynamic_ncols=True):
        chosen = order[first:first + step]
        real = len(chosen)
        if fixed_batch is not None:
            chosen = np.concatenate([chosen, np.repeat(chosen[-1:], fixed_batch - real)])
        width = max(1, int(lengths[chosen].max())) if cut else full
        feeds = {name: np.ascontiguousarray(np.asarray(value)[chosen, :width])
                 for name, value in arrays.items() if name in inputs}
        started = time.perf_counter()
        outputs = run_batch(feeds)
        done.seconds += time.perf_counter() - started
        done.batches += 1
        done.computed += len(chosen) * width
        for name, value in outputs.items():
            value = np.asarray(value, np.float32)[:real]
            if name in per_token:
                value = pad_positions(value, full, per_token[name])
            parts.setdefault(name, []).append(value)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(rows)
    result = {name: np.concatenate(values)[inverse] for name, values in parts.items()}
    masked = mask == 0
    for name, fill in per_token.items():
        if name in result:
            result[name][masked] = fill
    return result, done


__all__ = ["BucketedRun", "RunBatch", "length_order", "pad_positions", "run_by_length"]
