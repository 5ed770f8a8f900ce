"""`popbert prepare-data`: Wikipedia dump → extracted text → sentences → vocab → HDF5 shards →
packed shards, each stage usable alone or all in one call (`prepare_wikipedia`).

The output directory's layout, and why the output is the same for any number of workers:
docs/design.md, section "popbert.data.prepare".
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from popbert.data import storage
from popbert.data.corpus import TextCounts, name_files, read_text_documents, tokenize_documents
from popbert.data.errors import DataError
from popbert.data.hdf5 import read_shard, read_shard_info, write_shard
from popbert.data.instances import Cuts, InstanceOptions, create_instance_arrays, part_options
from popbert.data.packing import (
    DEFAULT_MAX_SEQUENCES_PER_PACK,
    PackingStats,
    pack_instance_arrays,
)
from popbert.data.sentences import DEFAULT_MIN_SENTENCES, split_sentences
from popbert.data.stages import (
    StageDir,
    default_workers,
    derive_seed,
    run_units,
    workers_label,
)
from popbert.data.storage import Location
from popbert.data.tokenization import TextTokenizer, file_sha256, load_tokenizer
from popbert.data.vocab import DEFAULT_VOCAB_SIZE, train_vocab
from popbert.data.wikipedia import DEFAULT_PART_BYTES, EXTRACT_SUFFIX, extract_dump

log = logging.getLogger(__name__)

SHARD_SUFFIX = "h5"


def instances_dir_name(options: InstanceOptions) -> str:
    return f"instances-s{options.sequence_length}-p{options.max_predictions_per_seq}"


def packed_dir_name(options: InstanceOptions) -> str:
    return f"packed-s{options.sequence_length}-p{options.max_predictions_per_seq}"


@functools.lru_cache(maxsize=2)
def _loaded_tokenizer(path: str, sha256: str) -> TextTokenizer:
    return load_tokenizer(path)


def part_tokenizer(vocab_path: str) -> TextTokenizer:
    """The vocabulary's tokenizer, built once per process and content (keyed by its sha256):
    building it costs ~15 ms, more than all the rest of a part of a few sentences, so a stage
    over many tiny parts spent most of its time rebuilding it."""
    local = storage.local_file(storage.location(vocab_path))
    return _loaded_tokenizer(str(local), file_sha256(local))


def instances_part(in_path: str, out_path: str, vocab_path: str, options: dict,
                   run_seed: int, index: int, strict: bool = False) -> dict:
    """One sentence part → one HDF5 shard of masked instances; returns counts. The
    vocabulary may be a URL (read from this worker's cache)."""
    tokenizer = part_tokenizer(vocab_path)
    opts = InstanceOptions(**options)
    text = read_text_documents([in_path])
    documents = tokenize_documents(text, tokenizer)
    # The checks the text road makes too (`corpus.TextCounts`).
    text = TextCounts.of(documents, tokenizer, opts.sequence_length, opts.next_sentence)
    if strict:  # before the shard is written: a refused part leaves nothing
        text.check(in_path, opts.sequence_length, strict=True)
    cuts = Cuts()
    counts = {"documents": len(documents), "sentences": text.sentences,
              "instances": 0, "tokens": 0, "predictions": 0, "random_next": 0,
              "text": text, "cuts": cuts}
    if not documents:  # said once for the stage, with the count (`create_instances`)
        return counts
    try:
        arrays = create_instance_arrays(documents, tokenizer, opts, cuts)
    except DataError as error:  # e.g. more memory than there is: name the part
        raise DataError(f"{storage.name_of(in_path)}: {error}") from None
    write_shard(out_path, arrays, vocab_size=tokenizer.vocab_size,
                vocab_sha256=tokenizer.vocab_sha256, options=opts,
                extra_attrs={"run_seed": run_seed, "part": index,
                             "source": storage.name_of(in_path)})
    counts.update(instances=int(len(arrays["input_ids"])),
                  tokens=int(arrays["input_mask"].sum()),
                  predictions=int((arrays["masked_lm_ids"] != 0).sum()),
                  random_next=int(arrays["next_sentence_labels"].sum()))
    return counts


def create_instances(sentence_parts: list[Location], vocab: str | os.PathLike,
                     output_dir: str | os.PathLike, options: InstanceOptions,
                     workers: int = 1, strict: bool = False) -> dict:
    """Stage `instances`: sentence parts → `output_dir/part-*.h5`; returns the record.

    A part without documents writes no shard (counted, said once), but a stage without any
    shard is a DataError naming the input, with no completion marker and no directory left
    behind. What the stage cuts is counted in the record and said once: the share of `[UNK]`
    tokens (warned about above `corpus.UNKNOWN_SHARE_LIMIT`), sentences longer than a sequence
    holds (warned about: all but `sequence_length - 3` of their tokens are cut), and the pairs
    and tokens pairing truncated (`instances.Cuts`, a log line). With `strict` a part with too
    many `[UNK]` tokens or any over-long sentence stops the stage, leaving nothing; ordinary
    truncation is Google's algorithm working and is never refused.
    """
    options.validate()
    if not sentence_parts:
        raise DataError("no sentence parts to create instances from")
    vocab = storage.location(vocab)
    tokenizer = load_tokenizer(storage.local_file(vocab))
    params = {**options.as_dict(), "vocab_sha256": tokenizer.vocab_sha256,
              "inputs": [storage.name_of(p) for p in sentence_parts]}
    stage = StageDir(output_dir, "instances", params).open()
    if stage.complete:
        log.info("%s: instances already complete", stage.path)
        return stage.success()
    jobs = [(str(src), str(out), str(vocab.absolute() if isinstance(vocab, Path) else vocab),
             part_options(options, index).as_dict(), options.seed,
             index, strict)
            for index, src, out in stage.pending(sentence_parts, SHARD_SUFFIX)]
    log.info("creating instances from %d parts (seq %d, %d predictions, dupe %d, %s; "
             "%d already done)", len(jobs), options.sequence_length,
             options.max_predictions_per_seq, options.dupe_factor, workers_label(workers),
             len(sentence_parts) - len(jobs))
    try:
        results = run_units(instances_part, jobs, workers, desc="instances", total=len(jobs))
    except DataError as exc:  # a part refused (strict): leave nothing this run made
        raise stage.abandon(str(exc)) from None
    if not stage.parts(SHARD_SUFFIX):  # shards of an earlier run count too
        raise stage.abandon(f"{name_files(sentence_parts)}: empty corpus: no documents to "
                            f"make instances from (expected UTF-8 text, one sentence per line, "
                            f"a blank line between documents)")
    totals = {key: sum(r[key] for r in results) for key in
              ("documents", "sentences", "instances", "tokens", "predictions", "random_next")}
    empty = sum(1 for r in results if not r["documents"])
    if empty:
        log.warning("instances: %d of %d parts hold no documents; no shard written for them",
                    empty, len(results))
    text = TextCounts()
    for r in results:
        text.add(r["text"])
    where = name_files(sentence_parts)
    share = text.check(where, options.sequence_length)
    cuts = Cuts()
    for r in results:
        cuts.add(r["cuts"])
    cuts.say(where, options.sequence_length)
    stats = {"parts": len(sentence_parts), "parts_skipped": len(sentence_parts) - len(jobs),
             **{f"{k}_written_now": v for k, v in totals.items()},
             "parts_without_documents_now": empty,
             "unknown_token_share_now": round(share, 6),
             "sentences_over_length_now": text.long_sentences,
             "pairs_truncated_now": cuts.pairs_truncated,
             "tokens_truncated_now": cuts.tokens_truncated,
             "split_tail_tokens_dropped_now": cuts.tail_tokens_dropped}
    return stage.finish([storage.name_of(p) for p in stage.parts(SHARD_SUFFIX)], stats)


def pack_part(in_path: str, out_path: str, strategy: str, max_sequences_per_pack: int,
              max_predictions_per_pack: int | None, seed: int) -> dict:
    """One instance shard → one packed shard; returns the packing statistics."""
    info = read_shard_info(in_path)
    if info.packed:
        raise DataError(f"{in_path}: already packed")
    arrays = read_shard(in_path, packed=False)
    prob = info.attrs.get("masked_lm_prob")
    packed, stats = pack_instance_arrays(
        arrays, strategy=strategy, max_sequences_per_pack=max_sequences_per_pack,
        max_predictions_per_pack=max_predictions_per_pack,
        masked_lm_prob=float(prob) if prob is not None else None, seed=seed)
    keep = {k: v for k, v in info.attrs.items()
            if k not in ("schema_version", "sequence_length", "max_predictions_per_seq",
                         "num_samples", "format", "packed", "max_sequences_per_pack")}
    keep.update({"packing_strategy": strategy, "packing_seed": seed,
                 "source": storage.name_of(in_path),
                 "source_max_predictions_per_seq": info.max_predictions_per_seq,
                 "source_sequences": stats.sequences, "tokens": stats.tokens})
    write_shard(out_path, packed, vocab_size=info.vocab_size, vocab_sha256=info.vocab_sha256,
                extra_attrs=keep)
    return stats.as_dict()


def pack_shards(input_shards: list[Location], output_dir: str | os.PathLike, *,
                strategy: str = "spfhp",
                max_sequences_per_pack: int = DEFAULT_MAX_SEQUENCES_PER_PACK,
                max_predictions_per_pack: int | None = None, seed: int = 12345,
                workers: int = 1) -> dict:
    """Stage `pack`: instance shards → packed shards (one each); returns the record whose
    `stats` has the padding fraction before and after."""
    if not input_shards:
        raise DataError("no shards to pack")
    for path in input_shards:  # fail fast, naming the file, before any work
        info = read_shard_info(path)
        if info.packed:
            raise DataError(f"{path}: already packed")
    stage = StageDir(output_dir, "pack", {
        "strategy": strategy, "max_sequences_per_pack": max_sequences_per_pack,
        "max_predictions_per_pack": max_predictions_per_pack, "seed": seed,
        "inputs": [storage.name_of(p) for p in input_shards]}).open()
    if stage.complete:
        log.info("%s: pack already complete", stage.path)
        return stage.success()
    jobs = [(str(src), str(out), strategy, max_sequences_per_pack, max_predictions_per_pack,
             derive_seed(seed, index))
            for index, src, out in stage.pending(input_shards, SHARD_SUFFIX)]
    try:
        run_units(pack_part, jobs, workers, desc="pack", total=len(jobs))
    except DataError as exc:  # the cluster lost, a shard refused: the lock goes, one line
        raise stage.abandon(str(exc)) from None
    # Statistics over all packed shards (including ones written by an earlier run).
    outputs = stage.parts(SHARD_SUFFIX)
    sequences = packs = tokens = 0
    seq = 0
    for path in outputs:
        info = read_shard_info(path)
        sequences += int(info.attrs.get("source_sequences", 0))
        packs += info.num_samples
        seq = info.sequence_length
        tokens += int(info.attrs.get("tokens", 0))
    stats = PackingStats(sequences=sequences, packs=packs, tokens=tokens, sequence_length=seq)
    log.info("packed %d sequences into %d rows (%s): padding %.1f%% -> %.1f%%, %.3fx sequences "
             "per row", sequences, packs, strategy, 100 * stats.padding_before,
             100 * stats.padding_after, stats.speedup)
    return stage.finish([storage.name_of(p) for p in outputs], stats.as_dict())


@dataclass
class WikipediaResult:
    """Where `prepare_wikipedia` put things, and each stage's completion record."""

    output_dir: Location
    vocab: Location
    instances: Location
    packed: Location | None
    records: dict


def prepare_wikipedia(dump: str | os.PathLike, output_dir: str | os.PathLike,
                      options: InstanceOptions, *, vocab: str | os.PathLike | None = None,
                      vocab_size: int = DEFAULT_VOCAB_SIZE, workers: int | None = None,
                      splitter: str = "nupunkt", min_sentences: int = DEFAULT_MIN_SENTENCES,
                      part_bytes: int = DEFAULT_PART_BYTES, pack: bool = True,
                      strategy: str = "spfhp",
                      max_sequences_per_pack: int = DEFAULT_MAX_SEQUENCES_PER_PACK,
                      strict: bool = False) -> WikipediaResult:
    """All stages: dump → extracted → sentences → (vocab) → instances → (packed); `strict`
    as `create_instances` takes it."""
    workers = workers or default_workers()
    out = storage.location(output_dir)
    options.validate()
    if vocab is not None:
        # A missing or unreadable vocabulary fails before extraction.
        load_tokenizer(storage.local_file(storage.location(vocab)))
    records: dict = {}
    records["extract"] = extract_dump(dump, storage.join(out, "extracted"), workers,
                                      part_bytes)
    extracted = storage.list_parts(storage.join(out, "extracted"), f"part-*.{EXTRACT_SUFFIX}")
    records["sentences"] = split_sentences(extracted, storage.join(out, "sentences"), workers,
                                           splitter, min_sentences, strict=strict)
    sentence_parts = storage.list_parts(storage.join(out, "sentences"), "part-*.txt")
    if vocab is None:
        vocab_path = storage.join(out, "vocab.txt")
        if storage.exists(vocab_path):
            log.info("%s: vocabulary already trained", vocab_path)
        else:
            train_vocab(sentence_parts, vocab_path, vocab_size)
    else:
        vocab_path = storage.location(vocab)
    instances_dir = storage.join(out, instances_dir_name(options))
    records["instances"] = create_instances(sentence_parts, vocab_path, instances_dir,
                                            options, workers, strict)
    packed_dir = None
    if pack:
        packed_dir = storage.join(out, packed_dir_name(options))
        shards = storage.list_parts(instances_dir, f"part-*.{SHARD_SUFFIX}")
        records["pack"] = pack_shards(shards, packed_dir, strategy=strategy,
                                      max_sequences_per_pack=max_sequences_per_pack,
                                      seed=options.seed, workers=workers)
    return WikipediaResult(out, vocab_path, instances_dir, packed_dir, records)
