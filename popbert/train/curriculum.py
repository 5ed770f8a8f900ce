"""The sequence-length curriculum (`training.sequence_curriculum`): short rows early in a run,
full rows at its end, in one run (BERT's phase 1 -> 2, laid over the steps or the time budget).

Each full row of contiguous text is cut into rows of the stage's length, so a step carries the
same tokens in more, shorter rows (attention costs `S²` per row: shorter rows make it cheaper),
and the pieces are masked anew at the run's masking rate. Validation always runs on full rows,
so curves stay comparable across stages.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
import torch

from popbert.config import RunConfig
from popbert.data.instances import InstanceOptions, cut_chunk_rows, mask_arrays, unmask_rows
from popbert.data.pretraining import run_tokenizer

__all__ = ["SequenceCurriculum"]


class SequenceCurriculum:
    """Turns a run's batch of full rows into the rows of the stage its progress is in."""

    def __init__(self, cfg: RunConfig, rank: int = 0):
        self.stages = [(float(until), int(length))
                       for until, length in cfg.training.sequence_curriculum]
        self.full = cfg.model.sequence_length
        self.predictions = cfg.model.max_predictions_per_seq
        self.tokenizer = run_tokenizer(cfg)
        self.seed = (cfg.data.seed, rank)
        self.masked_lm_prob = cfg.data.masked_lm_prob
        self.whole_word_mask = cfg.data.whole_word_masking

    def length_at(self, progress: float) -> int:
        """The row length at `progress` (the fraction of the run done, 0 to 1)."""
        for until, length in self.stages:
            if progress < until:
                return length
        return self.full

    def slots(self, length: int) -> int:
        """Prediction slots of a row of `length`: the run's, scaled (25% of 128 in 32 slots
        is 25% of 64 in 16)."""
        return max(1, math.ceil(self.predictions * length / self.full))

    def __call__(self, batch: Mapping[str, torch.Tensor], progress: float, step: int
                 ) -> dict[str, torch.Tensor]:
        """`batch` (full rows, masked) as this stage's rows, masked anew (seeded by the data
        seed, the replica and `step`, so a resumed run cuts and masks the same)."""
        length = self.length_at(progress)
        if length >= self.full:
            return dict(batch)
        arrays = {k: v.numpy().copy() for k, v in batch.items()}
        unmask_rows(arrays)
        slots = self.slots(length)
        cut = cut_chunk_rows(arrays, length, slots, self.tokenizer.cls_id,
                             self.tokenizer.sep_id)
        options = InstanceOptions(sequence_length=length, max_predictions_per_seq=slots,
                                  masked_lm_prob=self.masked_lm_prob,
                                  whole_word_mask=self.whole_word_mask)
        mask_arrays(cut, self.tokenizer, options, np.random.default_rng([*self.seed, step]))
        return {k: torch.from_numpy(v) for k, v in cut.items()}
