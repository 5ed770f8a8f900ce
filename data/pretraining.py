"""The main job's data: the run config's corpus or shards → checked data → a resumable loader.

`data.input_files` may name Google-format text files (instances are created and cached, as
before) or HDF5 shards (`*.h5` / `*.hdf5`, globs allowed), which are loaded lazily after every
shard's metadata is checked against the run: sequence length, max predictions, vocabulary size
and sha256, and packed-ness (`model.packed` needs packed shards, with
`model.max_sequences_per_pack` NSP slots).

Validation data (`load_validation_data`) is `data.validation_files` checked the same way, or the
documents `data.validation_fraction` held out of a text corpus; `validation_batches` fixes the
micro-batches every evaluation sees.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from popbert.data import storage
from popbert.data.corpus import expand_input_files
from popbert.data.errors import DataError
from popbert.data.hdf5 import check_shard_info, read_shard_infos
from popbert.data.instances import InstanceOptions, mask_arrays
from popbert.data.loader import PretrainingLoader, load_or_create_instances
from popbert.data.tokenization import TextTokenizer, bundled_vocab_path, load_tokenizer
from popbert.errors import ConfigError

if TYPE_CHECKING:
    from popbert.config import RunConfig

log = logging.getLogger(__name__)

SHARD_SUFFIXES = (".h5", ".hdf5")


@dataclass
class ShardSet:
    """Checked HDF5 shards for a run, and the checks the loader repeats when reading them."""

    paths: list[storage.Location]
    checks: dict = field(default_factory=dict)
    num_samples: int = 0


def _is_shard_pattern(item: str) -> bool:
    return item.lower().endswith(SHARD_SUFFIXES)


def load_training_data(cfg: RunConfig) -> dict[str, np.ndarray] | ShardSet:
    """Pre-training data for the config, checked against the model's shapes.

    Text inputs (or none: the bundled corpus) give in-memory instance arrays; shard inputs give
    a `ShardSet` (metadata checked now, data read lazily by the loader).
    Any of them may be on object storage (`use_storage`).
    """
    use_storage(cfg)
    vocab_path = run_vocab_path(cfg)
    if not vocab_path.is_file():
        raise ConfigError(f"data.vocab_file: {vocab_path} does not exist")
    try:
        tokenizer = load_tokenizer(vocab_path)
    except DataError as error:  # not UTF-8, no special tokens: name the key that chose it
        raise ConfigError(f"data.vocab_file: {error}") from None
    if tokenizer.vocab_size != cfg.model.vocab_size:
        raise ConfigError(f"model.vocab_size is {cfg.model.vocab_size} but the vocabulary "
                          f"{vocab_path} has {tokenizer.vocab_size} entries")
    inputs = list(cfg.data.input_files)
    shard_inputs = [i for i in inputs if _is_shard_pattern(i)]
    if shard_inputs and len(shard_inputs) != len(inputs):
        raise ConfigError("data.input_files mixes HDF5 shards and text files; list one kind")
    if shard_inputs:
        return _shard_set(cfg, tokenizer, shard_inputs)
    if cfg.model.packed:
        raise ConfigError("model.packed needs packed HDF5 shards in data.input_files "
                          "(make them with `popbert prepare-data pack`)")
    return _instances(cfg, inputs or None, vocab_path, cfg.data.validation_fraction, "train")


def _instances(cfg: RunConfig, inputs: list[str] | None, vocab_path: Path, fraction: float,
               split: str) -> dict[str, np.ndarray]:
    return load_or_create_instances(
        inputs, vocab_path, cfg.model.sequence_length,
        cfg.model.max_predictions_per_seq, cfg.data.seed, instance_cache_dir(cfg),
        dupe_factor=cfg.data.duplication_factor, masked_lm_prob=cfg.data.masked_lm_prob,
        short_seq_prob=cfg.data.short_seq_prob, whole_word_mask=cfg.data.whole_word_masking,
        validation_fraction=fraction, split=split,
        next_sentence=cfg.model.next_sentence_prediction, strict=cfg.data.strict)


def instance_cache_dir(cfg: RunConfig) -> Path | None:
    """Where the text road caches its instances: `data.cache_dir`/instances (a folder the
    shard cache, which keeps its files at the top of `data.cache_dir`, never evicts from),
    made and checked writable now; None (the default cache) when `data.cache_dir` is unset."""
    if cfg.data.cache_dir is None:
        return None
    path = Path(cfg.data.cache_dir) / "instances"
    try:
        path.mkdir(parents=True, exist_ok=True)
        probe = path / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"data.cache_dir: {path} cannot be written "
                          f"({exc.strerror or exc}); set it to a writable directory") from None
    return path


def load_validation_data(cfg: RunConfig) -> dict[str, np.ndarray] | ShardSet | None:
    """The held-out data (`data.validation_files`, or `data.validation_fraction` of the
    training corpus's documents), checked like the training data; None when there is none."""
    d = cfg.data
    vocab_path = run_vocab_path(cfg)
    if d.validation_fraction:
        return _instances(cfg, list(d.input_files) or None, vocab_path, d.validation_fraction,
                          "validation")
    if not d.validation_files:
        return None
    files = list(d.validation_files)
    shards = [f for f in files if _is_shard_pattern(f)]
    if shards and len(shards) != len(files):
        raise ConfigError("data.validation_files mixes HDF5 shards and text files; list one kind")
    if not shards:
        if cfg.model.packed:
            raise ConfigError("model.packed needs packed HDF5 shards in data.validation_files")
        return _instances(cfg, files, vocab_path, 0.0, "train")
    return _shard_set(cfg, load_tokenizer(vocab_path), shards)


def _shard_set(cfg: RunConfig, tokenizer: TextTokenizer, patterns: list[str]) -> ShardSet:
    """Shards whose every metadata fits the run (checked now; the loader repeats the checks)."""
    checks = {"sequence_length": cfg.model.sequence_length,
              "max_predictions_per_seq": cfg.model.max_predictions_per_seq,
              "vocab_size": tokenizer.vocab_size, "vocab_sha256": tokenizer.vocab_sha256,
              "packed": cfg.model.packed,
              "max_sequences_per_pack": cfg.model.max_sequences_per_pack}
    paths = expand_input_files(patterns)
    total = 0
    for info in read_shard_infos(paths):
        check_shard_info(info, **checks)
        total += info.num_samples
    return ShardSet(paths, checks, total)


def validation_batches(cfg: RunConfig, data: dict[str, np.ndarray] | ShardSet | None,
                       replica_index: int = 0, num_replicas: int = 1) -> list[dict] | None:
    """This replica's share of the fixed validation micro-batches: the first
    `training.eval_batches` global batches of the held-out data in its stored order (wrapping
    when it is smaller), so every evaluation sees the same samples (during training every
    `training.eval_every` steps, or when asked: `Trainer.evaluate`). None without data."""
    if data is None:
        return None
    source = [str(p) for p in data.paths] if isinstance(data, ShardSet) else data
    checks = data.checks if isinstance(data, ShardSet) else {}
    loader = PretrainingLoader(source, cfg.execution.micro_batch_size, seed=cfg.data.seed,
                               shuffle=False, replica_index=replica_index,
                               num_replicas=num_replicas, drop_last=False, prefetch_shards=0,
                               **checks)
    wanted = cfg.training.eval_batches * loader.global_batch_size
    if wanted > loader.num_samples:
        log.warning("training.eval_batches (%d) x the global micro-batch (%d) exceeds the %d "
                    "validation samples: some are evaluated twice", cfg.training.eval_batches,
                    loader.global_batch_size, loader.num_samples)
    try:
        return [next(loader) for _ in range(cfg.training.eval_batches)]
    finally:
        loader.close()


def make_loader(cfg: RunConfig, data: dict[str, np.ndarray] | ShardSet, replica_index: int = 0,
                num_replicas: int = 1) -> PretrainingLoader:
    """Micro-batches of `execution.micro_batch_size` for one replica, seeded by `data.seed`,
    masked anew each batch with `data.dynamic_masking`."""
    remask = dynamic_masking(cfg) if cfg.data.dynamic_masking else None
    order = {"gradient_accumulation": cfg.execution.gradient_accumulation,
             "allow_reorder": cfg.data.reorder_on_resume}
    if isinstance(data, ShardSet):
        return PretrainingLoader([str(p) for p in data.paths], cfg.execution.micro_batch_size,
                                 seed=cfg.data.seed, shuffle=cfg.data.shuffle,
                                 replica_index=replica_index, num_replicas=num_replicas,
                                 remask=remask, **order, **data.checks)
    return PretrainingLoader(data, cfg.execution.micro_batch_size, seed=cfg.data.seed,
                             shuffle=cfg.data.shuffle, replica_index=replica_index,
                             num_replicas=num_replicas, remask=remask, **order)


def use_storage(cfg: RunConfig) -> None:
    """Set up object storage for the run's data paths: `data.storage_options` for every
    filesystem, and, when a path is a URL, the shard cache (`data.cache_dir`,
    `data.cache_limit`), checked writable now rather than when the first shard arrives."""
    d = cfg.data
    storage.configure(d.storage_options, d.cache_dir, d.cache_limit)
    paths = [*d.input_files, *d.validation_files, *([d.vocab_file] if d.vocab_file else [])]
    if any(storage.is_url(p) for p in paths):
        try:
            storage.shard_cache()
        except DataError as exc:
            raise ConfigError(f"data.cache_dir: {exc}") from None


def run_vocab_path(cfg: RunConfig) -> Path:
    """The run's vocabulary file: `data.vocab_file` (a URL's local copy), else the bundled
    one."""
    if not cfg.data.vocab_file:
        return bundled_vocab_path()
    if storage.is_url(cfg.data.vocab_file):
        try:
            return storage.local_file(cfg.data.vocab_file)
        except DataError as exc:
            raise ConfigError(f"data.vocab_file: {exc}") from None
    return Path(cfg.data.vocab_file)


def run_tokenizer(cfg: RunConfig) -> TextTokenizer:
    """The WordPiece tokenizer of the run's vocabulary (`run_vocab_path`)."""
    return load_tokenizer(run_vocab_path(cfg))


def dynamic_masking(cfg: RunConfig) -> Callable[[dict[str, np.ndarray], np.random.Generator],
                                                None]:
    """The loader's `remask`: Google's masking rule (`mask_arrays`) with the run's masking
    rate, prediction slots and whole-word choice."""
    tokenizer = run_tokenizer(cfg)
    options = InstanceOptions(sequence_length=cfg.model.sequence_length,
                              max_predictions_per_seq=cfg.model.max_predictions_per_seq,
                              masked_lm_prob=cfg.data.masked_lm_prob,
                              whole_word_mask=cfg.data.whole_word_masking)

    def remask(batch: dict[str, np.ndarray], rng: np.random.Generator) -> None:
        mask_arrays(batch, tokenizer, options, rng)

    return remask
