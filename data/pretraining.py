"""The main job's data: the run config's corpus or shards → checked arrays → a resumable loader."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from popbert.data.loader import PretrainingLoader, load_or_create_instances
from popbert.data.tokenization import WordPieceTokenizer, bundled_vocab_path
from popbert.errors import ConfigError

if TYPE_CHECKING:
    from popbert.config import RunConfig


def load_training_data(cfg: RunConfig) -> dict[str, np.ndarray]:
    """Pre-training instances for the config's corpus, checked against the model's shapes."""
    vocab_path = Path(cfg.data.vocab_file) if cfg.data.vocab_file else bundled_vocab_path()
    if not vocab_path.is_file():
        raise ConfigError(f"data.vocab_file: {vocab_path} does not exist")
    vocab_size = WordPieceTokenizer(vocab_path).vocab_size
    if vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size is {cfg.model.vocab_size} but the vocabulary "
                          f"{vocab_path} has {vocab_size} entries")
    return load_or_create_instances(
        cfg.data.input_files or None, vocab_path, cfg.model.sequence_length,
        cfg.model.max_predictions_per_seq, cfg.data.seed,
        dupe_factor=cfg.data.duplication_factor, masked_lm_prob=cfg.data.masked_lm_prob,
        short_seq_prob=cfg.data.short_seq_prob, whole_word_mask=cfg.data.whole_word_masking)


def make_loader(cfg: RunConfig, arrays: dict[str, np.ndarray], replica_index: int = 0,
                num_replicas: int = 1) -> PretrainingLoader:
    """Micro-batches of `execution.micro_batch_size` for one replica, seeded by `data.seed`."""
    return PretrainingLoader(arrays, cfg.execution.micro_batch_size, seed=cfg.data.seed,
                             shuffle=cfg.data.shuffle, replica_index=replica_index,
                             num_replicas=num_replicas)
