"""Pre-training instances (MLM + NSP) by Google BERT's `create_pretraining_data.py` algorithm.

Documents of tokenized sentences become `[CLS] A [SEP] B [SEP]` pairs with masked-LM targets and
next-sentence labels, then fixed-shape arrays in NVIDIA's BERT HDF5 layout. Google's pairing
runs call for call; masking follows Google's rule vectorised (`mask_arrays`). Both data roads
(pre-training on text files, and `prepare-data` shards) make instances with
`create_corpus_arrays` / `create_instance_arrays` only, so one corpus, seed and settings give the
same instances either way. The steps, and the departures from Google: docs/design.md, section
"popbert.data.instances".
"""

from __future__ import annotations

import logging
import math
import random
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, replace

import numpy as np

from popbert.data.errors import DataError
from popbert.data.stages import derive_seed
from popbert.data.tokenization import TextTokenizer
from popbert.machine import available_memory

log = logging.getLogger(__name__)

# The six datasets of NVIDIA's (and Graphcore's) pre-training shards, in their order.
FEATURE_NAMES = ("input_ids", "input_mask", "segment_ids", "masked_lm_positions",
                 "masked_lm_ids", "next_sentence_labels")
NSP_IS_NEXT = 0
NSP_RANDOM_NEXT = 1

Document = list[list[int]]


