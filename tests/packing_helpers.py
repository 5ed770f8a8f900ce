"""Packed-batch helpers shared by the packed-model tests (BERT, GroupBERT, block attention):
short unpacked rows to pack, where each source row landed, one sequence's labels of a pack."""

from __future__ import annotations

import numpy as np

from popbert.data.packing import NSP_IGNORE

K = 3


def sequences(config, count: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Unpacked NVIDIA-layout rows of short real lengths, so several fit in one row."""
    rng = np.random.default_rng(seed)
    seq, preds = config.sequence_length, config.max_predictions_per_seq
    a = {"input_ids": np.zeros((count, seq), np.int64),
         "input_mask": np.zeros((count, seq), np.int64),
         "segment_ids": np.zeros((count, seq), np.int64),
         "masked_lm_positions": np.zeros((count, preds), np.int64),
         "masked_lm_ids": np.zeros((count, preds), np.int64),
         "next_sentence_labels": rng.integers(0, 2, count)}
    for row in range(count):
        length = int(rng.integers(5, seq // 2))
        a["input_ids"][row, :length] = rng.integers(5, config.vocab_size, length)
        a["input_ids"][row, 0] = 2
        a["input_mask"][row, :length] = 1
        a["segment_ids"][row, length // 2:length] = 1
        npred = int(rng.integers(1, min(preds, length - 1) + 1))
        chosen = np.sort(rng.choice(np.arange(1, length), npred, replace=False))
        a["masked_lm_positions"][row, :npred] = chosen
        a["masked_lm_ids"][row, :npred] = rng.integers(5, config.vocab_size, npred)
    return a


def match_rows(unpacked, packed) -> dict[int, tuple[int, int]]:
    """Source row -> (pack row, slot), by comparing token content."""
    result = {}
    for src in range(len(unpacked["input_ids"])):
        length = int(unpacked["input_mask"][src].sum())
        tokens = unpacked["input_ids"][src, :length]
        for row in range(len(packed["input_ids"])):
            for slot in range(K):
                where = np.nonzero(packed["sequence_index"][row] == slot + 1)[0]
                if len(where) == length and np.array_equal(packed["input_ids"][row, where],
                                                           tokens):
                    result[src] = (row, slot)
    assert len(result) == len(unpacked["input_ids"])
    return result


def only_sequence(packed, row: int, slot: int) -> dict[str, np.ndarray]:
    """The packed batch with every label but one sequence's ignored."""
    b = {k: v.copy() for k, v in packed.items()}
    keep_nsp = np.full_like(b["next_sentence_labels"], NSP_IGNORE)
    keep_nsp[row, slot] = packed["next_sentence_labels"][row, slot]
    b["next_sentence_labels"] = keep_nsp
    start = packed["cls_positions"][row, slot]
    own = packed["sequence_index"][row][packed["masked_lm_positions"][row]] == slot + 1
    ids = np.zeros_like(b["masked_lm_ids"])
    ids[row] = np.where(own & (packed["masked_lm_ids"][row] != 0), packed["masked_lm_ids"][row], 0)
    b["masked_lm_ids"] = ids
    assert start >= 0
    return b
