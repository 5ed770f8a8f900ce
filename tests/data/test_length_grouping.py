"""`length_grouped_order` (`finetune.group_by_length`): the same rows, in batches of similar
length, still shuffled, and the same order again for the same seed (resume)."""

from __future__ import annotations

import numpy as np

from popbert.data.loader import length_grouped_order
from popbert.train.finetune import EpochBatches


def lengths_and_order(n: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(10, 129, n), rng.permutation(n)


def test_the_same_rows_in_batches_of_similar_length():
    lengths, order = lengths_and_order()
    grouped = length_grouped_order(order, lengths, 32, np.random.default_rng(1))
    assert sorted(grouped.tolist()) == list(range(1000))
    widths = [lengths[grouped[i:i + 32]].max() for i in range(0, 1000, 32)]
    spreads = [np.ptp(lengths[grouped[i:i + 32]]) for i in range(0, 992, 32)]
    random_widths = [lengths[order[i:i + 32]].max() for i in range(0, 1000, 32)]
    assert np.mean(widths) < 0.75 * np.mean(random_widths)  # measured: 80 vs 126
    assert max(spreads) <= 10  # a pool of 50 batches sorted: neighbours in length
    # The batches are shuffled, not longest-first.
    assert not all(a >= b for a, b in zip(widths, widths[1:]))


def test_grouped_epochs_are_seeded_and_resumable():
    lengths, _ = lengths_and_order(200)
    mask = (np.arange(128)[None] < lengths[:, None]).astype(np.int64)
    arrays = {"input_mask": mask, "row": np.arange(200)}

    def rows(loader):
        return [b["row"].tolist() for b in loader]

    first = rows(EpochBatches(arrays, 16, 2, seed=3, group_by_length=True))
    assert first == rows(EpochBatches(arrays, 16, 2, seed=3, group_by_length=True))
    assert first != rows(EpochBatches(arrays, 16, 2, seed=3))
    resumed = EpochBatches(arrays, 16, 2, seed=3, group_by_length=True)
    resumed.load_state_dict({"position": 5, "num_samples": 200})
    assert rows(resumed) == first[5:]
