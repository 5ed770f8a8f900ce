"""Google's pre-training instance algorithm on the bundled corpus: shapes, statistics, semantics."""

from __future__ import annotations

import random

import numpy as np
import pytest

from popbert.data import (
    FEATURE_NAMES,
    DataError,
    InstanceCreator,
    InstanceOptions,
    TrainingInstance,
    WordPieceTokenizer,
    bundled_corpus_path,
    create_instance_arrays,
    create_pretraining_arrays,
    instances_to_arrays,
    read_documents,
    truncate_seq_pair,
)

SEQ = 128
PRED = 20


@pytest.fixture(scope="module")
def tokenizer() -> WordPieceTokenizer:
    return WordPieceTokenizer()


@pytest.fixture(scope="module")
def documents(tokenizer):
    return read_documents(bundled_corpus_path(), tokenizer)


@pytest.fixture(scope="module")
def arrays(documents, tokenizer):
    return create_pretraining_arrays(documents, tokenizer, InstanceOptions(seed=1))


@pytest.fixture(scope="module")
def flat_corpus(tokenizer) -> str:
    """The corpus as the tokenizer sees it, all whitespace removed: decoded text must be in it."""
    text = tokenizer.backend.normalizer.normalize_str(
        bundled_corpus_path().read_text(encoding="utf-8"))
    return "".join(text.split())


def lengths(a):
    return a["input_mask"].sum(axis=1)


def prediction_mask(a):
    """[N, P] True where a prediction slot is used (labels are never [PAD]=0)."""
    return a["masked_lm_ids"] != 0


def original_ids(a):
    """input_ids with the masked positions restored to their labels."""
    ids = a["input_ids"].copy()
    rows, cols = np.nonzero(prediction_mask(a))
    ids[rows, a["masked_lm_positions"][rows, cols]] = a["masked_lm_ids"][rows, cols]
    return ids


def squash(tokenizer, ids) -> list[str]:
    """Decode ids without whitespace ("##" joined); split at [UNK], whose text is unknown."""
    tokens = [tokenizer.backend.id_to_token(int(i)) for i in ids]
    text = "".join(t[2:] if t.startswith("##") else t for t in tokens)
    return [p for p in text.split("[UNK]") if p]


def segments(row_ids, sep_id):
    seps = np.nonzero(row_ids == sep_id)[0]
    return row_ids[1 : seps[0]], row_ids[seps[0] + 1 : seps[1]]