@dataclass(frozen=True)
class InstanceOptions:
    """Parameters of instance creation; recorded as shard attributes so data is self-describing.

    Defaults are Google's for phase 1 (seq 128, 20 predictions) except `dupe_factor`, 1 here
    (Google: 10, Graphcore: 6) because small corpora are usually regenerated per seed instead.
    """

    sequence_length: int = 128
    max_predictions_per_seq: int = 20
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1
    random_next_prob: float = 0.5
    # Google pairs a one-sentence chunk with a random B every time; on corpora of short
    # documents (Wikipedia leads) that skews NSP to ~63% "random". Splitting such a sentence at
    # a random token gives it a real continuation too, restoring the 50/50 task.
    split_single_segments: bool = True
    dupe_factor: int = 1
    whole_word_mask: bool = False
    seed: int = 12345
    # False: MLM-only rows (RoBERTa's FULL-SENTENCES, what `transformers`' run_mlm does): the
    # documents' tokens back to back, [SEP] between documents, cut into full rows; no pairs.
    next_sentence: bool = True

    def validate(self) -> None:
        """Raise ValueError naming the bad option; catches impossible shapes before any work."""
        if self.sequence_length < 5:
            raise ValueError(f"sequence_length must be >= 5 (room for [CLS] a [SEP] b [SEP] "
                             f"and one more token), got {self.sequence_length}")
        if not 1 <= self.max_predictions_per_seq <= self.sequence_length:
            raise ValueError(f"max_predictions_per_seq must be in [1, sequence_length], "
                             f"got {self.max_predictions_per_seq}")
        for name in ("masked_lm_prob", "short_seq_prob", "random_next_prob"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {value}")
        if self.dupe_factor < 1:
            raise ValueError(f"dupe_factor must be >= 1, got {self.dupe_factor}")

    def as_dict(self) -> dict:
        """Plain dict for shard attributes and cache keys (`next_sentence` only when off, so
        the keys of sentence-pair data made before the option existed still match)."""
        options = asdict(self)
        if options["next_sentence"]:
            del options["next_sentence"]
        return options


@dataclass
class TrainingInstance:
    """One `[CLS] A [SEP] B [SEP]` sequence after masking, before padding.

    Kept as lists so later stages (sequence packing) can combine instances before they become
    fixed-shape arrays.
    """

    tokens: list[int]
    segment_ids: list[int]
    is_random_next: bool
    masked_lm_positions: list[int]
    masked_lm_labels: list[int]


def truncate_seq_pair(tokens_a: list[int], tokens_b: list[int], max_num_tokens: int,
                      rng: random.Random) -> int:
    """Trim the longer segment in place, one token at a time from a random end; returns the
    number of tokens removed.

    Random ends (not always the tail) avoid biasing the model towards sentence starts. One
    draw per removed token, as Google's loop makes, but each segment is cut once at the end
    (deleting from the front token by token is quadratic in a segment's length: a sentence
    of millions of tokens would take hours).
    """
    len_a, len_b = len(tokens_a), len(tokens_b)
    excess = len_a + len_b - max_num_tokens
    if excess <= 0:
        return 0
    front_a = front_b = 0
    while len_a + len_b > max_num_tokens:
        front = rng.random() < 0.5
        if len_a > len_b:
            len_a -= 1
            front_a += front
        else:
            len_b -= 1
            front_b += front
    for tokens, start, keep in ((tokens_a, front_a, len_a), (tokens_b, front_b, len_b)):
        tokens[:] = tokens[start:start + keep]
    return excess


@dataclass
class Cuts:
    """What pairing cut to make `[CLS] A [SEP] B [SEP]` fit the sequence, summed over every
    pass (with `dupe_factor` d a corpus is paired d times, each time anew).

    `tokens_truncated`: tokens `truncate_seq_pair` removed from `pairs_truncated` of the
    `pairs`. Google's pairing overshoots its target length by design (a chunk ends with the
    sentence that crosses it, a random B is filled past its target), so most pairs of a real
    corpus lose a few tokens; a sentence longer than a sequence loses all but what fits.
    `tail_tokens_dropped`: tokens of single sentences split in two whose second half was
    replaced by a random next segment (that half is not a whole segment to put back).
    `tokens_kept`: the tokens of A and B in the pairs made.
    """

    pairs: int = 0
    pairs_truncated: int = 0
    tokens_truncated: int = 0
    tail_tokens_dropped: int = 0
    tokens_kept: int = 0

    def add(self, other: Cuts) -> None:
        for name, value in asdict(other).items():
            setattr(self, name, getattr(self, name) + value)

    def say(self, where: str, sequence_length: int) -> None:
        """One log line for what pairing cut from `where` (nothing when nothing was paired)."""
        if not self.pairs:
            return
        lost = self.tokens_truncated + self.tail_tokens_dropped
        log.info("%s: %s of %s pairs truncated to %d tokens (%s tokens cut) and %s tokens of "
                 "split sentences left out: %.2f%% of the paired tokens", where,
                 f"{self.pairs_truncated:,}", f"{self.pairs:,}", sequence_length - 3,
                 f"{self.tokens_truncated:,}", f"{self.tail_tokens_dropped:,}",
                 100 * lost / max(1, lost + self.tokens_kept))


def long_sentences(documents: Iterable[Sequence[Sequence[int]]], sequence_length: int
                   ) -> tuple[int, int]:
    """(sentences longer than a pair can hold, the longest's token count): a sentence of more
    than `sequence_length - 3` tokens cannot be whole in any instance, so pairing cuts it."""
    limit = sequence_length - 3
    count = longest = 0
    for document in documents:
        for sentence in document:
            if len(sentence) > limit:
                count += 1
                longest = max(longest, len(sentence))
    return count, longest


def check_long_sentences(count: int, longest: int, sentences: int, sequence_length: int,
                         where: str, strict: bool = False) -> None:
    """Say once that `count` sentences of `where` are longer than a sequence holds (a
    warning), or under `strict` refuse them (a DataError)."""
    if not count:
        return
    message = (f"{where}: {count:,} of {sentences:,} sentences are longer than a sequence holds "
               f"({sequence_length - 3} tokens at sequence length {sequence_length}; the "
               f"longest has {longest:,}): only that many tokens of each can be in an "
               f"instance, the rest are cut (split such text into sentences first)")
    if strict:
        raise DataError(f"{message}; refused (strict)")
    log.warning(message)


def non_special_ids(tokenizer: TextTokenizer) -> np.ndarray:
    """The ids a random replacement may take (every id but the special ones), ascending; in
    numpy because a stage makes it once per part, and parts may be many and tiny."""
    keep = np.ones(tokenizer.vocab_size, dtype=bool)
    keep[sorted(tokenizer.special_ids)] = False
    return np.flatnonzero(keep).astype(np.int64)


class InstanceCreator:
    """Google's instance algorithm bound to one vocabulary and one set of options.

    `document_pairs` is the pairing both data roads use. `create_training_instances` (with
    `create_instances_from_document`, `create_masked_lm_predictions`) is Google's per-instance
    Python masking, kept as the reference only: no road uses it; the tests check the
    vectorised masking against its statistics and the benchmarks time against it.
    """

    def __init__(self, tokenizer: TextTokenizer, options: InstanceOptions,
                 cuts: Cuts | None = None):
        options.validate()
        self.options = options
        # What pairing cut, counted as it goes (`Cuts`); pass one to sum over creators.
        self.cuts = cuts if cuts is not None else Cuts()
        self.tokenizer = tokenizer
        self.cls_id = tokenizer.cls_id
        self.sep_id = tokenizer.sep_id
        self.mask_id = tokenizer.mask_id
        # Never chosen for prediction: structure tokens, padding and a literal mask.
        self.unmaskable = frozenset(
            {tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id, tokenizer.mask_id})
        self.random_pool = non_special_ids(tokenizer).tolist()
        if not self.random_pool:
            raise DataError(f"{tokenizer.vocab_path}: vocabulary has no non-special tokens")
        self.is_continuation = tokenizer.is_continuation.tolist()

    def create_training_instances(self, documents: Sequence[Document]) -> list[TrainingInstance]:
        """All instances of a corpus: shuffle documents, `dupe_factor` passes, shuffle result."""
        opts = self.options
        rng = random.Random(opts.seed)
        all_documents = [d for d in documents if d]
        if not all_documents:
            raise DataError("no non-empty documents to create instances from")
        rng.shuffle(all_documents)
        instances: list[TrainingInstance] = []
        for _ in range(opts.dupe_factor):
            for document_index in range(len(all_documents)):
                instances.extend(
                    self.create_instances_from_document(all_documents, document_index, rng))
        rng.shuffle(instances)
        return instances

    def create_instances_from_document(self, all_documents: Sequence[Document],
                                       document_index: int,
                                       rng: random.Random) -> list[TrainingInstance]:
        """Masked instances of one document (Google's `create_instances_from_document`)."""
        instances: list[TrainingInstance] = []
        # Each pair is masked before the generator draws the next: Google's order of draws.
        for tokens_a, tokens_b, is_random_next in self.document_pairs(all_documents,
                                                                      document_index, rng):
            tokens = [self.cls_id, *tokens_a, self.sep_id, *tokens_b, self.sep_id]
            segment_ids = [0] * (len(tokens_a) + 2) + [1] * (len(tokens_b) + 1)
            tokens, positions, labels = self.create_masked_lm_predictions(tokens, rng)
            instances.append(TrainingInstance(tokens, segment_ids, is_random_next, positions,
                                              labels))
        return instances

    def document_pairs(self, all_documents: Sequence[Document], document_index: int,
                       rng: random.Random) -> Iterator[tuple[list[int], list[int], bool]]:
        """(segment A, segment B, is random next) of one document, truncated, unmasked.

        Google's pairing alone, so the array path (`create_instance_arrays`) can lay pairs out
        in bulk without building a `TrainingInstance` per pair.
        """
        opts = self.options
        document = all_documents[document_index]
        max_num_tokens = opts.sequence_length - 3
        target_seq_length = max_num_tokens
        if rng.random() < opts.short_seq_prob:
            target_seq_length = rng.randint(2, max_num_tokens)

        current_chunk: list[list[int]] = []
        current_length = 0
        i = 0
        while i < len(document):
            segment = document[i]
            current_chunk.append(segment)
            current_length += len(segment)
            if i == len(document) - 1 or current_length >= target_seq_length:
                if current_chunk:
                    split = (opts.split_single_segments and len(current_chunk) == 1
                             and len(current_chunk[0]) >= 2)
                    if split:
                        cut = rng.randint(1, len(current_chunk[0]) - 1)
                        current_chunk = [current_chunk[0][:cut], current_chunk[0][cut:]]
                    a_end = 1
                    if len(current_chunk) >= 2:
                        a_end = rng.randint(1, len(current_chunk) - 1)
                    tokens_a: list[int] = []
                    for j in range(a_end):
                        tokens_a.extend(current_chunk[j])

                    tokens_b: list[int] = []
                    if len(current_chunk) == 1 or rng.random() < opts.random_next_prob:
                        is_random_next = True
                        target_b_length = target_seq_length - len(tokens_a)
                        # Ten tries at another document (a one-document corpus uses itself).
                        random_document_index = document_index
                        for _ in range(10):
                            random_document_index = rng.randint(0, len(all_documents) - 1)
                            if random_document_index != document_index:
                                break
                        random_document = all_documents[random_document_index]
                        random_start = rng.randint(0, len(random_document) - 1)
                        for j in range(random_start, len(random_document)):
                            tokens_b.extend(random_document[j])
                            if len(tokens_b) >= target_b_length:
                                break
                        # Put back the segments B did not use, so they are not wasted (the
                        # tail of a split sentence is not a whole segment: it is dropped).
                        if not split:
                            i -= len(current_chunk) - a_end
                        else:
                            self.cuts.tail_tokens_dropped += len(current_chunk[1])
                    else:
                        is_random_next = False
                        for j in range(a_end, len(current_chunk)):
                            tokens_b.extend(current_chunk[j])

                    cut = truncate_seq_pair(tokens_a, tokens_b, max_num_tokens, rng)
                    cuts = self.cuts
                    cuts.pairs += 1
                    cuts.pairs_truncated += cut > 0
                    cuts.tokens_truncated += cut
                    cuts.tokens_kept += len(tokens_a) + len(tokens_b)
                    if not tokens_a or not tokens_b:
                        raise DataError("internal error: empty segment after truncation")
                    yield tokens_a, tokens_b, is_random_next
                current_chunk = []
                current_length = 0
            i += 1

    def create_masked_lm_predictions(self, tokens: list[int], rng: random.Random
                                     ) -> tuple[list[int], list[int], list[int]]:
        """Choose and corrupt MLM positions; returns (tokens, sorted positions, labels)."""
        opts = self.options
        unmaskable = self.unmaskable
        is_continuation = self.is_continuation
        cand_indexes: list[list[int]] = []
        for i, token in enumerate(tokens):
            if token in unmaskable:
                continue
            if (opts.whole_word_mask and cand_indexes and is_continuation[token]
                    and cand_indexes[-1][-1] == i - 1):
                cand_indexes[-1].append(i)
            else:
                cand_indexes.append([i])
        rng.shuffle(cand_indexes)

        output_tokens = list(tokens)
        num_to_predict = min(opts.max_predictions_per_seq,
                             max(1, int(round(len(tokens) * opts.masked_lm_prob))))
        masked: list[tuple[int, int]] = []
        covered: set[int] = set()
        pool = self.random_pool
        for index_set in cand_indexes:
            if len(masked) >= num_to_predict:
                break
            # A whole word that would overflow the budget is skipped, not split.
            if len(masked) + len(index_set) > num_to_predict:
                continue
            if any(index in covered for index in index_set):
                continue
            for index in index_set:
                covered.add(index)
                if rng.random() < 0.8:
                    replacement = self.mask_id
                elif rng.random() < 0.5:
                    replacement = tokens[index]
                else:
                    replacement = pool[rng.randint(0, len(pool) - 1)]
                output_tokens[index] = replacement
                masked.append((index, tokens[index]))
        masked.sort()
        return output_tokens, [p for p, _ in masked], [lab for _, lab in masked]


def instances_to_arrays(instances: Sequence[TrainingInstance], sequence_length: int,
                        max_predictions_per_seq: int) -> dict[str, np.ndarray]:
    """Pad instances into NVIDIA's layout (int32; padding 0, i.e. [PAD] / position 0).

    `next_sentence_labels`: 1 = random next, 0 = real next (Google/NVIDIA and HF agree).
    """
    n = len(instances)
    arrays = {
        "input_ids": np.zeros((n, sequence_length), dtype=np.int32),
        "input_mask": np.zeros((n, sequence_length), dtype=np.int32),
        "segment_ids": np.zeros((n, sequence_length), dtype=np.int32),
        "masked_lm_positions": np.zeros((n, max_predictions_per_seq), dtype=np.int32),
        "masked_lm_ids": np.zeros((n, max_predictions_per_seq), dtype=np.int32),
        "next_sentence_labels": np.zeros((n,), dtype=np.int32),
    }
    for row, inst in enumerate(instances):
        length = len(inst.tokens)
        npred = len(inst.masked_lm_positions)
        if length > sequence_length or npred > max_predictions_per_seq:
            raise DataError(f"instance {row} has {length} tokens and {npred} predictions; "
                            f"shape is ({sequence_length}, {max_predictions_per_seq})")
        arrays["input_ids"][row, :length] = inst.tokens
        arrays["input_mask"][row, :length] = 1
        arrays["segment_ids"][row, :length] = inst.segment_ids
        arrays["masked_lm_positions"][row, :npred] = inst.masked_lm_positions
        arrays["masked_lm_ids"][row, :npred] = inst.masked_lm_labels
        arrays["next_sentence_labels"][row] = (
            NSP_RANDOM_NEXT if inst.is_random_next else NSP_IS_NEXT)
    return arrays


def create_pretraining_arrays(documents: Sequence[Document], tokenizer: TextTokenizer,
                              options: InstanceOptions, cuts: Cuts | None = None
                              ) -> dict[str, np.ndarray]:
    """Tokenized documents -> instances -> NVIDIA-layout arrays, in one seeded call: the same
    algorithm as `create_instance_arrays` (the name kept for callers of the library); `cuts`,
    if given, gets what pairing cut (MLM-only rows cut nothing)."""
    return create_instance_arrays(documents, tokenizer, options, cuts)


def reference_instance_arrays(documents: Sequence[Document], tokenizer: TextTokenizer,
                              options: InstanceOptions) -> dict[str, np.ndarray]:
    """Google's per-instance algorithm (Python masking on one `random.Random`), as arrays:
    the reference the tests compare the data roads' statistics with; no road uses it."""
    instances = InstanceCreator(tokenizer, options).create_training_instances(documents)
    return instances_to_arrays(instances, options.sequence_length, options.max_predictions_per_seq)


def part_options(options: InstanceOptions, index: int) -> InstanceOptions:
    """The options of a corpus's part `index` (an input file of the text road, a sentence
    part of `prepare-data instances`): its seed derived from the run's seed and the index, so
    each part is made alone (by any worker) and both roads agree part by part."""
    return replace(options, seed=derive_seed(options.seed, index))


def create_corpus_arrays(parts: Sequence[Sequence[Document]], tokenizer: TextTokenizer,
                         options: InstanceOptions, cuts: Cuts | None = None
                         ) -> dict[str, np.ndarray]:
    """The instances of a corpus in parts, part after part: each part's by
    `create_instance_arrays` with `part_options(options, index)`, concatenated; a part without
    documents makes none. Exactly the rows of `prepare-data instances`' shards of the same
    parts, in part order (random next segments come from the same part on both roads)."""
    made = [create_instance_arrays(documents, tokenizer, part_options(options, index), cuts)
            for index, documents in enumerate(parts) if any(documents)]
    if not made:
        raise DataError("no non-empty documents to create instances from")
    arrays = made[0] if len(made) == 1 else {
        name: np.concatenate([m[name] for m in made]) for name in FEATURE_NAMES}
    log.info("created %d instances from %d part(s) (seq %d, %d predictions, dupe %d, seed %d)",
             len(arrays["input_ids"]), len(made), options.sequence_length,
             options.max_predictions_per_seq, options.dupe_factor, options.seed)
    return arrays


def _pairs_to_arrays(flat: list[int], lengths_a: list[int], lengths_b: list[int],
                     random_next: list[bool], sequence_length: int,
                     max_predictions_per_seq: int) -> dict[str, np.ndarray]:
    """`instances_to_arrays` for unmasked pairs given as one flat token list (each pair
    `[CLS] A [SEP] B [SEP]`, back to back) and the segment lengths: a few numpy operations
    instead of a `TrainingInstance` and five row copies per pair."""
    len_a = np.asarray(lengths_a, dtype=np.int64)
    lengths = len_a + np.asarray(lengths_b, dtype=np.int64) + 3
    n = len(lengths)
    if n and int(lengths.max()) > sequence_length:
        row = int(np.argmax(lengths > sequence_length))
        raise DataError(f"instance {row} has {int(lengths[row])} tokens; shape is "
                        f"({sequence_length}, {max_predictions_per_seq})")
    columns = np.arange(sequence_length)
    inside = columns[None, :] < lengths[:, None]
    input_ids = np.zeros((n, sequence_length), dtype=np.int32)
    input_ids[inside] = np.asarray(flat, dtype=np.int32)  # row-major: each row's tokens in order
    return {
        "input_ids": input_ids,
        "input_mask": inside.astype(np.int32),
        "segment_ids": (inside & (columns[None, :] >= len_a[:, None] + 2)).astype(np.int32),
        "masked_lm_positions": np.zeros((n, max_predictions_per_seq), dtype=np.int32),
        "masked_lm_ids": np.zeros((n, max_predictions_per_seq), dtype=np.int32),
        "next_sentence_labels": np.where(np.asarray(random_next, dtype=bool), NSP_RANDOM_NEXT,
                                         NSP_IS_NEXT).astype(np.int32),
    }


def mask_arrays(arrays: dict[str, np.ndarray], tokenizer: TextTokenizer,
                options: InstanceOptions, rng: np.random.Generator) -> None:
    """Google's MLM masking applied to all rows at once (in place), with numpy.

    Same rule as `InstanceCreator.create_masked_lm_predictions`: per row
    `k = min(P, max(1, round(len * masked_lm_prob)))` prediction tokens among the non-special
    tokens, chosen as whole words (with `whole_word_mask`, a word and its "##" pieces) in random
    order, a word that would overflow `k` skipped; each chosen token becomes [MASK] 80%, stays
    10%, becomes a random non-special token 10%. Random numbers come from `rng` (one stream per
    shard) instead of Python's `random`, so the choices differ from the per-instance version
    while the distribution is the same.
    """
    ids = arrays["input_ids"]
    n, seq = ids.shape
    preds = options.max_predictions_per_seq
    lengths = arrays["input_mask"].sum(axis=1).astype(np.int64)
    special = np.array(sorted({tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id,
                               tokenizer.mask_id}))
    columns = np.arange(seq)
    candidate = (columns[None, :] < lengths[:, None]) & ~np.isin(ids, special)
    if options.whole_word_mask:
        previous = np.zeros_like(candidate)
        previous[:, 1:] = candidate[:, :-1]
        starts = candidate & ~(tokenizer.is_continuation[ids] & previous)
    else:
        starts = candidate
    # Word w of row r: the tokens from its start up to the next start (candidates only).
    word = np.cumsum(starts, axis=1) - 1
    num_words = starts.sum(axis=1)
    max_words = int(num_words.max()) if n else 0
    if max_words == 0:
        arrays["masked_lm_positions"][:] = 0
        arrays["masked_lm_ids"][:] = 0
        return
    sizes = np.zeros((n, max_words), np.int64)
    r, c = np.nonzero(candidate)
    np.add.at(sizes, (r, word[r, c]), 1)
    # Random word order per row (absent words last), then greedy: take a word if it fits.
    keys = rng.random((n, max_words))
    keys[sizes == 0] = 2.0
    order = np.argsort(keys, axis=1, kind="stable")
    ranked = np.take_along_axis(sizes, order, axis=1)
    budget = np.minimum(preds, np.maximum(1, np.round(lengths * options.masked_lm_prob)))
    budget = budget.astype(np.int64)
    total = np.zeros(n, np.int64)
    taken_ranked = np.zeros((n, max_words), bool)
    for j in range(max_words):
        size = ranked[:, j]
        fits = (size > 0) & (total + size <= budget)
        taken_ranked[:, j] = fits
        total += np.where(fits, size, 0)
        if not np.any((total < budget) & (num_words > j + 1)):
            break
    taken = np.zeros((n, max_words), bool)
    np.put_along_axis(taken, order, taken_ranked, axis=1)
    chosen = candidate.copy()
    chosen[r, c] = taken[r, word[r, c]]

    rows, cols = np.nonzero(chosen)  # row-major: positions ascending within each row
    original = ids[rows, cols].copy()
    roll = rng.random(len(rows))
    keep = rng.random(len(rows)) < 0.5
    pool = non_special_ids(tokenizer)
    random_tokens = pool[rng.integers(0, len(pool), len(rows))]
    replaced = np.where(roll < 0.8, tokenizer.mask_id, np.where(keep, original, random_tokens))
    ids[rows, cols] = replaced
    counts = chosen.sum(axis=1)
    slot = np.arange(len(rows)) - np.repeat(np.cumsum(counts) - counts, counts)
    arrays["masked_lm_positions"][:] = 0
    arrays["masked_lm_ids"][:] = 0
    arrays["masked_lm_positions"][rows, slot] = cols
    arrays["masked_lm_ids"][rows, slot] = original


#: What `create_instance_arrays` holds at its peak, in units of the least its finished arrays
#: can take: measured 6.8x (MLM-only rows), 11.6x (pairs, seq 128) and 34.8x (pairs, seq 512) on
#: the bundled corpus's short documents at dupe factor 10 (tracemalloc), and never under 4.7x
#: the finished arrays themselves (masking works on copies). 4 stays below all of them, also
#: for documents long enough to fill every row.
PEAK_OVER_LEAST = 4


def least_instance_bytes(tokens: int, options: InstanceOptions) -> int:
    """A floor under the memory `create_instance_arrays` needs for documents of `tokens`
    tokens: `dupe_factor` passes of rows that each hold at most `sequence_length - 3` of them
    (int32 ids, mask and segments; positions and ids per prediction; a label), times
    `PEAK_OVER_LEAST`. Less than it really takes, so a refusal on it is never wrong."""
    width = options.sequence_length
    per_row = 4 * (3 * width + 2 * options.max_predictions_per_seq + 1)
    rows = math.ceil(tokens / max(1, width - 3)) * options.dupe_factor
    return PEAK_OVER_LEAST * rows * per_row


def check_instance_memory(tokens: int, options: InstanceOptions) -> None:
    """A DataError, before any is taken, when instances of `tokens` tokens need more memory
    than this process can have (`popbert.machine.available_memory`): the kernel would kill the
    process mid-stage otherwise (or another one of the machine's), with no word of why."""
    room = available_memory()
    need = least_instance_bytes(tokens, options)
    if room is not None and need > room:
        raise DataError(f"{tokens:,} tokens at dupe factor {options.dupe_factor} (sequence "
                        f"length {options.sequence_length}) need at least {need / 2**30:.1f} "
                        f"GiB of memory for their instances, more than the {room / 2**30:.1f} "
                        "GiB available: lower the dupe factor, or split the input into "
                        "smaller parts")


def create_instance_arrays(documents: Sequence[Document], tokenizer: TextTokenizer,
                           options: InstanceOptions, cuts: Cuts | None = None
                           ) -> dict[str, np.ndarray]:
    """The pipeline's fast path: Google's pairing per document, then `mask_arrays` in bulk.

    Same steps as `InstanceCreator.create_training_instances` (documents shuffled once with
    `random.Random(seed)`, `dupe_factor` passes of pairing, instances shuffled) except that each
    pass becomes compact int32 arrays before the next starts (one flat token list per pass, laid
    out in bulk: no `TrainingInstance` per pair), the final shuffle is a numpy permutation, and
    masking is vectorised, all from a numpy generator seeded with `seed`. Deterministic for a
    seed; several times faster than Google's per-token Python masking
    (`reference_instance_arrays`). `cuts`, if given, gets what pairing cut (MLM-only rows cut
    nothing).
    """
    check_instance_memory(sum(len(sentence) for document in documents for sentence in document),
                          options)
    creator = InstanceCreator(tokenizer, options, cuts)
    cls_id, sep_id = creator.cls_id, creator.sep_id
    rng = random.Random(options.seed)
    all_documents = [d for d in documents if d]
    if not all_documents:
        raise DataError("no non-empty documents to create instances from")
    if not options.next_sentence:
        return create_chunk_arrays(all_documents, tokenizer, options)
    rng.shuffle(all_documents)
    passes = []
    for _ in range(options.dupe_factor):
        flat: list[int] = []
        lengths_a: list[int] = []
        lengths_b: list[int] = []
        random_next: list[bool] = []
        for index in range(len(all_documents)):
            for tokens_a, tokens_b, is_random_next in creator.document_pairs(all_documents,
                                                                             index, rng):
                flat.append(cls_id)
                flat.extend(tokens_a)
                flat.append(sep_id)
                flat.extend(tokens_b)
                flat.append(sep_id)
                lengths_a.append(len(tokens_a))
                lengths_b.append(len(tokens_b))
                random_next.append(is_random_next)
        passes.append(_pairs_to_arrays(flat, lengths_a, lengths_b, random_next,
                                       options.sequence_length, options.max_predictions_per_seq))
        del flat
    generator = np.random.default_rng(options.seed)
    total = sum(len(p["input_ids"]) for p in passes)
    order = generator.permutation(total)
    arrays = {name: np.concatenate([p[name] for p in passes])[order] for name in FEATURE_NAMES}
    del passes
    mask_arrays(arrays, tokenizer, options, generator)
    return arrays


def create_chunk_arrays(documents: Sequence[Document], tokenizer: TextTokenizer,
                        options: InstanceOptions) -> dict[str, np.ndarray]:
    """MLM-only rows (`options.next_sentence` false), seeded: each pass shuffles the
    documents, lays their tokens back to back with a [SEP] after each document, and cuts the
    stream into `[CLS] chunk [SEP]` rows of exactly `sequence_length` tokens (the last row of a
    pass is padded). Rows are shuffled, then masked by `mask_arrays`; `segment_ids` and
    `next_sentence_labels` are all 0."""
    width = options.sequence_length - 2
    documents = [d for d in documents if d]
    if not documents:
        raise DataError("no non-empty documents to create instances from")
    rng = random.Random(options.seed)
    passes = []
    for _ in range(options.dupe_factor):
        rng.shuffle(documents)
        stream = np.fromiter((token for document in documents
                              for sentence in document + [[tokenizer.sep_id]]
                              for token in sentence), dtype=np.int32)
        rows = -(-len(stream) // width)
        body = np.zeros((rows, width), np.int32)
        body.reshape(-1)[:len(stream)] = stream
        lengths = np.full(rows, width, np.int64)
        lengths[-1] = len(stream) - width * (rows - 1)
        ids = np.zeros((rows, options.sequence_length), np.int32)
        ids[:, 0] = tokenizer.cls_id
        ids[:, 1:-1] = body
        ids[np.arange(rows), lengths + 1] = tokenizer.sep_id
        passes.append((ids, lengths + 2))
    ids = np.concatenate([p[0] for p in passes])
    lengths = np.concatenate([p[1] for p in passes])
    n, preds = len(ids), options.max_predictions_per_seq
    generator = np.random.default_rng(options.seed)
    order = generator.permutation(n)
    columns = np.arange(options.sequence_length)
    arrays = {
        "input_ids": ids[order],
        "input_mask": (columns[None, :] < lengths[order][:, None]).astype(np.int32),
        "segment_ids": np.zeros_like(ids),
        "masked_lm_positions": np.zeros((n, preds), np.int32),
        "masked_lm_ids": np.zeros((n, preds), np.int32),
        "next_sentence_labels": np.zeros(n, np.int32),
    }
    mask_arrays(arrays, tokenizer, options, generator)
    log.info("created %d MLM-only rows of %d tokens (%d predictions, dupe %d, seed %d)", n,
             options.sequence_length, preds, options.dupe_factor, options.seed)
    return arrays


def cut_chunk_rows(arrays: Mapping[str, np.ndarray], length: int, predictions: int,
                   cls_id: int, sep_id: int) -> dict[str, np.ndarray]:
    """Unmasked MLM-only rows (`create_chunk_arrays`' `[CLS] chunk [SEP]`) cut into rows of
    `length` tokens: row i's chunk becomes the consecutive rows `[CLS] piece [SEP]` of
    `length - 2` tokens each (its last `(S - 2) mod (length - 2)` tokens dropped), with
    `predictions` empty prediction slots for `mask_arrays` to fill. Pieces past a short row's
    end are `[CLS] [SEP]` rows, which mask nothing (the loss ignores them)."""
    ids = np.asarray(arrays["input_ids"])
    rows, seq = ids.shape
    width = length - 2
    pieces = (seq - 2) // width
    lengths = np.asarray(arrays["input_mask"]).sum(axis=1)
    # The chunk without [CLS] and its closing [SEP]: real tokens are a prefix of each row.
    body = ids[:, 1:seq - 1].copy()
    columns = np.arange(seq - 2)
    body[columns[None, :] >= (lengths - 2)[:, None]] = 0
    body = body[:, :pieces * width].reshape(rows * pieces, width)
    real = (columns[None, :pieces * width] < (lengths - 2)[:, None]).reshape(rows * pieces,
                                                                            width).sum(axis=1)
    out_ids = np.zeros((rows * pieces, length), ids.dtype)
    out_ids[:, 0] = cls_id
    out_ids[:, 1:-1] = body
    out_ids[np.arange(rows * pieces), real + 1] = sep_id
    out_mask = (np.arange(length)[None, :] < (real + 2)[:, None]).astype(ids.dtype)
    return {"input_ids": out_ids, "input_mask": out_mask,
            "segment_ids": np.zeros_like(out_ids),
            "masked_lm_positions": np.zeros((rows * pieces, predictions), ids.dtype),
            "masked_lm_ids": np.zeros((rows * pieces, predictions), ids.dtype)}


def unmask_rows(arrays: dict[str, np.ndarray]) -> None:
    """Undo `mask_arrays` in place: the original tokens back at the masked positions and the
    prediction slots cleared (slots labelled 0 are padding)."""
    ids, positions, labels = (arrays["input_ids"], arrays["masked_lm_positions"],
                              arrays["masked_lm_ids"])
    rows, slots = np.nonzero(labels)
    ids[rows, positions[rows, slots]] = labels[rows, slots]
    positions[:] = 0
    labels[:] = 0
