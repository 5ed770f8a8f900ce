"""The resumable pre-training loader and the cached bundled-corpus instances.

`PretrainingLoader` is an endless iterator of micro batches. Each epoch is a fixed function of
(seed, epoch): a permutation seeded with `seed + epoch`, cut into global batches of
`micro_batch_size * num_replicas` samples, of which replica r takes the r-th slice. The whole
position is (epoch, samples consumed in the epoch), so a checkpoint restores it exactly and a
resumed run sees the batches an uninterrupted run would have seen.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from popbert.data.corpus import PathsLike, expand_input_files, read_documents
from popbert.data.errors import DataError
from popbert.data.hdf5 import SCHEMA_VERSION, read_shard, write_shard
from popbert.data.instances import FEATURE_NAMES, InstanceOptions, create_pretraining_arrays
from popbert.data.tokenization import (
    WordPieceTokenizer,
    bundled_corpus_path,
    bundled_vocab_path,
    file_sha256,
)

log = logging.getLogger(__name__)

# Bump when instance creation changes its output for the same inputs: invalidates caches.
INSTANCES_ALGORITHM_VERSION = 2


def _load_sources(arrays_or_shards: Mapping[str, np.ndarray] | PathsLike,
                  checks: dict) -> dict[str, np.ndarray]:
    if isinstance(arrays_or_shards, Mapping):
        missing = [k for k in FEATURE_NAMES if k not in arrays_or_shards]
        if missing:
            raise DataError(f"arrays lack {', '.join(missing)}")
        arrays = {k: np.asarray(arrays_or_shards[k]) for k in FEATURE_NAMES}
        arrays["next_sentence_labels"] = arrays["next_sentence_labels"].reshape(-1)
        return arrays
    parts = [read_shard(p, **checks) for p in expand_input_files(arrays_or_shards)]
    if len(parts) == 1:
        return parts[0]
    shapes = {(p["input_ids"].shape[1], p["masked_lm_positions"].shape[1]) for p in parts}
    if len(shapes) > 1:
        raise DataError(f"shards disagree on (sequence_length, max_predictions): {sorted(shapes)}")
    return {k: np.concatenate([p[k] for p in parts]) for k in FEATURE_NAMES}


class PretrainingLoader:
    """Endless, seeded, replica-sharded, resumable micro batches of pre-training samples.

    `arrays_or_shards`: a dict of the six NVIDIA-layout arrays, or shard path(s) / glob(s)
    (read into memory, in sorted order, checked against the optional expectations).
    With `drop_last` an epoch has `num_samples // (micro_batch_size * num_replicas)` steps;
    without, the last global batch is completed by wrapping to the epoch's start, so every
    replica always gets a full batch (collectives stay in step) and every sample is seen.
    Batches are dicts of int64 torch tensors (numpy arrays with `as_numpy=True`).
    """

    def __init__(self, arrays_or_shards: Mapping[str, np.ndarray] | PathsLike,
                 micro_batch_size: int, seed: int, shuffle: bool = True, replica_index: int = 0,
                 num_replicas: int = 1, drop_last: bool = True, *,
                 sequence_length: int | None = None, max_predictions_per_seq: int | None = None,
                 vocab_size: int | None = None, vocab_sha256: str | None = None,
                 as_numpy: bool = False):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if num_replicas < 1 or not 0 <= replica_index < num_replicas:
            raise ValueError(f"replica_index {replica_index} not in [0, {num_replicas})")
        checks = {"sequence_length": sequence_length,
                  "max_predictions_per_seq": max_predictions_per_seq,
                  "vocab_size": vocab_size, "vocab_sha256": vocab_sha256}
        self.arrays = _load_sources(arrays_or_shards, checks)
        self.num_samples = int(self.arrays["input_ids"].shape[0])
        self.micro_batch_size = int(micro_batch_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.replica_index = int(replica_index)
        self.num_replicas = int(num_replicas)
        self.drop_last = drop_last
        self.as_numpy = as_numpy
        self.global_batch_size = self.micro_batch_size * self.num_replicas
        if self.num_samples == 0:
            raise DataError("no pre-training samples to load")
        if drop_last and self.num_samples < self.global_batch_size:
            raise DataError(f"{self.num_samples} samples are fewer than one global batch "
                            f"({self.micro_batch_size} x {self.num_replicas} replicas)")
        self.epoch = 0
        self.index = 0
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Micro batches each replica gets per epoch."""
        if self.drop_last:
            return self.num_samples // self.global_batch_size
        return -(-self.num_samples // self.global_batch_size)

    @property
    def samples_per_epoch(self) -> int:
        """Samples consumed across all replicas in one epoch (padding included)."""
        return self.steps_per_epoch * self.global_batch_size

    def epoch_order(self, epoch: int) -> np.ndarray:
        """Sample indices of an epoch, in global order (a pure function of seed and epoch)."""
        if self._order_epoch != epoch:
            if self.shuffle:
                order = np.random.default_rng(self.seed + epoch).permutation(self.num_samples)
            else:
                order = np.arange(self.num_samples)
            short = self.samples_per_epoch - len(order)
            if short > 0:
                order = np.concatenate([order, np.resize(order, short)])
            self._order, self._order_epoch = order[: self.samples_per_epoch], epoch
        return self._order

    def __iter__(self) -> PretrainingLoader:
        return self

    def __next__(self) -> dict:
        if self.index + self.global_batch_size > self.samples_per_epoch:
            self.epoch += 1
            self.index = 0
        order = self.epoch_order(self.epoch)
        start = self.index + self.replica_index * self.micro_batch_size
        indices = order[start:start + self.micro_batch_size]
        self.index += self.global_batch_size
        batch = {k: self.arrays[k][indices].astype(np.int64) for k in FEATURE_NAMES}
        if self.as_numpy:
            return batch
        return {k: torch.from_numpy(v) for k, v in batch.items()}

    def state_dict(self) -> dict:
        """Position to checkpoint: epoch, samples consumed in it (all replicas), data size."""
        return {"epoch": self.epoch, "index": self.index, "num_samples": self.num_samples}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from a `state_dict()`; refuses a position taken on different data."""
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"loader state {dict(state)!r} lacks integer epoch/index") from exc
        if "num_samples" in state and int(state["num_samples"]) != self.num_samples:
            raise DataError(f"loader state was saved on {state['num_samples']} samples, "
                            f"this data has {self.num_samples}")
        if epoch < 0 or not 0 <= index <= self.samples_per_epoch:
            raise DataError(f"loader state epoch={epoch} index={index} is out of range "
                            f"(epoch has {self.samples_per_epoch} samples)")
        self.epoch, self.index = epoch, index


def default_cache_dir() -> Path:
    """`$POPBERT_CACHE_DIR`, else `$XDG_CACHE_HOME/popbert`, else `~/.cache/popbert`."""
    if os.environ.get("POPBERT_CACHE_DIR"):
        return Path(os.environ["POPBERT_CACHE_DIR"])
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "popbert"


def load_or_create_instances(input_files: PathsLike | None, vocab_path: str | os.PathLike | None,
                             sequence_length: int, max_predictions_per_seq: int, seed: int,
                             cache_dir: str | os.PathLike | None = None, *,
                             dupe_factor: int = 1, masked_lm_prob: float = 0.15,
                             short_seq_prob: float = 0.1, whole_word_mask: bool = False,
                             use_cache: bool = True) -> dict[str, np.ndarray]:
    """Pre-training arrays for Google-format text files, created once and cached as a shard.

    `input_files=None` / `vocab_path=None` mean the bundled corpus / vocabulary. The cache key
    hashes the input files' and vocabulary's contents and every creation parameter, so a
    stale cache is never used; `cache_dir=None` means `default_cache_dir() / "instances"`.
    """
    files = expand_input_files(input_files if input_files is not None else bundled_corpus_path())
    vocab = Path(vocab_path) if vocab_path is not None else bundled_vocab_path()
    options = InstanceOptions(sequence_length=sequence_length,
                              max_predictions_per_seq=max_predictions_per_seq,
                              masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob,
                              dupe_factor=dupe_factor, whole_word_mask=whole_word_mask, seed=seed)
    options.validate()
    tokenizer = WordPieceTokenizer(vocab)
    key_material = json.dumps({
        "algorithm": INSTANCES_ALGORITHM_VERSION, "schema": SCHEMA_VERSION,
        "inputs": [file_sha256(f) for f in files], "vocab": tokenizer.vocab_sha256,
        "options": options.as_dict()}, sort_keys=True)
    key = hashlib.sha256(key_material.encode("utf-8")).hexdigest()[:20]
    cache_path = None
    if use_cache:
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "instances"
        cache_path = root / f"instances-s{sequence_length}-p{max_predictions_per_seq}-{key}.h5"
        if cache_path.is_file():
            try:
                arrays = read_shard(cache_path, sequence_length=sequence_length,
                                    max_predictions_per_seq=max_predictions_per_seq,
                                    vocab_size=tokenizer.vocab_size,
                                    vocab_sha256=tokenizer.vocab_sha256)
                log.info("loaded cached instances %s", cache_path)
                return arrays
            except DataError as exc:
                log.warning("ignoring unusable cache (%s); recreating", exc)

    documents = read_documents(files, tokenizer)
    arrays = create_pretraining_arrays(documents, tokenizer, options)
    if cache_path is not None:
        try:
            write_shard(cache_path, arrays, vocab_size=tokenizer.vocab_size,
                        vocab_sha256=tokenizer.vocab_sha256, options=options,
                        extra_attrs={"cache_key": key})
        except OSError as exc:
            log.warning("could not write instance cache %s: %s", cache_path, exc)
    return arrays
