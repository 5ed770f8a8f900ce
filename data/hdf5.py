"""Pre-training shards in HDF5: NVIDIA's BERT layout plus self-describing attributes.

A shard holds six datasets, one row per sample (`input_ids`, `input_mask`, `segment_ids` [N, S];
`masked_lm_positions`, `masked_lm_ids` [N, P]; `next_sentence_labels` [N]) so NVIDIA's
preprocessed shards load too. Packed shards (`popbert.data.packing`) add `position_ids`,
`sequence_index` [N, S] and `cls_positions` [N, K], with `next_sentence_labels` [N, K].
popbert's own shards also record how they were made (schema
version, sequence length, max predictions, vocabulary size and sha256, creation parameters).
Reading checks a shard against the run's expectations: a mismatch is a one-line `DataError`
naming the file, never silently wrong batches.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from popbert.data import storage
from popbert.data.errors import DataError
from popbert.data.instances import FEATURE_NAMES, InstanceOptions
from popbert.data.packing import PACKED_FEATURE_NAMES
from popbert.errors import one_line

log = logging.getLogger(__name__)

SCHEMA_VERSION = 1
_SEQ_FEATURES = ("input_ids", "input_mask", "segment_ids")


@dataclass
class ShardInfo:
    """What a shard says about itself; `None` where an attribute-less (NVIDIA) shard is silent."""

    path: storage.Location  # a local Path, or the shard's URL
    num_samples: int
    sequence_length: int
    max_predictions_per_seq: int
    schema_version: int | None = None
    vocab_size: int | None = None
    vocab_sha256: str | None = None
    attrs: dict = field(default_factory=dict)
    packed: bool = False
    max_sequences_per_pack: int | None = None  # packed shards: NSP slots per row

    @property
    def feature_names(self) -> tuple[str, ...]:
        """The datasets a loader reads from this shard."""
        return FEATURE_NAMES + PACKED_FEATURE_NAMES if self.packed else FEATURE_NAMES


def _attr_value(value):
    if isinstance(value, bytes):
        return value.decode("utf-8")
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value


def _validate_arrays(arrays: Mapping[str, np.ndarray], where: str
                     ) -> tuple[int, int, int, int | None]:
    """Check the arrays agree in shape; return (num_samples, seq_len, max_predictions, K).

    K is the number of sequences per row of a packed shard, None for an unpacked one.
    """
    missing = [k for k in FEATURE_NAMES if k not in arrays]
    if missing:
        raise DataError(f"{where}: missing datasets {', '.join(missing)}")
    present = [k for k in PACKED_FEATURE_NAMES if k in arrays]
    if present and len(present) != len(PACKED_FEATURE_NAMES):
        absent = [k for k in PACKED_FEATURE_NAMES if k not in arrays]
        raise DataError(f"{where}: packed shard lacks datasets {', '.join(absent)}")
    packed = bool(present)
    ids = arrays["input_ids"]
    if ids.ndim != 2:
        raise DataError(f"{where}: input_ids must be 2-D [samples, sequence], got {ids.shape}")
    n, seq = ids.shape
    for name in _SEQ_FEATURES + (("position_ids", "sequence_index") if packed else ()):
        if tuple(arrays[name].shape) != (n, seq):
            raise DataError(f"{where}: {name} has shape {tuple(arrays[name].shape)}, "
                            f"input_ids has {(n, seq)}")
    pos = arrays["masked_lm_positions"]
    if pos.ndim != 2 or pos.shape[0] != n:
        raise DataError(f"{where}: masked_lm_positions has shape {tuple(pos.shape)}, "
                        f"expected ({n}, max_predictions)")
    pred = pos.shape[1]
    if tuple(arrays["masked_lm_ids"].shape) != (n, pred):
        raise DataError(f"{where}: masked_lm_ids has shape {tuple(arrays['masked_lm_ids'].shape)}, "
                        f"masked_lm_positions has {(n, pred)}")
    nsp = arrays["next_sentence_labels"]
    if packed:
        cls = arrays["cls_positions"]
        if cls.ndim != 2 or cls.shape[0] != n:
            raise DataError(f"{where}: cls_positions has shape {tuple(cls.shape)}, expected "
                            f"({n}, max_sequences_per_pack)")
        k = int(cls.shape[1])
        if tuple(nsp.shape) != (n, k):
            raise DataError(f"{where}: next_sentence_labels has shape {tuple(nsp.shape)}, "
                            f"cls_positions has {(n, k)}")
        return n, seq, pred, k
    if nsp.shape not in ((n,), (n, 1)):
        raise DataError(f"{where}: next_sentence_labels has shape {tuple(nsp.shape)}, "
                        f"expected ({n},)")
    return n, seq, pred, None


def write_shard(path: str | os.PathLike, arrays: Mapping[str, np.ndarray], *,
                vocab_size: int | None = None, vocab_sha256: str | None = None,
                options: InstanceOptions | None = None, extra_attrs: Mapping | None = None,
                compression: str | None = "gzip") -> storage.Location:
    """Write one shard atomically (temporary name, fsync, rename; to a URL: made locally, then
    one PUT); returns its path.

    Data is stored as int32 in NVIDIA's layout; attributes record everything needed to check
    the shard against a run later.
    """
    path = storage.location(path)
    n, seq, pred, k = _validate_arrays(arrays, str(path))
    attrs: dict = {"schema_version": SCHEMA_VERSION, "sequence_length": seq,
                   "max_predictions_per_seq": pred, "num_samples": n, "format": "popbert-bert",
                   "packed": int(k is not None)}
    if k is not None:
        attrs["max_sequences_per_pack"] = k
    if vocab_size is not None:
        attrs["vocab_size"] = int(vocab_size)
    if vocab_sha256 is not None:
        attrs["vocab_sha256"] = str(vocab_sha256)
    if options is not None:
        for key, value in options.as_dict().items():
            if key in ("sequence_length", "max_predictions_per_seq"):
                if value != attrs[key]:
                    raise DataError(
                        f"{path}: options.{key}={value} but the arrays have {attrs[key]}")
                continue
            attrs[key] = int(value) if isinstance(value, bool) else value
    if extra_attrs:
        attrs.update(extra_attrs)

    if isinstance(path, Path):
        path.parent.mkdir(parents=True, exist_ok=True)
    tmp = storage.temp_path(path)  # made locally, then published (renamed, or one PUT)
    try:
        with h5py.File(tmp, "w") as f:
            for name in FEATURE_NAMES + (PACKED_FEATURE_NAMES if k is not None else ()):
                data = np.asarray(arrays[name]).astype(np.int32, copy=False)
                # Byte shuffle + gzip level 1: standard HDF5 filters any reader has, smaller and
                # faster to write than plain gzip for small integers.
                f.create_dataset(name, data=data, dtype="i4", compression=compression,
                                 compression_opts=1 if compression == "gzip" else None,
                                 shuffle=compression is not None)
            for key, value in attrs.items():
                f.attrs[key] = value
        storage.publish(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    log.info("wrote %s: %d samples, seq %d, %d predictions", path, n, seq, pred)
    return path


def _open(path: storage.Location) -> h5py.File:
    """A shard opened for reading: a local file, or a remote one read by ranges (for its
    metadata; `read_shard` reads remote data through the shard cache instead)."""
    if isinstance(path, str):  # a missing object is one line from open_metadata
        source = storage.open_metadata(path)
        try:
            return h5py.File(source, "r")
        except OSError as exc:
            source.close()
            raise DataError(f"{path}: not a readable HDF5 file ({one_line(exc, 300)})") from None
    if not path.is_file():
        raise DataError(f"{path}: shard not found")
    try:
        return h5py.File(path, "r")
    except OSError as exc:
        raise DataError(f"{path}: not a readable HDF5 file ({one_line(exc, 300)})") from None


def _info_from_file(f: h5py.File, path: storage.Location) -> ShardInfo:
    names = FEATURE_NAMES + PACKED_FEATURE_NAMES
    try:
        datasets = {k: f[k] for k in names if k in f}
    except (OSError, KeyError, ValueError) as exc:
        raise DataError(f"{path}: cannot read datasets ({one_line(exc, 300)})") from None
    n, seq, pred, k = _validate_arrays(datasets, str(path))
    attrs = {key: _attr_value(v) for key, v in f.attrs.items()}
    info = ShardInfo(path=path, num_samples=n, sequence_length=seq, max_predictions_per_seq=pred,
                     schema_version=attrs.get("schema_version"),
                     vocab_size=attrs.get("vocab_size"), vocab_sha256=attrs.get("vocab_sha256"),
                     attrs=attrs, packed=k is not None, max_sequences_per_pack=k)
    if info.schema_version is not None and int(info.schema_version) > SCHEMA_VERSION:
        raise DataError(f"{path}: schema version {info.schema_version} is newer than this "
                        f"popbert reads ({SCHEMA_VERSION})")
    for key, actual in (("sequence_length", seq), ("max_predictions_per_seq", pred),
                        ("num_samples", n)):
        if key in attrs and int(attrs[key]) != actual:
            raise DataError(f"{path}: attribute {key}={attrs[key]} but the datasets have {actual}")
    return info


_remote_infos: dict[str, ShardInfo] = {}


def read_shard_info(path: str | os.PathLike) -> ShardInfo:
    """Shapes and attributes of a shard without reading its data (of a remote shard, only the
    few blocks its metadata lies in, once per process: the run's checks and its loader both
    ask, and `read_shard` checks the data it reads again)."""
    path = storage.location(path)
    if isinstance(path, str) and path in _remote_infos:
        return _remote_infos[path]
    with _open(path) as f:
        info = _info_from_file(f, path)
    if isinstance(path, str):
        _remote_infos[path] = info
    return info


#: Shards whose metadata is read at once from object storage: each costs a few requests of
#: latency, so thousands of shards read one by one would hold a run's start for minutes.
REMOTE_INFO_THREADS = 16


def read_shard_infos(paths: list[storage.Location]) -> list[ShardInfo]:
    """`read_shard_info` of every path, in order; remote ones concurrently."""
    if not any(isinstance(storage.location(p), str) for p in paths):
        return [read_shard_info(p) for p in paths]
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(REMOTE_INFO_THREADS, len(paths)),
                            thread_name_prefix="popbert-shard-info") as pool:
        return list(pool.map(read_shard_info, paths))


def check_shard_info(info: ShardInfo, *, sequence_length: int | None = None,
                     max_predictions_per_seq: int | None = None, vocab_size: int | None = None,
                     vocab_sha256: str | None = None, packed: bool | None = None,
                     max_sequences_per_pack: int | None = None) -> None:
    """Raise DataError if a shard's recorded shape or vocabulary differs from the run's.

    `packed`: whether the run's model is packed (None: either); `max_sequences_per_pack`: its
    NSP slots per row (checked on packed shards only).
    """
    p = info.path
    if packed is not None and info.packed != packed:
        if packed:
            raise DataError(f"{p}: not a packed shard, but the model is packed "
                            f"(make one with `popbert prepare-data pack`)")
        raise DataError(f"{p}: a packed shard, but the model is not (set model.packed: true)")
    if (info.packed and max_sequences_per_pack is not None
            and info.max_sequences_per_pack != max_sequences_per_pack):
        raise DataError(f"{p}: packs up to {info.max_sequences_per_pack} sequences per row, run "
                        f"expects {max_sequences_per_pack} (model.max_sequences_per_pack)")
    if sequence_length is not None and info.sequence_length != sequence_length:
        raise DataError(f"{p}: sequence length {info.sequence_length}, run expects "
                        f"{sequence_length}")
    if (max_predictions_per_seq is not None
            and info.max_predictions_per_seq != max_predictions_per_seq):
        raise DataError(f"{p}: max_predictions_per_seq {info.max_predictions_per_seq}, run "
                        f"expects {max_predictions_per_seq}")
    if (vocab_size is not None and info.vocab_size is not None
            and int(info.vocab_size) != vocab_size):
        raise DataError(f"{p}: vocabulary size {info.vocab_size}, run expects {vocab_size}")
    if (vocab_sha256 is not None and info.vocab_sha256 is not None
            and info.vocab_sha256 != vocab_sha256):
        raise DataError(f"{p}: vocabulary sha256 {info.vocab_sha256[:12]}..., run's vocabulary "
                        f"is {vocab_sha256[:12]}...")


def read_shard(path: str | os.PathLike, *, sequence_length: int | None = None,
               max_predictions_per_seq: int | None = None, vocab_size: int | None = None,
               vocab_sha256: str | None = None, packed: bool | None = None,
               max_sequences_per_pack: int | None = None) -> dict[str, np.ndarray]:
    """Load a shard's arrays into memory, checked against the given expectations.

    Shards without attributes (NVIDIA's) are checked by shape, and token ids against
    `vocab_size` by value. `next_sentence_labels` comes back as [N] even if stored [N, 1]
    (packed shards: [N, K]). A remote shard (a URL) is read from its copy in the shard cache
    (`popbert.data.storage.ShardCache`), fetched first when missing; errors name the URL.
    """
    path = storage.location(path)
    if isinstance(path, str):
        for last in (False, True):  # another process sharing the cache may evict it meanwhile
            with storage.shard_cache().opened(path) as local:
                if local.is_file() or last:
                    return _read_arrays(local, path, sequence_length, max_predictions_per_seq,
                                        vocab_size, vocab_sha256, packed,
                                        max_sequences_per_pack)
    return _read_arrays(path, path, sequence_length, max_predictions_per_seq, vocab_size,
                        vocab_sha256, packed, max_sequences_per_pack)


def _read_arrays(local: Path, path: storage.Location, sequence_length: int | None,
                 max_predictions_per_seq: int | None, vocab_size: int | None,
                 vocab_sha256: str | None, packed: bool | None,
                 max_sequences_per_pack: int | None) -> dict[str, np.ndarray]:
    """`read_shard` of a local file; `path` is how errors name it."""
    with _open(local) as f:
        info = _info_from_file(f, path)
        check_shard_info(info, sequence_length=sequence_length,
                         max_predictions_per_seq=max_predictions_per_seq,
                         vocab_size=vocab_size, vocab_sha256=vocab_sha256, packed=packed,
                         max_sequences_per_pack=max_sequences_per_pack)
        try:
            arrays = {name: np.asarray(f[name][...]) for name in info.feature_names}
        except (OSError, ValueError, KeyError) as exc:
            raise DataError(f"{path}: cannot read data ({one_line(exc, 300)})") from None
    if not info.packed:
        arrays["next_sentence_labels"] = arrays["next_sentence_labels"].reshape(-1)
    for name, array in arrays.items():
        if not np.issubdtype(array.dtype, np.integer):
            raise DataError(f"{path}: {name} has dtype {array.dtype}, expected integers")
    if info.num_samples:
        if vocab_size is not None:
            for name in ("input_ids", "masked_lm_ids"):
                top = int(arrays[name].max())
                if top >= vocab_size:
                    raise DataError(f"{path}: {name} contains id {top}, outside the run's "
                                    f"vocabulary of {vocab_size}")
        for name in ("masked_lm_positions",) + (("cls_positions",) if info.packed else ()):
            top = int(arrays[name].max())
            if top >= info.sequence_length or int(arrays[name].min()) < 0:
                raise DataError(f"{path}: {name} outside [0, {info.sequence_length})")
    return arrays
