"""MLM-only data (`model.next_sentence_prediction: false`): full rows of contiguous text, and
dynamic masking (`data.dynamic_masking`), on the bundled corpus."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from popbert.data import (
    FEATURE_NAMES,
    InstanceOptions,
    PretrainingLoader,
    WordPieceTokenizer,
    bundled_corpus_path,
    create_instance_arrays,
    create_pretraining_arrays,
    read_documents,
)
from popbert.data.instances import mask_arrays, unmask_rows

SEQ = 64


@pytest.fixture(scope="module")
def tokenizer() -> WordPieceTokenizer:
    return WordPieceTokenizer()


@pytest.fixture(scope="module")
def documents(tokenizer):
    return read_documents(bundled_corpus_path(), tokenizer)[:300]


@pytest.fixture(scope="module")
def options() -> InstanceOptions:
    return InstanceOptions(sequence_length=SEQ, max_predictions_per_seq=10, seed=5,
                           next_sentence=False)


@pytest.fixture(scope="module")
def chunks(documents, tokenizer, options):
    return create_pretraining_arrays(documents, tokenizer, options)


def test_rows_are_the_corpus_back_to_back(chunks, documents, tokenizer, options):
    """Unmasked and concatenated, the rows are every document's tokens once, each document
    followed by [SEP], in some document order; every row but one is full, segments are 0."""
    arrays = {k: v.copy() for k, v in chunks.items()}
    unmask_rows(arrays)
    lengths = arrays["input_mask"].sum(axis=1)
    assert (lengths == SEQ).sum() == len(lengths) - 1  # only the last row of the pass is short
    assert not arrays["segment_ids"].any() and not arrays["next_sentence_labels"].any()
    ids = arrays["input_ids"]
    assert (ids[:, 0] == tokenizer.cls_id).all()
    assert (ids[np.arange(len(ids)), lengths - 1] == tokenizer.sep_id).all()
    body = [ids[r, 1:lengths[r] - 1] for r in range(len(ids))]
    tokens = np.concatenate(body)
    expected = sum(len(t) for d in documents for t in d) + len(documents)
    assert len(tokens) == expected
    assert (tokens == tokenizer.sep_id).sum() == len(documents)
    assert sorted(tokens.tolist()) == sorted(
        [t for d in documents for sentence in d for t in sentence]
        + [tokenizer.sep_id] * len(documents))
    # Rows are cut from one stream and then shuffled: a short sentence lies whole in one row
    # unless a cut falls inside it (about 40% of 25-token sentences in 62-token rows).
    rows = [b.tolist() for b in body]
    short = [d[0] for d in documents if 10 <= len(d[0]) <= 25]
    whole = sum(any(_contains(row, sentence) for row in rows) for sentence in short)
    assert len(short) > 50 and whole > 0.45 * len(short)


def _contains(row: list[int], part: list[int]) -> bool:
    return any(row[i:i + len(part)] == part for i in range(len(row) - len(part) + 1))


def test_masking_follows_the_rate_on_full_rows(chunks, options):
    used = (chunks["masked_lm_ids"] != 0).sum(axis=1)
    full = chunks["input_mask"].sum(axis=1) == SEQ
    # round(64 * 0.15) = 10 predictions per full row (whole words may leave one short).
    assert np.all(used[full] <= 10) and used[full].mean() > 9.5


def test_pair_layout_is_unchanged_by_the_option(documents, tokenizer):
    """The sentence-pair path and its cache keys do not see the new option when it is on."""
    pairs = create_instance_arrays(documents, tokenizer, InstanceOptions(sequence_length=SEQ,
                                                                         seed=5))
    assert pairs["segment_ids"].any()
    assert "next_sentence" not in InstanceOptions().as_dict()
    assert InstanceOptions(next_sentence=False).as_dict()["next_sentence"] is False


def _remask(tokenizer, options):
    def remask(batch, rng):
        mask_arrays(batch, tokenizer, options, rng)
    return remask


def test_dynamic_masking_masks_each_epoch_anew_and_resumes(chunks, tokenizer, options):
    data = {k: v[:40] for k, v in chunks.items()}
    kwargs = dict(micro_batch_size=8, seed=3, remask=_remask(tokenizer, options))
    loader = PretrainingLoader(data, **kwargs)
    epoch0 = [next(loader) for _ in range(5)]
    epoch1 = [next(loader) for _ in range(5)]
    # The text of each row is untouched: unmasked, the batches are the stored rows.
    stored = {k: v.copy() for k, v in data.items()}
    unmask_rows(stored)
    originals = {tuple(row) for row in stored["input_ids"].tolist()}
    for batch in epoch0 + epoch1:
        restored = {k: v.numpy().copy() for k, v in batch.items()}
        unmask_rows(restored)
        assert {tuple(row) for row in restored["input_ids"].tolist()} <= originals
        used = (batch["masked_lm_ids"] != 0).sum(dim=1)
        assert (used >= 1).all() and (used <= 10).all()
    # Same row in two epochs: different masks (static masking would repeat them).
    def masks_by_row(batches):
        out = {}
        for batch in batches:
            restored = {k: v.numpy().copy() for k, v in batch.items()}
            unmask_rows(restored)
            for row, positions in zip(restored["input_ids"].tolist(),
                                      batch["masked_lm_positions"].tolist()):
                out[tuple(row)] = positions
        return out
    first, second = masks_by_row(epoch0), masks_by_row(epoch1)
    assert sum(first[k] != second[k] for k in first) > 0.9 * len(first)
    # Negative control: without remask the loader repeats the stored masks every epoch.
    static = PretrainingLoader(data, micro_batch_size=8, seed=3)
    s0 = masks_by_row([next(static) for _ in range(5)])
    s1 = masks_by_row([next(static) for _ in range(5)])
    assert s0 == s1
    # Resume mid-epoch: the same batches, masks included.
    resumed = PretrainingLoader(data, **kwargs)
    again = PretrainingLoader(data, **kwargs)
    for _ in range(7):
        next(again)
    resumed.load_state_dict(again.state_dict())
    for _ in range(4):
        want, got = next(again), next(resumed)
        for name in FEATURE_NAMES:
            assert torch.equal(got[name], want[name])
