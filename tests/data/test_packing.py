"""Sequence packing (strategies, packed rows), packed shards, and the lazy shard loader
(shuffling across and within shards, replica shares, resume mid-epoch)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from bert_helpers import small_config
from loader_helpers import epoch_order

from popbert.builders.bert import build_bert
from popbert.config import load_config
from popbert.data import DataError, PretrainingLoader, read_shard, read_shard_info, write_shard
from popbert.data.packing import (
    NSP_IGNORE,
    STRATEGIES,
    default_max_predictions_per_pack,
    histogram_packing,
    length_histogram,
    pack_instance_arrays,
)
from popbert.data.pretraining import ShardSet, load_training_data, make_loader
from popbert.runtime.session import TrainingSession


def unpacked(n: int, seq: int = 32, pred: int = 5, seed: int = 0, short: bool = True):
    """Rows with token i of row r = 1000*r + i (traceable), lengths skewed short."""
    rng = np.random.default_rng(seed)
    a = {"input_ids": np.zeros((n, seq), np.int32), "input_mask": np.zeros((n, seq), np.int32),
         "segment_ids": np.zeros((n, seq), np.int32),
         "masked_lm_positions": np.zeros((n, pred), np.int32),
         "masked_lm_ids": np.zeros((n, pred), np.int32),
         "next_sentence_labels": rng.integers(0, 2, n).astype(np.int32)}
    high = seq // 2 if short else seq
    for r in range(n):
        length = int(rng.integers(3, high + 1))
        a["input_ids"][r, :length] = 1000 * r + np.arange(length) + 1
        a["input_mask"][r, :length] = 1
        a["segment_ids"][r, length // 2:length] = 1
        k = int(rng.integers(1, min(pred, length - 1) + 1))
        a["masked_lm_positions"][r, :k] = np.sort(rng.choice(np.arange(1, length), k, False))
        a["masked_lm_ids"][r, :k] = rng.integers(5, 100, k)
    return a


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("k", [1, 2, 3])
def test_strategies_place_every_sequence_once_within_limits(strategy, k):
    rng = np.random.default_rng(k)
    seq = 128
    # Wikipedia-like: a peak at full length and a long tail of short sequences.
    lengths = np.concatenate([np.full(300, seq), rng.integers(8, seq, 700)])
    hist = length_histogram(lengths, seq)
    shapes = histogram_packing(hist, seq, k, strategy)
    placed = np.zeros(seq + 1, np.int64)
    for shape, count in shapes:
        assert count > 0 and 1 <= len(shape) <= k and sum(shape) <= seq
        for length in shape:
            placed[length] += count
    assert np.array_equal(placed, hist)
    packs = sum(count for _, count in shapes)
    if k == 1:
        assert packs == len(lengths)
    else:
        assert packs < len(lengths)
        # Never worse than the lower bound by much: tokens / capacity.
        assert packs <= 1.25 * np.ceil(lengths.sum() / seq) + 1


def test_packing_halves_padding_on_short_sequences():
    a = unpacked(400, seq=64, short=True, seed=3)
    packed, stats = pack_instance_arrays(a, max_sequences_per_pack=3, masked_lm_prob=None, seed=0)
    # Mostly bounded by 3 sequences per row here: within 5% of n / 3 rows.
    assert stats.padding_before > 0.7 and stats.padding_after < stats.padding_before / 2
    assert stats.packs <= 1.05 * 400 / 3 and len(packed["input_ids"]) == stats.packs


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_packed_rows_hold_the_original_sequences(strategy):
    a = unpacked(120, seed=5)
    k = 3
    packed, stats = pack_instance_arrays(a, strategy=strategy, max_sequences_per_pack=k,
                                         masked_lm_prob=None, seed=9)
    seq = a["input_ids"].shape[1]
    seen = []
    for row in range(stats.packs):
        index = packed["sequence_index"][row]
        assert np.all((index > 0) == (packed["input_mask"][row] == 1))
        # Real tokens first, then padding; sequences numbered in order.
        real = int((index > 0).sum())
        assert np.all(index[:real] > 0) and np.all(index[real:] == 0)
        assert np.all(np.diff(index[:real]) >= 0)
        for slot in range(k):
            where = np.nonzero(index == slot + 1)[0]
            if not len(where):
                assert packed["next_sentence_labels"][row, slot] == NSP_IGNORE
                continue
            start = packed["cls_positions"][row, slot]
            assert start == where[0] and np.array_equal(where, np.arange(start, start + len(where)))
            src = int(packed["input_ids"][row, start]) // 1000
            length = int(a["input_mask"][src].sum())
            assert len(where) == length
            assert np.array_equal(packed["input_ids"][row, where], a["input_ids"][src, :length])
            assert np.array_equal(packed["segment_ids"][row, where], a["segment_ids"][src, :length])
            assert np.array_equal(packed["position_ids"][row, where], np.arange(length))
            assert packed["next_sentence_labels"][row, slot] == a["next_sentence_labels"][src]
            used = a["masked_lm_ids"][src] != 0
            mine = np.isin(packed["masked_lm_positions"][row], where) & (
                packed["masked_lm_ids"][row] != 0)
            assert np.array_equal(packed["masked_lm_positions"][row][mine],
                                  a["masked_lm_positions"][src][used] + start)
            assert np.array_equal(packed["masked_lm_ids"][row][mine], a["masked_lm_ids"][src][used])
            seen.append(src)
    assert sorted(seen) == list(range(120))
    assert packed["masked_lm_positions"].max() < seq


def test_pack_arguments_and_bounds():
    a = unpacked(50, seed=1)
    with pytest.raises(DataError, match="unknown packing strategy"):
        pack_instance_arrays(a, strategy="magic")
    with pytest.raises(DataError, match="max_predictions_per_pack=2"):
        pack_instance_arrays(a, max_predictions_per_pack=2)
    # S * prob + k bounds what a pack of Google-masked sequences can need.
    assert default_max_predictions_per_pack(128, 20, 3, 0.15) == 22
    assert default_max_predictions_per_pack(512, 76, 3, 0.15) == 79
    assert default_max_predictions_per_pack(128, 20, 3, None) == 60


def test_packed_shard_round_trip_and_checks(tmp_path):
    packed, _ = pack_instance_arrays(unpacked(60, seed=2), max_sequences_per_pack=3,
                                     max_predictions_per_pack=15, seed=0)
    path = write_shard(tmp_path / "p.h5", packed, vocab_size=100000)
    info = read_shard_info(path)
    assert info.packed and info.max_sequences_per_pack == 3 and info.attrs["packed"] == 1
    back = read_shard(path, packed=True, max_sequences_per_pack=3)
    assert back["next_sentence_labels"].shape == (len(packed["input_ids"]), 3)
    assert all(np.array_equal(back[k], packed[k]) for k in packed)
    with pytest.raises(DataError, match="packs up to 3 sequences per row, run expects 2"):
        read_shard(path, max_sequences_per_pack=2)
    with pytest.raises(DataError, match="a packed shard, but the model is not"):
        read_shard(path, packed=False)
    del packed["cls_positions"]
    with pytest.raises(DataError, match="lacks datasets cls_positions"):
        write_shard(tmp_path / "q.h5", packed)


def write_shards(tmp_path, sizes, seq=8):
    data = unpacked(sum(sizes), seq=seq, pred=2, seed=4)
    # Trace samples by global id in input_ids[:, 1].
    data["input_ids"][:, 1] = np.arange(sum(sizes))
    start = 0
    for i, size in enumerate(sizes):
        write_shard(tmp_path / f"part-{i:05d}.h5", {k: v[start:start + size]
                                                      for k, v in data.items()})
        start += size
    return str(tmp_path / "part-*.h5")


def ids(batch) -> list[int]:
    return batch["input_ids"][:, 1].tolist()


def test_lazy_loader_shuffles_across_and_within_shards(tmp_path):
    pattern = write_shards(tmp_path, [10, 7, 13, 1, 9])
    loader = PretrainingLoader(pattern, 8, seed=3, as_numpy=True)
    assert loader.num_samples == 40 and loader.steps_per_epoch == 5
    first = [ids(next(loader)) for _ in range(5)]
    flat = sum(first, [])
    assert sorted(flat) == list(range(40))
    # Shards are visited whole, in a shuffled order, each in a shuffled order of rows.
    bounds = np.cumsum([0, 10, 7, 13, 1, 9])
    shard_of = np.searchsorted(bounds, flat, side="right") - 1
    runs = [s for s, _ in itertools.groupby(shard_of)]
    assert sorted(runs) == [0, 1, 2, 3, 4] and runs != [0, 1, 2, 3, 4]
    assert flat[:10] != sorted(flat[:10])
    second = [ids(next(loader)) for _ in range(5)]
    assert second != first and sorted(sum(second, [])) == list(range(40))
    again = PretrainingLoader(pattern, 8, seed=3, as_numpy=True)
    assert [ids(next(again)) for _ in range(5)] == first
    assert np.array_equal(epoch_order(loader, 0), np.array(flat))
    loader.close()


@pytest.mark.parametrize("consumed", [0, 2, 6, 11])
def test_lazy_loader_resume_and_replica_shares(tmp_path, consumed):
    pattern = write_shards(tmp_path, [10, 7, 13, 1, 9])
    kwargs = {"micro_batch_size": 3, "seed": 11, "num_replicas": 2, "as_numpy": True}
    for replica in range(2):
        straight = PretrainingLoader(pattern, replica_index=replica, **kwargs)
        stopped = PretrainingLoader(pattern, replica_index=replica, **kwargs)
        for _ in range(consumed):
            next(stopped)
        state = stopped.state_dict()
        expected = [ids(next(straight)) for _ in range(consumed + 8)][consumed:]
        resumed = PretrainingLoader(pattern, replica_index=replica, prefetch_shards=0, **kwargs)
        resumed.load_state_dict(state)
        assert [ids(next(resumed)) for _ in range(8)] == expected
        assert resumed.state_dict() == straight.state_dict()
    # One epoch: the replicas' shares are disjoint.
    shares = []
    for replica in range(2):
        lo = PretrainingLoader(pattern, replica_index=replica, **kwargs)
        shares.append(sum((ids(next(lo)) for _ in range(lo.steps_per_epoch)), []))
    assert not set(shares[0]) & set(shares[1])
    assert len(shares[0]) == len(shares[1]) == 18


def test_lazy_loader_checks_every_shard_up_front(tmp_path):
    pattern = write_shards(tmp_path, [5, 5])
    broken = tmp_path / "part-00001.h5"
    broken.write_bytes(broken.read_bytes()[:200])
    with pytest.raises(DataError, match="part-00001.h5"):
        PretrainingLoader(pattern, 2, seed=0)


@pytest.fixture
def packed_shards(tmp_path):
    a = unpacked(90, seq=32, pred=4, seed=7)
    a["input_ids"] = (a["input_ids"] % 250) + 5
    a["input_ids"][:, 0] = 2
    for i, part in enumerate((slice(0, 50), slice(50, 90))):
        packed, _ = pack_instance_arrays({k: v[part] for k, v in a.items()},
                                         max_sequences_per_pack=3,
                                         max_predictions_per_pack=12, seed=i)
        write_shard(tmp_path / f"part-{i:05d}.h5", packed, vocab_size=300)
    return tmp_path


def test_packed_shards_feed_the_packed_model(packed_shards, tmp_path):
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
                               + [f"w{i}" for i in range(295)]) + "\n")
    cfg = load_config("tiny", [
        f"data.input_files=['{packed_shards}/part-*.h5']", f"data.vocab_file={vocab}",
        "model.vocab_size=300", "model.hidden_size=64", "model.num_layers=2",
        "model.num_heads=4", "model.intermediate_size=128", "model.sequence_length=32",
        "model.max_position_embeddings=64", "model.max_predictions_per_seq=12",
        "model.packed=true", "model.max_sequences_per_pack=3", "execution.micro_batch_size=8",
        "model.hidden_dropout=0.0", "model.attention_dropout=0.0"])
    data = load_training_data(cfg)
    assert isinstance(data, ShardSet) and len(data.paths) == 2
    loader = make_loader(cfg, data)
    config = small_config(max_predictions_per_seq=12, packed=True, max_sequences_per_pack=3)
    session = TrainingSession(build_bert(config, seed=0).model(), "loss",
                              lambda p: torch.optim.Adam([x for _, x in p], lr=3e-3))
    batch = next(loader)
    assert batch["next_sentence_labels"].shape == (8, 3)
    losses = [float(session.run(batch)["loss"][0]) for _ in range(8)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    loader.close()

    unpacked_cfg = load_config("tiny", [
        f"data.input_files=['{packed_shards}/part-*.h5']", f"data.vocab_file={vocab}",
        "model.vocab_size=300", "model.sequence_length=32", "model.max_position_embeddings=64",
        "model.max_predictions_per_seq=12"])
    with pytest.raises(DataError, match="a packed shard, but the model is not"):
        load_training_data(unpacked_cfg)
