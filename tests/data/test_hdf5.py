"""HDF5 shards: round trip, attributes, expectation checks, broken files, NVIDIA's plain layout."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from popbert.data import (
    FEATURE_NAMES,
    SCHEMA_VERSION,
    DataError,
    InstanceOptions,
    WordPieceTokenizer,
    bundled_corpus_path,
    create_pretraining_arrays,
    read_shard,
    read_shard_info,
    read_text_documents,
    write_shard,
)
from popbert.data.corpus import tokenize_documents

OPTIONS = InstanceOptions(
    sequence_length=64,
    max_predictions_per_seq=10,
    seed=9,
    dupe_factor=2,
    masked_lm_prob=0.15,
    short_seq_prob=0.1,
)


@pytest.fixture(scope="module")
def tokenizer() -> WordPieceTokenizer:
    return WordPieceTokenizer()


@pytest.fixture(scope="module")
def arrays(tokenizer):
    docs = tokenize_documents(read_text_documents(bundled_corpus_path())[:60], tokenizer)
    return create_pretraining_arrays(docs, tokenizer, OPTIONS)


@pytest.fixture
def shard(tmp_path, arrays, tokenizer):
    return write_shard(
        tmp_path / "shard_0.h5",
        arrays,
        vocab_size=tokenizer.vocab_size,
        vocab_sha256=tokenizer.vocab_sha256,
        options=OPTIONS,
    )


def one_line_error(excinfo, *needles):
    message = str(excinfo.value)
    assert "\n" not in message
    for needle in needles:
        assert needle in message, message


def test_round_trip_and_attributes(shard, arrays, tokenizer):
    assert [p.name for p in shard.parent.iterdir()] == ["shard_0.h5"]  # no temporary left
    back = read_shard(
        shard,
        sequence_length=64,
        max_predictions_per_seq=10,
        vocab_size=tokenizer.vocab_size,
        vocab_sha256=tokenizer.vocab_sha256,
    )
    assert set(back) == set(FEATURE_NAMES)
    for name in FEATURE_NAMES:
        assert np.array_equal(back[name], arrays[name])
    info = read_shard_info(shard)
    n = len(arrays["input_ids"])
    assert (info.num_samples, info.sequence_length, info.max_predictions_per_seq) == (n, 64, 10)
    assert info.schema_version == SCHEMA_VERSION
    assert info.vocab_size == 8192 and info.vocab_sha256 == tokenizer.vocab_sha256
    attrs = info.attrs
    assert attrs["masked_lm_prob"] == pytest.approx(0.15)
    assert attrs["short_seq_prob"] == pytest.approx(0.1)
    assert attrs["dupe_factor"] == 2 and attrs["seed"] == 9 and attrs["whole_word_mask"] == 0
    # Readable without popbert: plain h5py sees NVIDIA's dataset names and int32 data.
    with h5py.File(shard, "r") as f:
        assert sorted(f.keys()) == sorted(FEATURE_NAMES)
        assert f["input_ids"].dtype == np.int32 and f["input_ids"].shape == (n, 64)
        assert int(f.attrs["sequence_length"]) == 64


@pytest.mark.parametrize(
    "kwargs, needles",
    [
        ({"sequence_length": 128}, ["sequence length 64", "expects 128"]),
        ({"max_predictions_per_seq": 20}, ["max_predictions_per_seq 10", "expects 20"]),
        ({"vocab_size": 30522}, ["vocabulary size 8192", "expects 30522"]),
        ({"vocab_sha256": "ab" * 32}, ["vocabulary sha256"]),
    ],
)
def test_mismatch_is_one_line_data_error(shard, kwargs, needles):
    with pytest.raises(DataError) as excinfo:
        read_shard(shard, **kwargs)
    one_line_error(excinfo, str(shard), *needles)
    assert isinstance(excinfo.value, ValueError)


def test_truncated_and_non_hdf5_files(shard, tmp_path):
    data = shard.read_bytes()
    truncated = tmp_path / "truncated.h5"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError) as excinfo:
        read_shard(truncated)
    one_line_error(excinfo, str(truncated))
    text = tmp_path / "text.h5"
    text.write_text("not hdf5\n")
    with pytest.raises(DataError) as excinfo:
        read_shard(text)
    one_line_error(excinfo, str(text), "not a readable HDF5 file")
    with pytest.raises(DataError) as excinfo:
        read_shard(tmp_path / "absent.h5")
    one_line_error(excinfo, "absent.h5", "not found")


def test_plain_nvidia_layout_without_attributes_loads(tmp_path, arrays):
    path = tmp_path / "nvidia.hdf5"
    n = len(arrays["input_ids"])
    with h5py.File(path, "w") as f:
        for name in FEATURE_NAMES:
            f.create_dataset(name, data=arrays[name].astype(np.int64), compression="gzip")
    info = read_shard_info(path)
    assert (info.num_samples, info.sequence_length, info.max_predictions_per_seq) == (n, 64, 10)
    assert info.vocab_size is None and info.schema_version is None and info.attrs == {}
    back = read_shard(
        path,
        sequence_length=64,
        max_predictions_per_seq=10,
        vocab_size=8192,
        vocab_sha256="unknown-to-this-shard",
    )
    for name in FEATURE_NAMES:
        assert np.array_equal(back[name], arrays[name])
    # Without a recorded size, ids are checked against the run's vocabulary by value.
    with pytest.raises(DataError) as excinfo:
        read_shard(path, vocab_size=100)
    one_line_error(excinfo, str(path), "outside the run's vocabulary of 100")
    with pytest.raises(DataError, match="sequence length 64"):
        read_shard(path, sequence_length=128)


def test_nsp_labels_stored_as_column_are_flattened(tmp_path, arrays):
    path = tmp_path / "column.h5"
    with h5py.File(path, "w") as f:
        for name in FEATURE_NAMES:
            data = arrays[name]
            if name == "next_sentence_labels":
                data = data.reshape(-1, 1)
            f.create_dataset(name, data=data)
    back = read_shard(path)
    assert np.array_equal(back["next_sentence_labels"], arrays["next_sentence_labels"])


def test_inconsistent_or_incomplete_shards(tmp_path, arrays):
    missing = tmp_path / "missing.h5"
    with h5py.File(missing, "w") as f:
        for name in FEATURE_NAMES[:-1]:
            f.create_dataset(name, data=arrays[name])
    with pytest.raises(DataError) as excinfo:
        read_shard(missing)
    one_line_error(excinfo, str(missing), "missing datasets next_sentence_labels")

    lying = tmp_path / "lying.h5"
    write_shard(lying, arrays, extra_attrs={"note": "x"})
    with h5py.File(lying, "a") as f:
        f.attrs["sequence_length"] = 128
    with pytest.raises(DataError) as excinfo:
        read_shard(lying)
    one_line_error(excinfo, str(lying), "attribute sequence_length=128", "have 64")

    ragged = dict(arrays)
    ragged["segment_ids"] = ragged["segment_ids"][:, :32]
    with pytest.raises(DataError, match="segment_ids has shape"):
        write_shard(tmp_path / "ragged.h5", ragged)

    bad_pos = {k: v.copy() for k, v in arrays.items()}
    bad_pos["masked_lm_positions"][0, 0] = 64
    write_shard(tmp_path / "bad_pos.h5", bad_pos)
    with pytest.raises(DataError, match="masked_lm_positions outside"):
        read_shard(tmp_path / "bad_pos.h5")

    with pytest.raises(DataError, match="options.sequence_length=128"):
        write_shard(tmp_path / "x.h5", arrays, options=InstanceOptions())


def test_newer_schema_is_refused(tmp_path, arrays):
    path = write_shard(
        tmp_path / "future.h5", arrays, extra_attrs={"schema_version": SCHEMA_VERSION + 1}
    )
    with pytest.raises(DataError, match="newer than this popbert reads"):
        read_shard(path)
