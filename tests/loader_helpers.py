"""What the data tests read of a `PretrainingLoader` besides its batches."""

from __future__ import annotations

import numpy as np

from popbert.data.loader import PretrainingLoader


def epoch_order(loader: PretrainingLoader, epoch: int) -> np.ndarray:
    """Global sample ids of an epoch, in order (a pure function of seed and epoch)."""
    shards, rows = loader._locate(epoch, np.arange(loader.samples_per_epoch))
    return loader.starts[shards] + rows
