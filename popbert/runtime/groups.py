"""A micro-batch run as groups of texts of similar length, each group cut to its own longest,
so the padding between short and long texts of one batch is not computed either.

`execution.trim_padding` cuts a micro-batch to its longest row; one long row still pads every
short one to its length. `length_groups` splits the texts, sorted by length, into the runs
that cost least (tokens computed plus a fixed cost per call), and the session runs the graph
once per run:

- a graph whose loss is a mean over rows, or over the labelled tokens (the graph says which:
  `popbert.graph.annotations.loss_mean`), runs whole per group: each group's loss weighted by
  its share of those rows or tokens, so the gradients are those of the whole micro-batch
  (`RowGroups`);
- an embedding graph runs its encoder per group of texts, and the loss once over all the
  vectors (`popbert.runtime.texts`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import torch

from popbert.graph.annotations import LossMean
from popbert.runtime.inputs import TRIM_MULTIPLE, trimmed_width

#: What one more call of the graph costs, in tokens of work: a group is split off only when the
#: padding it saves is more than this. Measured on all-MiniLM-L6-v2's encoder, forward and
#: backward of 64 real texts (6 to 109 tokens) on 2 CPU threads: 16, 64, 128 and 256 gave
#: 1.9, 1.7, 1.8 and 2.0 s a micro-batch (one group of all: 7.0 s).
CALL_COST_TOKENS = 64

__all__ = ["CALL_COST_TOKENS", "RowGroups", "length_groups", "text_lengths"]


def text_lengths(mask: torch.Tensor) -> np.ndarray:
    """One past the last real token of each row of `mask` [..., S] (flattened to rows): what
    a row needs of the sequence axis, gaps in the mask included."""
    flat = torch.as_tensor(mask).reshape(-1, mask.shape[-1]).ne(0)
    positions = torch.arange(1, flat.shape[-1] + 1).expand_as(flat)
    return (positions * flat).amax(dim=1).numpy()


def length_groups(lengths: Sequence[int] | np.ndarray, call_cost: int | None = None,
                  multiple: int = TRIM_MULTIPLE) -> list[np.ndarray]:
    """The indices of `lengths`, sorted by length and split into runs that each go through the
    graph as one call padded to its longest (rounded up to `multiple`), choosing the runs that
    minimise the tokens computed plus `call_cost` per call (exact: dynamic programming over
    the sorted lengths). `call_cost` None: `CALL_COST_TOKENS`."""
    call_cost = CALL_COST_TOKENS if call_cost is None else call_cost
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    widths = -(-np.maximum(lengths[order], 1) // multiple) * multiple
    count = len(order)
    best = np.zeros(count + 1)  # best[j]: the least cost of the first j sorted texts
    start = np.zeros(count + 1, dtype=np.int64)  # where the last run of that cost starts
    for end in range(1, count + 1):
        costs = best[:end] + (end - np.arange(end)) * widths[end - 1] + call_cost
        start[end] = int(np.argmin(costs))
        best[end] = costs[start[end]]
    runs, end = [], count
    while end > 0:
        runs.append(order[start[end]:end])
        end = int(start[end])
    return runs[::-1]


class RowGroups:
    """Forward and backward of one micro-batch, group by group, for a graph whose loss (and
    every scalar output) is a mean over `mean`'s units: the gradients and the scalar outputs
    of the whole micro-batch."""

    def __init__(self, mean: LossMean, sequence_inputs: Sequence[str], mask: str = "input_mask"):
        self.mean, self.sequence_inputs, self.mask = mean, list(sequence_inputs), mask

    def _units(self, micro: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """How many of the loss's units each row holds: 1, or its labelled tokens."""
        if self.mean.input is None:
            return torch.ones(micro[self.mask].shape[0])
        labels = torch.as_tensor(micro[self.mean.input])
        return labels.ne(self.mean.ignore).reshape(labels.shape[0], -1).sum(dim=1).float()

    def _part(self, micro: Mapping[str, torch.Tensor], index: torch.Tensor
              ) -> dict[str, torch.Tensor]:
        """The rows `index` of `micro`, cut to their longest."""
        width = trimmed_width(micro[self.mask][index])
        return {name: value[index][..., :width] if name in self.sequence_inputs
                else value[index] for name, value in micro.items()}

    def step(self, micro: Mapping[str, torch.Tensor],
             forward: Callable[[Mapping[str, torch.Tensor]], dict[str, torch.Tensor]],
             loss_name: str, weight: float) -> dict[str, torch.Tensor]:
        """Back-propagate `weight` x the micro-batch's loss; returns its scalar outputs."""
        units = self._units(micro)
        total = float(units.sum())
        groups = length_groups(text_lengths(micro[self.mask]))
        if len(groups) == 1 or total == 0:  # nothing to split (or nothing scored at all)
            parts: Iterable[tuple[Mapping[str, torch.Tensor], float]] = [(micro, 1.0)]
        else:  # each group cut as its turn comes
            parts = ((self._part(micro, torch.from_numpy(group)), share) for group in groups
                     if (share := float(units[torch.from_numpy(group)].sum()) / total) > 0)
        sums: dict[str, torch.Tensor] = {}
        for part, share in parts:  # a group with no scored unit adds nothing to the mean
            outputs = forward(part)
            (outputs[loss_name].float() * (weight * share)).backward()
            for name, value in outputs.items():
                if value is not None and value.dim() == 0:
                    value = value.detach().float() * share
                    sums[name] = sums[name] + value if name in sums else value
        return sums
