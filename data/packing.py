"""Sequence packing (Krell et al. 2021, "Efficient sequence packing without cross-contamination").

Packing puts several sequences into one row so a step carries more real tokens; the packed model
keeps them apart (`popbert.builders.bert`, `model.packed`). The strategies (`spfhp`, `lpfhp`)
and the packed row layout: docs/design.md, section "popbert.data.packing".
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np

from popbert.data.errors import DataError

log = logging.getLogger(__name__)

PACKED_FEATURE_NAMES = ("position_ids", "sequence_index", "cls_positions")
NSP_IGNORE = -100
STRATEGIES = ("spfhp", "lpfhp")
DEFAULT_MAX_SEQUENCES_PER_PACK = 3

PackShape = tuple[int, ...]


@dataclass
class PackingStats:
    """Before/after figures of one packing run (padding fractions are of all token slots)."""

    sequences: int
    packs: int
    tokens: int
    sequence_length: int

    @property
    def padding_before(self) -> float:
        return 1.0 - self.tokens / max(1, self.sequences * self.sequence_length)

    @property
    def padding_after(self) -> float:
        return 1.0 - self.tokens / max(1, self.packs * self.sequence_length)

    @property
    def speedup(self) -> float:
        """Sequences per row: how many more sequences each step processes."""
        return self.sequences / max(1, self.packs)

    def as_dict(self) -> dict:
        return {"sequences": self.sequences, "packs": self.packs, "tokens": self.tokens,
                "sequence_length": self.sequence_length,
                "padding_before": round(self.padding_before, 6),
                "padding_after": round(self.padding_after, 6),
                "speedup": round(self.speedup, 6)}


def length_histogram(lengths: np.ndarray, sequence_length: int) -> np.ndarray:
    """counts[l] = number of sequences of length l, for l in 0..sequence_length."""
    lengths = np.asarray(lengths, dtype=np.int64)
    if lengths.size and (lengths.min() < 1 or lengths.max() > sequence_length):
        raise DataError(f"sequence lengths must be in [1, {sequence_length}], got "
                        f"[{lengths.min()}, {lengths.max()}]")
    return np.bincount(lengths, minlength=sequence_length + 1)


def histogram_packing(histogram: np.ndarray, sequence_length: int,
                      max_sequences_per_pack: int, strategy: str = "spfhp"
                      ) -> list[tuple[PackShape, int]]:
    """Pack shapes (tuples of lengths, longest first) with their repeat counts.

    Every sequence of the histogram lands in exactly one pack; no pack exceeds
    `sequence_length` tokens or `max_sequences_per_pack` sequences.
    """
    if strategy not in STRATEGIES:
        raise DataError(f"unknown packing strategy {strategy!r}; choose one of "
                        f"{', '.join(STRATEGIES)}")
    if max_sequences_per_pack < 1:
        raise DataError(f"max_sequences_per_pack must be >= 1, got {max_sequences_per_pack}")
    shortest_first = strategy == "spfhp"
    # Open packs by the space they have left: space -> [[count, shape], ...].
    open_packs: dict[int, list[list]] = defaultdict(list)
    closed: list[tuple[PackShape, int]] = []

    def place(shape: PackShape, count: int, space: int) -> None:
        if len(shape) >= max_sequences_per_pack or space == 0:
            closed.append((shape, count))
        else:
            open_packs[space].append([count, shape])

    for length in range(sequence_length, 0, -1):
        remaining = int(histogram[length]) if length < len(histogram) else 0
        while remaining > 0:
            fits = [s for s, packs in open_packs.items() if s >= length and packs]
            if not fits:
                place((length,), remaining, sequence_length - length)
                break
            space = max(fits) if shortest_first else min(fits)
            count, shape = open_packs[space].pop()
            if not open_packs[space]:
                del open_packs[space]
            take = min(count, remaining)
            if count > take:
                open_packs[space].append([count - take, shape])
            remaining -= take
            place((*shape, length), take, space - length)
    for packs in open_packs.values():
        closed.extend((shape, count) for count, shape in packs)
    return closed


def deal_sequences(lengths: np.ndarray, shapes: list[tuple[PackShape, int]],
                   rng: np.random.Generator) -> list[list[int]]:
    """Sequence indices per pack: each shape's lengths filled with random sequences of that
    length; packs come back in random order."""
    lengths = np.asarray(lengths)
    queues: dict[int, list[int]] = {}
    for length in np.unique(lengths):
        members = np.nonzero(lengths == length)[0]
        queues[int(length)] = rng.permutation(members).tolist()
    packs: list[list[int]] = []
    for shape, count in shapes:
        for _ in range(count):
            packs.append([queues[length].pop() for length in shape])
    if any(queues.values()):
        raise DataError("internal error: packing left sequences unassigned")
    order = rng.permutation(len(packs))
    return [packs[i] for i in order]


def default_max_predictions_per_pack(sequence_length: int, max_predictions_per_seq: int,
                                     max_sequences_per_pack: int,
                                     masked_lm_prob: float | None) -> int:
    """MLM slots a pack can need: each sequence predicts min(P, max(1, round(len * prob)))
    tokens, so a pack of total length <= S predicts at most S * prob + k (rounding and the
    minimum of one add < 1 each); without a known prob, k * P."""
    bound = max_sequences_per_pack * max_predictions_per_seq
    if masked_lm_prob is not None:
        bound = min(bound, math.floor(sequence_length * masked_lm_prob) + max_sequences_per_pack)
    return max(max_predictions_per_seq, min(bound, sequence_length))


def pack_arrays(arrays: Mapping[str, np.ndarray], packs: list[list[int]],
                max_sequences_per_pack: int, max_predictions_per_pack: int
                ) -> dict[str, np.ndarray]:
    """Build packed rows (layout in the module docstring) from unpacked NVIDIA-layout arrays."""
    ids = np.asarray(arrays["input_ids"])
    n_src, seq = ids.shape
    lengths = np.asarray(arrays["input_mask"]).astype(bool).sum(axis=1)
    labels = np.asarray(arrays["masked_lm_ids"])
    positions = np.asarray(arrays["masked_lm_positions"])
    nsp = np.asarray(arrays["next_sentence_labels"]).reshape(-1)
    n = len(packs)
    k_max = max_sequences_per_pack
    out = {
        "input_ids": np.zeros((n, seq), np.int32),
        "input_mask": np.zeros((n, seq), np.int32),
        "segment_ids": np.zeros((n, seq), np.int32),
        "position_ids": np.zeros((n, seq), np.int32),
        "sequence_index": np.zeros((n, seq), np.int32),
        "masked_lm_positions": np.zeros((n, max_predictions_per_pack), np.int32),
        "masked_lm_ids": np.zeros((n, max_predictions_per_pack), np.int32),
        "next_sentence_labels": np.full((n, k_max), NSP_IGNORE, np.int32),
        "cls_positions": np.zeros((n, k_max), np.int32),
    }
    if any(len(p) > k_max for p in packs):
        raise DataError(f"a pack has more than max_sequences_per_pack={k_max} sequences")
    # slot_seq[p, j]: source row of the j-th sequence of pack p (-1: empty slot).
    slot_seq = np.full((n, k_max), -1, np.int64)
    for p, members in enumerate(packs):
        slot_seq[p, : len(members)] = members
    slot_len = np.where(slot_seq >= 0, lengths[np.maximum(slot_seq, 0)], 0)
    slot_off = np.cumsum(slot_len, axis=1) - slot_len
    if n and int((slot_off[:, -1] + slot_len[:, -1]).max()) > seq:
        raise DataError(f"a pack holds more than sequence_length={seq} tokens")
    n_pred = (labels != 0).sum(axis=1)
    pred_count = np.where(slot_seq >= 0, n_pred[np.maximum(slot_seq, 0)], 0)
    if n and int(pred_count.sum(axis=1).max()) > max_predictions_per_pack:
        raise DataError(f"a pack needs {int(pred_count.sum(axis=1).max())} MLM slots, more than "
                        f"max_predictions_per_pack={max_predictions_per_pack}")
    pred_off = np.cumsum(pred_count, axis=1) - pred_count
    columns = np.arange(seq)
    pred_columns = np.arange(labels.shape[1])
    if np.any((labels != 0) & (pred_columns[None, :] >= n_pred[:, None])):
        raise DataError("masked_lm_ids has a gap (a used slot after an unused one); "
                        "cannot pack these samples")
    for j in range(k_max):
        rows = np.nonzero(slot_seq[:, j] >= 0)[0]
        if not len(rows):
            continue
        src = slot_seq[rows, j]
        off = slot_off[rows, j]
        # Tokens: every (row, t) with t < length, scattered to column offset + t.
        r, t = np.nonzero(columns[None, :] < lengths[src][:, None])
        dst_r, dst_c, src_r = rows[r], off[r] + t, src[r]
        out["input_ids"][dst_r, dst_c] = ids[src_r, t]
        out["segment_ids"][dst_r, dst_c] = arrays["segment_ids"][src_r, t]
        out["input_mask"][dst_r, dst_c] = 1
        out["position_ids"][dst_r, dst_c] = t
        out["sequence_index"][dst_r, dst_c] = j + 1
        # MLM targets: the used slots (labels != 0), shifted by the sequence's offset.
        r, q = np.nonzero(pred_columns[None, :] < n_pred[src][:, None])
        dst_r, src_r = rows[r], src[r]
        dst_q = pred_off[rows, j][r] + q
        out["masked_lm_positions"][dst_r, dst_q] = positions[src_r, q] + off[r]
        out["masked_lm_ids"][dst_r, dst_q] = labels[src_r, q]
        out["next_sentence_labels"][rows, j] = nsp[src]
        out["cls_positions"][rows, j] = off
    return out


def pack_instance_arrays(arrays: Mapping[str, np.ndarray], *, strategy: str = "spfhp",
                         max_sequences_per_pack: int = DEFAULT_MAX_SEQUENCES_PER_PACK,
                         max_predictions_per_pack: int | None = None,
                         masked_lm_prob: float | None = 0.15, seed: int = 0
                         ) -> tuple[dict[str, np.ndarray], PackingStats]:
    """Unpacked arrays → packed arrays and their statistics, in one seeded call."""
    ids = np.asarray(arrays["input_ids"])
    seq = ids.shape[1]
    lengths = np.asarray(arrays["input_mask"]).astype(bool).sum(axis=1)
    if max_predictions_per_pack is None:
        max_predictions_per_pack = default_max_predictions_per_pack(
            seq, np.asarray(arrays["masked_lm_ids"]).shape[1], max_sequences_per_pack,
            masked_lm_prob)
    shapes = histogram_packing(length_histogram(lengths, seq), seq, max_sequences_per_pack,
                               strategy)
    packs = deal_sequences(lengths, shapes, np.random.default_rng(seed))
    packed = pack_arrays(arrays, packs, max_sequences_per_pack, max_predictions_per_pack)
    stats = PackingStats(sequences=len(lengths), packs=len(packs), tokens=int(lengths.sum()),
                         sequence_length=seq)
    return packed, stats
