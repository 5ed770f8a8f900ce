"""The resumable pre-training loader and the cached bundled-corpus instances.

`PretrainingLoader` is an endless iterator of micro batches over in-memory arrays or HDF5
shards. Each epoch is a fixed function of (seed, epoch): the shards in a seeded order, the rows
of each shard in a seeded order (one shard / in-memory arrays: a permutation seeded with
`seed + epoch`), cut into global batches of `micro_batch_size * num_replicas` samples, of which
replica r takes the r-th slice. An epoch holds whole optimizer steps (`micro_batch_size *
num_replicas * gradient_accumulation` samples each), so the samples of every step depend on the
seed and that global batch only: 2 replicas, or 1 accumulating 2 micro-batches, train on the
same samples step for step. The whole position is (epoch, samples consumed in the epoch), so a
checkpoint restores it exactly and a resumed run, with the same global batch however it is
split, sees the batches an uninterrupted run would have seen.

Shards are read lazily: only their metadata up front (checked against the run), their data when
the epoch reaches them, with the next shards read ahead by a background thread, so memory holds
a few shards whatever the data set's size.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, fields
from pathlib import Path
from typing import TypeVar

import numpy as np

from popbert.data.corpus import (
    PathsLike,
    TextCounts,
    expand_input_files,
    name_files,
    read_document_parts,
)
from popbert.data.errors import DataError
from popbert.data.hdf5 import (
    SCHEMA_VERSION,
    ShardInfo,
    check_shard_info,
    read_shard,
    read_shard_info,
    read_shard_infos,
    write_shard,
)
from popbert.data.instances import (
    FEATURE_NAMES,
    Cuts,
    InstanceOptions,
    create_corpus_arrays,
    unmask_rows,
)
from popbert.data.packing import PACKED_FEATURE_NAMES
from popbert.data.storage import Location, default_cache_dir, local_file
from popbert.data.tokenization import (
    TextTokenizer,
    bundled_corpus_path,
    bundled_vocab_path,
    file_sha256,
    load_tokenizer,
)

log = logging.getLogger(__name__)

T = TypeVar("T")

# Bump when instance creation changes its output for the same inputs: invalidates caches.
# 3: the text road makes its instances as `prepare-data instances` does (a part per file,
# seeds derived per part, masking vectorised: `instances.create_corpus_arrays`).
INSTANCES_ALGORITHM_VERSION = 3


def _check_arrays(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], tuple]:
    missing = [k for k in FEATURE_NAMES if k not in arrays]
    if missing:
        raise DataError(f"arrays lack {', '.join(missing)}")
    packed = any(k in arrays for k in PACKED_FEATURE_NAMES)
    names = FEATURE_NAMES + PACKED_FEATURE_NAMES if packed else FEATURE_NAMES
    missing = [k for k in names if k not in arrays]
    if missing:
        raise DataError(f"packed arrays lack {', '.join(missing)}")
    out = {k: np.asarray(arrays[k]) for k in names}
    if not packed:
        out["next_sentence_labels"] = out["next_sentence_labels"].reshape(-1)
    return out, names


def _consistent(infos: list[ShardInfo]) -> None:
    def shape(i: ShardInfo) -> tuple:
        return (i.sequence_length, i.max_predictions_per_seq, i.packed, i.max_sequences_per_pack)

    shapes = {shape(i) for i in infos}
    if len(shapes) > 1:
        odd = next(i for i in infos if shape(i) != shape(infos[0]))
        raise DataError(f"{odd.path}: (sequence_length, max_predictions, packed, sequences per "
                        f"pack) {shape(odd)} differs from {infos[0].path}'s {shape(infos[0])}")


class PretrainingLoader:
    """Endless, seeded, replica-sharded, resumable micro batches of pre-training samples.

    `arrays_or_shards`: a dict of the NVIDIA-layout arrays (plus the packed ones), or shard
    path(s) / glob(s), read lazily in sorted order after checking every shard's metadata
    against the optional expectations (`packed` / `max_sequences_per_pack`: the model's).
    With `drop_last` an epoch has `num_samples // step_samples` optimizer steps (`step_samples`
    = `micro_batch_size * num_replicas * gradient_accumulation`); without, the last step is
    completed by wrapping to the epoch's start, so every replica always gets a full batch
    (collectives stay in step) and every sample is seen. A position saved with another
    `step_samples` is refused (the order would differ from the original run's) unless
    `allow_reorder`.
    Batches are dicts of int64 torch tensors (numpy arrays with `as_numpy=True`).
    `remask` (dynamic masking, RoBERTa): each batch's stored masks are undone and `remask(batch,
    rng)` masks it anew, `rng` seeded by the seed, the epoch and the batch's position, so every
    epoch sees new masks and a resumed run the same ones.
    `prefetch_shards` shards beyond the current one are read ahead in a background thread.
    """

    def __init__(self, arrays_or_shards: Mapping[str, np.ndarray] | PathsLike,
                 micro_batch_size: int, seed: int, shuffle: bool = True, replica_index: int = 0,
                 num_replicas: int = 1, drop_last: bool = True, *,
                 sequence_length: int | None = None, max_predictions_per_seq: int | None = None,
                 vocab_size: int | None = None, vocab_sha256: str | None = None,
                 packed: bool | None = None, max_sequences_per_pack: int | None = None,
                 as_numpy: bool = False, prefetch_shards: int = 2,
                 remask: Callable[[dict[str, np.ndarray], np.random.Generator], None] | None
                 = None, gradient_accumulation: int = 1, allow_reorder: bool = False):
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if num_replicas < 1 or not 0 <= replica_index < num_replicas:
            raise ValueError(f"replica_index {replica_index} not in [0, {num_replicas})")
        if gradient_accumulation < 1:
            raise ValueError(f"gradient_accumulation must be >= 1, got {gradient_accumulation}")
        self._checks = {"sequence_length": sequence_length,
                        "max_predictions_per_seq": max_predictions_per_seq,
                        "vocab_size": vocab_size, "vocab_sha256": vocab_sha256,
                        "packed": packed, "max_sequences_per_pack": max_sequences_per_pack}
        self.paths: list[Location] | None = None
        self._loaded: dict[int, Future] = {}
        if isinstance(arrays_or_shards, Mapping):
            arrays, self.feature_names = _check_arrays(arrays_or_shards)
            self.arrays: dict[str, np.ndarray] | None = arrays
            self.sizes = np.array([len(arrays["input_ids"])], np.int64)
            done: Future = Future()
            done.set_result(arrays)
            self._loaded[0] = done
        else:
            self.paths = expand_input_files(arrays_or_shards)
            infos = read_shard_infos(self.paths)
            for info in infos:
                check_shard_info(info, **self._checks)
            _consistent(infos)
            self.feature_names = infos[0].feature_names
            self.arrays = None
            self.sizes = np.array([i.num_samples for i in infos], np.int64)
        self.starts = np.cumsum(self.sizes) - self.sizes  # global sample id of each row 0
        self.num_samples = int(self.sizes.sum())
        self.micro_batch_size = int(micro_batch_size)
        self.seed = int(seed)
        self.shuffle = shuffle
        self.replica_index = int(replica_index)
        self.num_replicas = int(num_replicas)
        self.drop_last = drop_last
        self.as_numpy = as_numpy
        self.prefetch_shards = max(0, int(prefetch_shards))
        self.remask = remask
        self.global_batch_size = self.micro_batch_size * self.num_replicas
        self.step_samples = self.global_batch_size * int(gradient_accumulation)
        self.allow_reorder = allow_reorder
        if self.num_samples == 0:
            raise DataError("no pre-training samples to load")
        if drop_last and self.num_samples < self.step_samples:
            raise DataError(f"{self.num_samples} samples are fewer than one global batch "
                            f"({self.micro_batch_size} x {self.num_replicas} replicas x "
                            f"{gradient_accumulation} accumulated)")
        self.epoch = 0
        self.index = 0
        self._layout_epoch: int | None = None
        self._shard_order = np.arange(len(self.sizes))
        self._ends = np.cumsum(self.sizes)
        self._rows: dict[int, np.ndarray] = {}
        self._pool: ThreadPoolExecutor | None = None

    @property
    def steps_per_epoch(self) -> int:
        """Micro batches each replica gets per epoch."""
        return self.samples_per_epoch // self.global_batch_size

    @property
    def samples_per_epoch(self) -> int:
        """Samples consumed across all replicas in one epoch (padding included): whole
        optimizer steps."""
        if self.drop_last:
            return self.num_samples // self.step_samples * self.step_samples
        return -(-self.num_samples // self.step_samples) * self.step_samples

    # ---------------------------------------------------------------- the epoch's order
    def _layout(self, epoch: int) -> None:
        if self._layout_epoch == epoch:
            return
        self._rows = {}
        shards = len(self.sizes)
        rng = np.random.default_rng(self.seed + epoch)
        if not self.shuffle:
            self._shard_order = np.arange(shards)
        elif shards == 1:
            self._shard_order = np.arange(1)
            self._rows[0] = rng.permutation(int(self.sizes[0]))
        else:
            self._shard_order = rng.permutation(shards)
        self._ends = np.cumsum(self.sizes[self._shard_order])
        self._layout_epoch = epoch

    def _shard_rows(self, epoch: int, shard: int) -> np.ndarray:
        """The order of one shard's rows in an epoch (shuffled within the shard)."""
        self._layout(epoch)
        if shard not in self._rows:
            size = int(self.sizes[shard])
            if self.shuffle:
                rng = np.random.default_rng([self.seed, epoch, shard])
                self._rows[shard] = rng.permutation(size)
            else:
                self._rows[shard] = np.arange(size)
        return self._rows[shard]

    def _locate(self, epoch: int, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(shard, row) of each position of an epoch's sample sequence."""
        self._layout(epoch)
        wrapped = positions % self.num_samples
        k = np.searchsorted(self._ends, wrapped, side="right")
        shards = self._shard_order[k]
        offsets = wrapped - (self._ends[k] - self.sizes[shards])
        rows = np.empty_like(offsets)
        for shard in np.unique(shards):
            sel = shards == shard
            rows[sel] = self._shard_rows(epoch, int(shard))[offsets[sel]]
        return shards, rows

    # ---------------------------------------------------------------- shard reading
    def _read(self, shard: int) -> dict[str, np.ndarray]:
        assert self.paths is not None
        return read_shard(self.paths[shard], **self._checks)

    def _shard(self, shard: int) -> dict[str, np.ndarray]:
        if shard not in self._loaded:
            done: Future = Future()
            done.set_result(self._read(shard))
            self._loaded[shard] = done
        return self._loaded[shard].result()

    def _prefetch(self) -> None:
        """Keep the current shard and read the next `prefetch_shards` ones in the background."""
        if self.paths is None:
            return
        self._layout(self.epoch)
        position = self.index % self.num_samples
        k = int(np.searchsorted(self._ends, position, side="right"))
        wanted = [int(s) for s in self._shard_order[k:k + 1 + self.prefetch_shards]]
        for shard in list(self._loaded):
            if shard not in wanted:
                del self._loaded[shard]
        if self.prefetch_shards and self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="popbert-shards")
        for shard in wanted:
            if shard not in self._loaded:
                if self._pool is None:
                    continue
                self._loaded[shard] = self._pool.submit(self._read, shard)

    def close(self) -> None:
        """Stop the read-ahead thread and drop cached shards (in-memory arrays stay)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None
        if self.paths is not None:
            self._loaded.clear()

    # ---------------------------------------------------------------- iteration
    def __iter__(self) -> PretrainingLoader:
        return self

    def __next__(self) -> dict:
        if self.index + self.global_batch_size > self.samples_per_epoch:
            self.epoch += 1
            self.index = 0
        start = self.index + self.replica_index * self.micro_batch_size
        shards, rows = self._locate(self.epoch,
                                    np.arange(start, start + self.micro_batch_size))
        batch: dict[str, np.ndarray] = {}
        for shard in dict.fromkeys(shards.tolist()):
            data = self._shard(shard)
            sel = shards == shard
            for name in self.feature_names:
                if name not in batch:
                    batch[name] = np.empty((self.micro_batch_size,) + data[name].shape[1:],
                                           np.int64)
                batch[name][sel] = data[name][rows[sel]]
        if self.remask is not None:
            unmask_rows(batch)
            self.remask(batch, np.random.default_rng([self.seed, self.epoch, start]))
        self.index += self.global_batch_size
        self._prefetch()
        if self.as_numpy:
            return batch
        import torch

        return {k: torch.from_numpy(v) for k, v in batch.items()}

    def state_dict(self) -> dict:
        """Position to checkpoint: epoch, samples consumed in it (all replicas), data size."""
        return {"epoch": self.epoch, "index": self.index, "num_samples": self.num_samples,
                "step_samples": self.step_samples}

    def load_state_dict(self, state: Mapping) -> None:
        """Continue from a `state_dict()`; refuses a position taken on different data."""
        try:
            epoch, index = int(state["epoch"]), int(state["index"])
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"loader state {dict(state)!r} lacks integer epoch/index") from exc
        if "num_samples" in state and int(state["num_samples"]) != self.num_samples:
            raise DataError(f"loader state was saved on {state['num_samples']} samples, "
                            f"this data has {self.num_samples}")
        saved = int(state.get("step_samples", self.step_samples))
        if saved != self.step_samples and not self.allow_reorder:
            raise DataError(f"it was saved with a global batch of {saved} samples per step, "
                            f"this run takes {self.step_samples} (micro batch x replicas x "
                            f"accumulation): the samples would follow another order than the "
                            f"original run's; keep the global batch, or set "
                            f"data.reorder_on_resume: true")
        if epoch < 0 or not 0 <= index <= self.samples_per_epoch:
            raise DataError(f"loader state epoch={epoch} index={index} is out of range "
                            f"(epoch has {self.samples_per_epoch} samples)")
        self.epoch, self.index = epoch, index
        self._prefetch()


#: Length grouping sorts pools of this many batches by length (Hugging Face's `group_by_length`
#: uses 50): large enough that a pool's batches are nearly uniform, small enough that the order
#: stays random at the scale of an epoch.
LENGTH_POOL_BATCHES = 50


def length_grouped_order(order: np.ndarray, lengths: np.ndarray, batch_size: int,
                         rng: np.random.Generator, pool_batches: int = LENGTH_POOL_BATCHES
                         ) -> np.ndarray:
    """`order` (a shuffled permutation) regrouped so each batch holds rows of similar length:
    every pool of `pool_batches` batches is sorted by length (longest first, stably) and its
    batches are then shuffled. With trimmed batches (`execution.trim_padding`) a batch then
    costs about its own rows' length instead of the longest row's in the whole data."""
    pool = pool_batches * batch_size
    grouped = []
    for start in range(0, len(order), pool):
        rows = order[start:start + pool]
        rows = rows[np.argsort(-lengths[rows], kind="stable")]
        batches = [rows[i:i + batch_size] for i in range(0, len(rows), batch_size)]
        grouped.extend(batches[i] for i in rng.permutation(len(batches)))
    return np.concatenate(grouped) if grouped else order


def split_documents(documents: Sequence[T], fraction: float, seed: int
                    ) -> tuple[list[T], list[T]]:
    """(training, held-out) documents: `fraction` of them (at least one, and one fewer than
    all) held out, chosen by `seed`, both in corpus order.

    Whole documents are held out, not instances: an article's sentence pairs overlap (and NSP
    draws from the same article), so holding out instances would validate on trained text.
    """
    count = len(documents)
    if count < 2:
        raise DataError(f"a validation split needs at least 2 documents, the corpus has {count}")
    held = min(max(1, round(fraction * count)), count - 1)
    chosen = set(np.random.default_rng([seed, 0x7A11D]).permutation(count)[:held].tolist())
    return ([d for i, d in enumerate(documents) if i not in chosen],
            [d for i, d in enumerate(documents) if i in chosen])


#: The `instances.Cuts` counts a cached instance file keeps (as `cut_<name>` attributes).
CUT_COUNTS = tuple(f.name for f in fields(Cuts))
#: The `corpus.TextCounts` a cached instance file keeps (as attributes of those names), so a
#: cached corpus is checked (and under strict refused) as a fresh one is.
TEXT_COUNTS = tuple(f.name for f in fields(TextCounts))


def _read_instance_cache(path: Path, tokenizer: TextTokenizer, sequence_length: int,
                         max_predictions_per_seq: int
                         ) -> tuple[dict[str, np.ndarray], TextCounts, Cuts] | None:
    """A cached instance file's arrays and counts; None (said) when absent or unusable."""
    if not path.is_file():
        return None
    try:
        arrays = read_shard(path, sequence_length=sequence_length,
                            max_predictions_per_seq=max_predictions_per_seq,
                            vocab_size=tokenizer.vocab_size, vocab_sha256=tokenizer.vocab_sha256)
        attrs = read_shard_info(path).attrs
        try:
            counts = TextCounts(**{k: int(attrs[k]) for k in TEXT_COUNTS})
            cuts = Cuts(**{k: int(attrs[f"cut_{k}"]) for k in CUT_COUNTS})
        except KeyError as exc:
            raise DataError(f"{path}: no count {exc}") from None
    except DataError as exc:
        log.warning("ignoring unusable cache (%s); recreating", exc)
        return None
    return arrays, counts, cuts


def load_or_create_instances(input_files: PathsLike | None, vocab_path: str | os.PathLike | None,
                             sequence_length: int, max_predictions_per_seq: int, seed: int,
                             cache_dir: str | os.PathLike | None = None, *,
                             dupe_factor: int = 1, masked_lm_prob: float = 0.15,
                             short_seq_prob: float = 0.1, whole_word_mask: bool = False,
                             use_cache: bool = True, validation_fraction: float = 0.0,
                             split: str = "train", next_sentence: bool = True,
                             strict: bool = False) -> dict[str, np.ndarray]:
    """Pre-training arrays for Google-format text files, created once and cached as a shard.

    The instances are those `prepare-data instances` makes of the same files with the same
    seed and settings, in file order (`instances.create_corpus_arrays`: a file is a part), and
    the corpus is checked as that stage checks it (`corpus.TextCounts`).
    `input_files=None` / `vocab_path=None` mean the bundled corpus / vocabulary. The cache key
    hashes the input files' and vocabulary's contents and every creation parameter, so a
    stale cache is never used; `cache_dir=None` means `default_cache_dir() / "instances"`.
    `validation_fraction` > 0 holds that fraction of the documents out (`split_documents`):
    `split="train"` gives the instances of the rest, `split="validation"` those of the held-out
    documents; the split is part of the cache key. `strict`: a corpus whose share of `[UNK]`
    tokens is above `corpus.UNKNOWN_SHARE_LIMIT`, or that holds a sentence longer than a
    sequence holds, is a DataError, not a warning (the cache keeps the counts, so a cached
    corpus is checked too). What pairing truncated is said once (`instances.Cuts`).
    """
    if split not in ("train", "validation"):
        raise ValueError(f"split must be 'train' or 'validation', got {split!r}")
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction must be in [0, 1), got {validation_fraction}")
    if split == "validation" and not validation_fraction:
        raise ValueError("split='validation' needs a validation_fraction > 0")
    files = expand_input_files(input_files if input_files is not None else bundled_corpus_path())
    vocab = local_file(vocab_path) if vocab_path is not None else bundled_vocab_path()
    options = InstanceOptions(sequence_length=sequence_length,
                              max_predictions_per_seq=max_predictions_per_seq,
                              masked_lm_prob=masked_lm_prob, short_seq_prob=short_seq_prob,
                              dupe_factor=dupe_factor, whole_word_mask=whole_word_mask, seed=seed,
                              next_sentence=next_sentence)
    options.validate()
    tokenizer = load_tokenizer(vocab)
    material = {"algorithm": INSTANCES_ALGORITHM_VERSION, "schema": SCHEMA_VERSION,
                "inputs": [file_sha256(f) for f in files], "vocab": tokenizer.vocab_sha256,
                "options": options.as_dict()}
    if validation_fraction:  # without a split the key (and existing caches) stay as they were
        material["split"] = [split, validation_fraction]
    key_material = json.dumps(material, sort_keys=True)
    key = hashlib.sha256(key_material.encode("utf-8")).hexdigest()[:20]
    where = name_files(files) + (f" ({split})" if validation_fraction else "")
    cache_path = None
    if use_cache:
        root = Path(cache_dir) if cache_dir is not None else default_cache_dir() / "instances"
        cache_path = root / f"instances-s{sequence_length}-p{max_predictions_per_seq}-{key}.h5"
        cached = _read_instance_cache(cache_path, tokenizer, sequence_length,
                                      max_predictions_per_seq)
        if cached is not None:
            arrays, counts, cuts = cached
            counts.check(name_files(files), sequence_length, strict)
            cuts.say(where, sequence_length)
            log.info("loaded cached instances %s", cache_path)
            return arrays

    parts = read_document_parts(files, tokenizer)
    counts = TextCounts.of([d for part in parts for d in part], tokenizer, sequence_length,
                           next_sentence)
    share = counts.check(name_files(files), sequence_length, strict)
    log.info("read %d documents, %d sentences, %d tokens (%.2f%% [UNK])", counts.documents,
             counts.sentences, counts.tokens, 100 * share)
    if validation_fraction:  # whole documents held out, each staying in its part
        tagged = [(index, d) for index, part in enumerate(parts) for d in part]
        train, held_out = split_documents(tagged, validation_fraction, seed)
        chosen = held_out if split == "validation" else train
        parts = [[] for _ in parts]
        for index, document in chosen:
            parts[index].append(document)
    cuts = Cuts()
    arrays = create_corpus_arrays(parts, tokenizer, options, cuts)
    cuts.say(where, sequence_length)
    if cache_path is not None:
        try:
            write_shard(cache_path, arrays, vocab_size=tokenizer.vocab_size,
                        vocab_sha256=tokenizer.vocab_sha256, options=options,
                        extra_attrs={"cache_key": key, **asdict(counts),
                                     **{f"cut_{name}": getattr(cuts, name)
                                        for name in CUT_COUNTS}})
        except OSError as exc:
            log.warning("could not write instance cache %s: %s", cache_path, exc)
    return arrays