def test_shapes_dtypes_and_layout(arrays, tokenizer):
    n = arrays["input_ids"].shape[0]
    assert 4000 < n < 8000
    assert set(arrays) == set(FEATURE_NAMES)
    for name in ("input_ids", "input_mask", "segment_ids"):
        assert arrays[name].shape == (n, SEQ) and arrays[name].dtype == np.int32
    for name in ("masked_lm_positions", "masked_lm_ids"):
        assert arrays[name].shape == (n, PRED) and arrays[name].dtype == np.int32
    assert arrays["next_sentence_labels"].shape == (n,)

    ids, mask, seg = arrays["input_ids"], arrays["input_mask"], arrays["segment_ids"]
    length = lengths(arrays)
    cols = np.arange(SEQ)[None, :]
    assert np.array_equal(mask, (cols < length[:, None]).astype(np.int32))
    assert (ids[mask == 0] == tokenizer.pad_id).all() and (seg[mask == 0] == 0).all()
    assert (ids[:, 0] == tokenizer.cls_id).all()
    assert ((ids == tokenizer.sep_id).sum(axis=1) == 2).all()
    assert (ids[np.arange(n), length - 1] == tokenizer.sep_id).all()
    assert (ids[mask == 1] != tokenizer.pad_id).all()
    assert (ids >= 0).all() and (ids < tokenizer.vocab_size).all()
    assert (arrays["masked_lm_ids"] < tokenizer.vocab_size).all()
    assert set(np.unique(arrays["next_sentence_labels"])) == {0, 1}
    for row in range(0, n, 97):
        first_sep = int(np.nonzero(ids[row] == tokenizer.sep_id)[0][0])
        assert (seg[row, : first_sep + 1] == 0).all()
        assert (seg[row, first_sep + 1 : length[row]] == 1).all()
        assert first_sep >= 2 and length[row] - first_sep >= 3  # A and B non-empty
    # Short target lengths (short_seq_prob=0.1) make some clearly short sequences.
    assert 0.03 < (length < SEQ // 2).mean() < 0.5


def test_mask_count_rate_and_positions(arrays, tokenizer):
    used = prediction_mask(arrays)
    pos = arrays["masked_lm_positions"]
    length = lengths(arrays)
    # Google: min(max_predictions, max(1, round(len(tokens) * 0.15))), len with [CLS]/[SEP].
    expected = np.minimum(PRED, np.maximum(1, np.round(length * 0.15).astype(int)))
    assert np.array_equal(used.sum(axis=1), expected)
    # Used slots come first, padding slots are position 0 / label [PAD].
    assert np.array_equal(used, np.arange(PRED)[None, :] < expected[:, None])
    assert (pos[~used] == 0).all()
    for row in range(len(pos)):
        p = pos[row, : expected[row]]
        assert (np.diff(p) > 0).all() and p[0] >= 1 and p[-1] < length[row] - 1
    # 15% of the eligible (non-[CLS]/[SEP]) tokens, give or take rounding and the cap.
    rate = used.sum() / (length - 3).sum()
    assert 0.14 < rate < 0.165


def test_never_masks_structure_tokens(arrays, tokenizer):
    used = prediction_mask(arrays)
    rows, cols = np.nonzero(used)
    positions = arrays["masked_lm_positions"][rows, cols]
    labels = arrays["masked_lm_ids"][rows, cols]
    structure = [tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id, tokenizer.mask_id]
    assert not np.isin(labels, structure).any()
    current = arrays["input_ids"][rows, positions]
    assert not np.isin(current, [tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id]).any()
    assert (arrays["input_mask"][rows, positions] == 1).all()


def test_80_10_10_split(arrays, tokenizer):
    used = prediction_mask(arrays)
    rows, cols = np.nonzero(used)
    positions = arrays["masked_lm_positions"][rows, cols]
    labels = arrays["masked_lm_ids"][rows, cols]
    current = arrays["input_ids"][rows, positions]
    n = len(labels)
    assert n > 50_000
    masked = (current == tokenizer.mask_id).mean()
    kept = (current == labels).mean()
    replaced = current[(current != labels) & (current != tokenizer.mask_id)]
    # Binomial standard deviations are ~0.0015 at this n: these bounds are > 5 sigma.
    assert abs(masked - 0.8) < 0.01
    assert abs(kept - 0.1) < 0.01
    assert abs(len(replaced) / n - 0.1) < 0.01
    assert not np.isin(replaced, list(tokenizer.special_ids)).any()
    assert len(np.unique(replaced)) > 2000  # drawn from the whole vocabulary


def test_nsp_balance_on_bundled_corpus(arrays, documents, tokenizer):
    # 50% random next within 4 standard errors (split_single_segments keeps one-sentence
    # chunks from being forced to "random").
    labels = arrays["next_sentence_labels"]
    bound = 4 * np.sqrt(0.25 / len(labels))
    assert abs(labels.mean() - 0.5) < bound, labels.mean()
    # Google's exact rule (no split) skews the short leads towards "random next".
    google = create_pretraining_arrays(
        documents, tokenizer, InstanceOptions(seed=1, split_single_segments=False)
    )
    assert google["next_sentence_labels"].mean() > 0.55


def test_nsp_balance_and_probability_on_long_documents(documents, tokenizer):
    flat = [s for doc in documents for s in doc]
    long_docs = [flat[i : i + 40] for i in range(0, len(flat), 40)]
    half = create_pretraining_arrays(
        long_docs, tokenizer, InstanceOptions(seed=5, short_seq_prob=0.0)
    )
    assert 0.47 < half["next_sentence_labels"].mean() < 0.56
    never = create_pretraining_arrays(
        long_docs, tokenizer, InstanceOptions(seed=5, short_seq_prob=0.0, random_next_prob=0.0)
    )
    assert never["next_sentence_labels"].mean() < 0.05
    always = create_pretraining_arrays(
        long_docs[:50], tokenizer, InstanceOptions(seed=5, random_next_prob=1.0)
    )
    assert always["next_sentence_labels"].all()
    # Without short targets nearly every sequence is filled to the maximum.
    assert np.median(lengths(half)) == SEQ


def test_decoded_instances_are_source_text(arrays, tokenizer, flat_corpus):
    ids = original_ids(arrays)
    length = lengths(arrays)
    nsp = arrays["next_sentence_labels"]
    checked_real = checked_random = contiguous_random = 0
    for row in range(0, len(ids), 7):
        a, b = segments(ids[row], tokenizer.sep_id)
        for piece in squash(tokenizer, a) + squash(tokenizer, b):
            assert piece in flat_corpus, piece
        if length[row] >= SEQ:
            continue  # possibly truncated at the A/B junction
        joined = squash(tokenizer, np.concatenate([a, b]))
        contiguous = all(p in flat_corpus for p in joined)
        if nsp[row] == 0:
            checked_real += 1
            assert contiguous, "real-next B must continue A in the source"
        else:
            checked_random += 1
            contiguous_random += contiguous
    assert checked_real > 30 and checked_random > 30
    assert contiguous_random / checked_random < 0.05


def test_deterministic_per_seed(arrays, documents, tokenizer):
    again = create_pretraining_arrays(documents, tokenizer, InstanceOptions(seed=1))
    for name in FEATURE_NAMES:
        assert np.array_equal(arrays[name], again[name])
    other = create_pretraining_arrays(documents, tokenizer, InstanceOptions(seed=2))
    assert other["input_ids"].shape != arrays["input_ids"].shape or not np.array_equal(
        other["input_ids"], arrays["input_ids"]
    )
    # The caller's documents are not reordered.
    assert (
        documents[0][0]
        == tokenizer.encode_batch(
            [bundled_corpus_path().read_text(encoding="utf-8").split("\n", 1)[0]]
        )[0]
    )


def test_dupe_factor_masks_each_copy_differently(documents, tokenizer):
    subset = documents[:300]
    one = create_pretraining_arrays(subset, tokenizer, InstanceOptions(seed=3))
    two = create_pretraining_arrays(subset, tokenizer, InstanceOptions(seed=3, dupe_factor=2))
    assert 1.7 < len(two["input_ids"]) / len(one["input_ids"]) < 2.3
    originals = original_ids(two)
    by_text: dict[bytes, set[bytes]] = {}
    for row in range(len(originals)):
        key = originals[row].tobytes()
        by_text.setdefault(key, set()).add(two["masked_lm_positions"][row].tobytes())
    repeated = [v for v in by_text.values() if len(v) > 1]
    assert repeated, "some sequences recur across copies with a different mask"


def test_whole_word_masking_masks_all_pieces(documents, tokenizer):
    wwm = create_pretraining_arrays(
        documents[:400], tokenizer, InstanceOptions(seed=4, whole_word_mask=True)
    )
    cont = tokenizer.is_continuation
    originals = original_ids(wwm)
    used = prediction_mask(wwm)
    length = lengths(wwm)
    groups_checked = 0
    for row in range(len(originals)):
        masked = set(wwm["masked_lm_positions"][row][used[row]].tolist())
        assert len(masked) <= PRED
        for p in masked:
            if cont[originals[row, p]] and p > 1 and originals[row, p - 1] != tokenizer.sep_id:
                assert p - 1 in masked
                groups_checked += 1
            if p + 1 < length[row] and cont[originals[row, p + 1]]:
                assert p + 1 in masked
    assert groups_checked > 100


def test_truncate_seq_pair_trims_longer_side():
    rng = random.Random(0)
    a, b = list(range(10)), list(range(100, 103))
    truncate_seq_pair(a, b, 8, rng)
    assert len(a) == 5 and b == [100, 101, 102]
    assert a == list(range(a[0], a[0] + 5))  # contiguous run of the original
    a, b = list(range(4)), list(range(100, 104))
    truncate_seq_pair(a, b, 4, rng)
    assert len(a) == 2 and len(b) == 2


def test_bulk_layout_is_the_per_instance_layout(documents, tokenizer):
    """`create_instance_arrays` lays pairs out in bulk; unmasked, its rows must be exactly
    `instances_to_arrays` of the same pairs (same seeded pairing, shuffle and order)."""
    options = InstanceOptions(seed=3, dupe_factor=2, sequence_length=64,
                              max_predictions_per_seq=10)
    out = create_instance_arrays(documents[:150], tokenizer, options)
    creator = InstanceCreator(tokenizer, options)
    rng = random.Random(options.seed)
    docs = [d for d in documents[:150] if d]
    rng.shuffle(docs)
    instances = []
    for _ in range(options.dupe_factor):
        for index in range(len(docs)):
            for a, b, random_next in creator.document_pairs(docs, index, rng):
                instances.append(TrainingInstance(
                    [tokenizer.cls_id, *a, tokenizer.sep_id, *b, tokenizer.sep_id],
                    [0] * (len(a) + 2) + [1] * (len(b) + 1), random_next, [], []))
    expected = instances_to_arrays(instances, 64, 10)
    order = np.random.default_rng(options.seed).permutation(len(instances))
    assert len(out["input_ids"]) == len(instances)
    assert np.array_equal(original_ids(out), expected["input_ids"][order])
    for name in ("input_mask", "segment_ids", "next_sentence_labels"):
        assert np.array_equal(out[name], expected[name][order]), name


def test_single_document_corpus_and_bad_options(tokenizer):
    doc = [tokenizer.encode("One sentence here."), tokenizer.encode("And a second one.")]
    out = create_pretraining_arrays(
        [doc], tokenizer, InstanceOptions(seed=0, sequence_length=16, max_predictions_per_seq=3)
    )
    assert out["input_ids"].shape[1] == 16 and len(out["input_ids"]) >= 1
    with pytest.raises(DataError, match="no non-empty documents"):
        InstanceCreator(tokenizer, InstanceOptions()).create_training_instances([[], []])
    with pytest.raises(ValueError, match="sequence_length"):
        InstanceOptions(sequence_length=4).validate()
    with pytest.raises(ValueError, match="max_predictions_per_seq"):
        InstanceOptions(max_predictions_per_seq=0).validate()
    with pytest.raises(ValueError, match="masked_lm_prob"):
        InstanceOptions(masked_lm_prob=1.5).validate()
