"""The resumable loader (replica sharding, epochs, resume) and the cached instance builder."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from loader_helpers import epoch_order

import popbert.data.loader as loader_mod
from popbert.data import (
    FEATURE_NAMES,
    DataError,
    PretrainingLoader,
    bundled_corpus_path,
    load_or_create_instances,
    read_shard_info,
    write_shard,
)


def synthetic(n: int, seq: int = 8, pred: int = 2) -> dict[str, np.ndarray]:
    """Arrays whose input_ids[:, 1] is the sample index, so batches can be traced."""
    ids = np.zeros((n, seq), dtype=np.int32)
    ids[:, 0] = 2
    ids[:, 1] = np.arange(n)
    return {
        "input_ids": ids,
        "input_mask": np.ones((n, seq), dtype=np.int32),
        "segment_ids": np.zeros((n, seq), dtype=np.int32),
        "masked_lm_positions": np.ones((n, pred), dtype=np.int32),
        "masked_lm_ids": np.full((n, pred), 7, dtype=np.int32),
        "next_sentence_labels": (np.arange(n) % 2).astype(np.int32),
    }


def sample_ids(batch) -> list[int]:
    return batch["input_ids"][:, 1].tolist()


def epoch_ids(loader: PretrainingLoader) -> list[list[int]]:
    return [sample_ids(next(loader)) for _ in range(loader.steps_per_epoch)]


def test_batches_are_int64_tensors_with_right_shapes():
    loader = PretrainingLoader(synthetic(20), micro_batch_size=4, seed=0)
    batch = next(loader)
    assert set(batch) == set(FEATURE_NAMES)
    assert all(isinstance(v, torch.Tensor) and v.dtype == torch.int64 for v in batch.values())
    assert batch["input_ids"].shape == (4, 8) and batch["masked_lm_ids"].shape == (4, 2)
    assert batch["next_sentence_labels"].shape == (4,)
    ids = sample_ids(batch)
    assert batch["next_sentence_labels"].tolist() == [i % 2 for i in ids]
    as_np = next(PretrainingLoader(synthetic(20), 4, seed=0, as_numpy=True))
    assert as_np["input_ids"].dtype == np.int64
    assert sample_ids(as_np) == ids


@pytest.mark.parametrize("n, replicas, mb", [(100, 4, 5), (103, 4, 5), (64, 2, 8)])
def test_replicas_disjoint_and_covering_with_drop_last(n, replicas, mb):
    loaders = [
        PretrainingLoader(synthetic(n), mb, seed=11, replica_index=r, num_replicas=replicas)
        for r in range(replicas)
    ]
    steps = n // (mb * replicas)
    assert all(lo.steps_per_epoch == steps for lo in loaders)
    seen = [sorted(itertools.chain.from_iterable(epoch_ids(lo))) for lo in loaders]
    union = set().union(*map(set, seen))
    assert sum(len(s) for s in seen) == len(union) == steps * mb * replicas  # disjoint
    if n % (mb * replicas) == 0:
        assert union == set(range(n))  # covering
    # Each replica's epoch equals its slice of the single-process global batches.
    single = PretrainingLoader(synthetic(n), mb * replicas, seed=11)
    for step in range(steps):
        global_batch = sample_ids(next(single))
        for r, lo in enumerate(loaders):
            assert epoch_ids_at(lo, step) == global_batch[r * mb : (r + 1) * mb]


def epoch_ids_at(loader: PretrainingLoader, step: int) -> list[int]:
    start = step * loader.global_batch_size + loader.replica_index * loader.micro_batch_size
    return epoch_order(loader, 0)[start : start + loader.micro_batch_size].tolist()


def test_without_drop_last_every_sample_is_seen_and_batches_stay_full():
    n, replicas, mb = 23, 3, 4
    loaders = [
        PretrainingLoader(
            synthetic(n), mb, seed=5, replica_index=r, num_replicas=replicas, drop_last=False
        )
        for r in range(replicas)
    ]
    assert all(lo.steps_per_epoch == 2 for lo in loaders)
    batches = [epoch_ids(lo) for lo in loaders]
    assert all(len(b) == mb for per in batches for b in per)
    flat = [i for per in batches for b in per for i in b]
    assert set(flat) == set(range(n)) and len(flat) == 24
    # Small data with more replicas than samples still works by wrapping.
    tiny = PretrainingLoader(synthetic(3), 4, seed=0, drop_last=False, num_replicas=2)
    assert len(sample_ids(next(tiny))) == 4


def test_epochs_reshuffle_and_are_seeded():
    lo = PretrainingLoader(synthetic(40), 8, seed=1)
    first, second = epoch_ids(lo), epoch_ids(lo)
    assert sorted(sum(first, [])) == sorted(sum(second, [])) == list(range(40))
    assert first != second
    assert lo.state_dict()["epoch"] == 1
    assert epoch_ids(PretrainingLoader(synthetic(40), 8, seed=1)) == first
    assert epoch_ids(PretrainingLoader(synthetic(40), 8, seed=2)) != first
    ordered = PretrainingLoader(synthetic(40), 8, seed=1, shuffle=False)
    assert sum(epoch_ids(ordered), []) == list(range(40))


@pytest.mark.parametrize("consumed", [0, 3, 5, 7, 12])
def test_resume_gives_the_uninterrupted_batches(consumed):
    data = synthetic(42)  # 5 steps of 8 per epoch, 2 samples dropped: resume crosses epochs
    kwargs = {"micro_batch_size": 4, "seed": 123, "replica_index": 1, "num_replicas": 2}
    uninterrupted = PretrainingLoader(data, **kwargs)
    interrupted = PretrainingLoader(data, **kwargs)
    for _ in range(consumed):
        next(interrupted)
    state = interrupted.state_dict()
    assert set(state) >= {"epoch", "index"}
    expected = [next(uninterrupted) for _ in range(consumed + 9)][consumed:]
    resumed = PretrainingLoader(data, **kwargs)
    resumed.load_state_dict(dict(state))
    for want in expected:
        got = next(resumed)
        for name in FEATURE_NAMES:
            assert torch.equal(got[name], want[name])
    assert resumed.state_dict() == uninterrupted.state_dict()


def step_samples(loaders: list[PretrainingLoader], accumulation: int) -> list[int]:
    """The sample ids of one optimizer step over all replicas (their micro-batches pooled)."""
    return sorted(i for _ in range(accumulation) for lo in loaders
                  for i in sample_ids(next(lo)))


def layout(data, replicas: int, accumulation: int, **kwargs) -> list[PretrainingLoader]:
    return [PretrainingLoader(data, 4, seed=9, replica_index=r, num_replicas=replicas,
                              gradient_accumulation=accumulation, remask=_tag_mask, **kwargs)
            for r in range(replicas)]


def _tag_mask(batch, rng) -> None:
    """A stand-in for dynamic masking: the masked ids record the rng each row was masked with."""
    batch["masked_lm_ids"][:] = rng.integers(1, 1000, batch["masked_lm_ids"].shape)


@pytest.mark.parametrize("data_size", [44, 48])
def test_each_step_takes_the_same_samples_however_the_global_batch_is_split(data_size):
    """2 replicas, or 1 replica accumulating 2 micro-batches: the same global batch of 8 gives
    the same samples (and the same masks) step after step, across epochs (44 samples: the epoch
    ends on a whole step of 8, not at 11 micro-batches of 4)."""
    data = synthetic(data_size)
    reference = layout(data, 2, 1)
    other = layout(data, 1, 2)
    for _ in range(3 * data_size // 8):  # three epochs
        assert step_samples(reference, 1) == step_samples(other, 2)
    # The masks drawn for the same sample at the same place are the same too.
    a = layout(data, 2, 1)
    b = layout(data, 1, 2)
    masks_a = np.concatenate([next(lo)["masked_lm_ids"].numpy() for lo in a])
    masks_b = np.concatenate([next(b[0])["masked_lm_ids"].numpy() for _ in range(2)])
    assert np.array_equal(masks_a, masks_b)


@pytest.mark.parametrize("before, after", [((2, 1), (1, 2)), ((1, 2), (2, 1))])
def test_a_resume_with_other_replicas_at_the_same_global_batch_continues_the_samples(before,
                                                                                      after):
    data = synthetic(44)
    uninterrupted = layout(data, *before)
    interrupted = layout(data, *before)
    for _ in range(4):  # past the epoch's end (5 steps of 8) on the way
        step_samples(interrupted, before[1])
    expected = [step_samples(uninterrupted, before[1]) for _ in range(4 + 8)][4:]
    resumed = layout(data, *after)
    for lo in resumed:
        lo.load_state_dict(interrupted[0].state_dict())
    assert [step_samples(resumed, after[1]) for _ in range(8)] == expected


def test_a_resume_with_another_global_batch_is_refused_unless_allowed():
    data = synthetic(42)
    saved = layout(data, 2, 1)[0]
    next(saved)
    state = saved.state_dict()
    with pytest.raises(DataError, match=r"global batch of 8 samples per step, this run takes 16 "
                                        r".*data.reorder_on_resume: true"):
        layout(data, 2, 2)[0].load_state_dict(state)
    layout(data, 2, 2, allow_reorder=True)[0].load_state_dict(state)


def test_bad_states_and_arguments_are_refused():
    lo = PretrainingLoader(synthetic(40), 8, seed=1)
    with pytest.raises(DataError, match="saved on 41 samples"):
        lo.load_state_dict({"epoch": 0, "index": 0, "num_samples": 41})
    with pytest.raises(DataError, match="out of range"):
        lo.load_state_dict({"epoch": 0, "index": 48})
    with pytest.raises(DataError, match="lacks integer epoch/index"):
        lo.load_state_dict({"epoch": 0})
    with pytest.raises(DataError, match="fewer than one global batch"):
        PretrainingLoader(synthetic(7), 4, seed=0, num_replicas=2)
    with pytest.raises(ValueError, match="replica_index"):
        PretrainingLoader(synthetic(8), 4, seed=0, replica_index=2, num_replicas=2)
    bad = synthetic(8)
    del bad["masked_lm_ids"]
    with pytest.raises(DataError, match="masked_lm_ids"):
        PretrainingLoader(bad, 4, seed=0)


def test_loads_shards_by_glob_in_sorted_order_with_checks(tmp_path):
    data = synthetic(30)
    first = {k: v[:20] for k, v in data.items()}
    second = {k: v[20:] for k, v in data.items()}
    write_shard(tmp_path / "part_1.h5", second, vocab_size=100)
    write_shard(tmp_path / "part_0.h5", first, vocab_size=100)
    lo = PretrainingLoader(
        str(tmp_path / "part_*.h5"), 10, seed=0, shuffle=False, sequence_length=8, vocab_size=100
    )
    assert lo.num_samples == 30
    assert sum(epoch_ids(lo), []) == list(range(30))
    with pytest.raises(DataError, match="part_0.h5: sequence length 8, run expects 16"):
        PretrainingLoader(str(tmp_path / "part_*.h5"), 10, seed=0, sequence_length=16)


@pytest.fixture
def small_corpus(tmp_path):
    """The first 80 bundled documents, as a separate Google-format file."""
    text = bundled_corpus_path().read_text(encoding="utf-8")
    path = tmp_path / "corpus.txt"
    path.write_text("\n\n".join(text.split("\n\n")[:80]) + "\n", encoding="utf-8")
    return path


def test_load_or_create_instances_caches(tmp_path, small_corpus, monkeypatch):
    cache = tmp_path / "cache"
    arrays = load_or_create_instances(small_corpus, None, 64, 10, seed=3, cache_dir=cache)
    files = list(cache.glob("*.h5"))
    assert len(files) == 1 and files[0].name.startswith("instances-s64-p10-")
    info = read_shard_info(files[0])
    assert info.attrs["seed"] == 3 and info.vocab_size == 8192

    def fail(*args, **kwargs):
        raise AssertionError("cache not used")

    monkeypatch.setattr(loader_mod, "create_corpus_arrays", fail)
    cached = load_or_create_instances(small_corpus, None, 64, 10, seed=3, cache_dir=cache)
    for name in FEATURE_NAMES:
        assert np.array_equal(cached[name], arrays[name])
    with pytest.raises(AssertionError, match="cache not used"):  # another seed: another key
        load_or_create_instances(small_corpus, None, 64, 10, seed=4, cache_dir=cache)
    monkeypatch.undo()

    files[0].write_bytes(b"corrupt")  # an unusable cache is rebuilt, not trusted
    rebuilt = load_or_create_instances(small_corpus, None, 64, 10, seed=3, cache_dir=cache)
    for name in FEATURE_NAMES:
        assert np.array_equal(rebuilt[name], arrays[name])
    assert read_shard_info(files[0]).num_samples == len(arrays["input_ids"])

    with small_corpus.open("a", encoding="utf-8") as f:  # changed input: new key
        f.write("\nA new document.\nWith two sentences.\n")
    load_or_create_instances(small_corpus, None, 64, 10, seed=3, cache_dir=cache)
    assert len(list(cache.glob("*.h5"))) == 2


def test_bundled_instances_feed_the_loader(tmp_path, monkeypatch):
    monkeypatch.setenv("POPBERT_CACHE_DIR", str(tmp_path))
    arrays = load_or_create_instances(None, None, 128, 20, seed=0, use_cache=False)
    assert arrays["input_ids"].shape[1] == 128 and len(arrays["input_ids"]) > 4000
    lo = PretrainingLoader(arrays, 16, seed=0)
    batch = next(lo)
    assert batch["input_ids"].shape == (16, 128)
    assert (batch["input_ids"] < 8192).all() and (batch["input_ids"][:, 0] == 2).all()
    assert not list(tmp_path.iterdir())  # use_cache=False writes nothing


def test_default_cache_dir_respects_environment(tmp_path, monkeypatch):
    monkeypatch.setenv("POPBERT_CACHE_DIR", str(tmp_path / "pb"))
    assert loader_mod.default_cache_dir() == tmp_path / "pb"
    monkeypatch.delenv("POPBERT_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert loader_mod.default_cache_dir() == tmp_path / "xdg" / "popbert"
