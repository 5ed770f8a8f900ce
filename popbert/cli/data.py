"""`popbert prepare-data`: the data pipeline's commands, one per stage plus `wikipedia` (all).

    popbert prepare-data wikipedia --input enwiki-latest-pages-articles.xml.bz2 \\
        --output-dir data/wiki --sequence-length 128 --max-predictions 20 [--vocab vocab.txt]

runs extract → sentences → vocab (when no --vocab is given) → instances → pack; each stage is
also a command of its own. Every stage is parallel over `--workers` processes (default: all
cores) or, with `--dask ADDRESS` (or $DASK_SCHEDULER_ADDRESS), over a Dask cluster's workers;
resumable (finished parts are skipped) and deterministic for `--seed` either way. Heavy modules
are imported inside the handlers so `--help` and flag errors stay instant.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

from popbert.errors import UsageError
from popbert.io import paths
from popbert.rules import PER_MACHINE

logger = logging.getLogger("popbert")

# InstanceOptions field -> the flag that sets it (so validation errors name the flag).
_FLAGS = {"sequence_length": "--sequence-length", "max_predictions_per_seq": "--max-predictions",
          "masked_lm_prob": "--masked-lm-prob", "short_seq_prob": "--short-seq-prob",
          "random_next_prob": "--random-next-prob", "dupe_factor": "--dupe-factor"}


def _output_dir(args: argparse.Namespace):
    """--output-dir (a directory, or a URL prefix on object storage), checked before the stage
    reads anything: a file there (or above it), a missing bucket or refused credentials would
    end the stage in a traceback once it starts writing."""
    from popbert.data import storage
    from popbert.io.paths import check_output_directory

    where = storage.location(args.output_dir)
    if isinstance(where, Path):
        check_output_directory(where)
    else:
        _reachable(where, "--output-dir")
    return where


def _reachable(url: str, flag: str) -> None:
    from popbert.data import storage
    from popbert.data.errors import DataError

    try:
        storage.check_reachable(url)
    except DataError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _workers(args: argparse.Namespace) -> int:
    from popbert.data.stages import default_workers

    if args.workers is None:
        return default_workers()
    if not PER_MACHINE.allows(args.workers):
        raise UsageError(f"--workers must be {PER_MACHINE.expected}, got {args.workers}")
    return args.workers


def _on_cluster(handler: Callable[[argparse.Namespace], int]
                ) -> Callable[[argparse.Namespace], int]:
    """`handler` run on the Dask cluster that `--dask` (else $DASK_SCHEDULER_ADDRESS) names,
    or on the local pool when neither is set."""

    @functools.wraps(handler)
    def run(args: argparse.Namespace) -> int:
        from popbert.data.cluster import ADDRESS_VARIABLE, DEFAULT_WAIT_S, scheduler_address

        address = scheduler_address(args.dask)
        if args.dask_wait is not None and not args.dask_wait > 0:
            raise UsageError(f"--dask-wait must be > 0 seconds, got {args.dask_wait}")
        if address is None:
            if args.dask_wait is not None:  # accepted, it would do nothing
                raise UsageError(f"--dask-wait: only with --dask ADDRESS (or "
                                 f"${ADDRESS_VARIABLE}); without them the units run on local "
                                 f"processes")
            return handler(args)
        from popbert.data.cluster import cluster_slots, on_cluster, worker_count
        from popbert.data.errors import DataError

        # The output's own faults (a malformed bucket, this machine's credentials) are said
        # as the output's, before any worker is asked about it.
        _output_dir(args)
        source = "--dask" if args.dask else f"${ADDRESS_VARIABLE}"
        wait = args.dask_wait if args.dask_wait is not None else DEFAULT_WAIT_S
        with contextlib.ExitStack() as stack:
            try:
                client = stack.enter_context(on_cluster(address, wait=wait,
                                                        output=args.output_dir,
                                                        modules=_stage_modules(args)))
                logger.info("running the units on the Dask cluster at %s (%d worker(s), %d "
                            "thread(s) now)", address, worker_count(client),
                            cluster_slots(client))
            except DataError as exc:
                raise UsageError(f"{source}: {exc}") from None
            return handler(args)

    return run


def _stage_modules(args: argparse.Namespace) -> tuple[str, ...]:
    """What a Dask worker imports for this command's stages beyond what every stage needs:
    wikiextractor to extract, the sentence splitter, pyarrow for Parquet corpora."""
    modules = []
    if args.stage in ("wikipedia", "extract"):
        modules.append("wikiextractor.extract")
    if args.stage in ("wikipedia", "sentences"):
        modules.append(args.splitter)  # nupunkt and pysbd are their modules' names
    if args.stage == "sentences" and (args.format == "parquet" or any(
            item.strip().endswith((".parquet", ".pq")) for item in str(args.input).split(","))):
        modules.append("pyarrow.parquet")
    return tuple(modules)


def _options(args: argparse.Namespace):
    from popbert.data.instances import InstanceOptions

    options = InstanceOptions(
        sequence_length=args.sequence_length, max_predictions_per_seq=args.max_predictions,
        masked_lm_prob=args.masked_lm_prob, short_seq_prob=args.short_seq_prob,
        dupe_factor=args.dupe_factor, whole_word_mask=args.whole_word_mask, seed=args.seed)
    try:
        options.validate()
    except ValueError as exc:
        message = str(exc)
        for field, flag in _FLAGS.items():
            message = re.sub(rf"\b{field}\b", flag, message)
        raise UsageError(message) from None
    return options


def _check_vocab(vocab: str) -> None:
    """--vocab readable as a vocabulary or tokenizer, checked before any stage starts."""
    from popbert.data import storage
    from popbert.data.errors import DataError
    from popbert.data.tokenization import load_tokenizer

    try:
        if not storage.exists(storage.location(vocab)):
            raise UsageError(f"--vocab: {vocab} not found")
        load_tokenizer(storage.local_file(storage.location(vocab)))
    except DataError as exc:
        raise UsageError(f"--vocab: {exc}") from None


def _part_bytes(args: argparse.Namespace) -> int:
    if args.part_size_mb <= 0:
        raise UsageError(f"--part-size-mb must be > 0, got {args.part_size_mb}")
    return max(1, int(args.part_size_mb * (1 << 20)))


def _parts(spec: str, suffix: str, flag: str = "--input") -> list:
    """A stage directory (its part-*.<suffix>) or files / globs, comma-separated; local paths
    or URLs."""
    from popbert.data import storage
    from popbert.data.corpus import expand_input_files
    from popbert.data.errors import DataError

    try:
        where = storage.location(spec)
        if "," not in spec and storage.is_directory(where):
            parts = storage.list_parts(where, f"part-*.{suffix}")
            if not parts:
                raise UsageError(f"{flag}: {where} has no part-*.{suffix} files")
            return parts
        return expand_input_files(spec)
    except DataError as exc:
        raise UsageError(f"{flag}: {exc}") from None


def _report(record: dict) -> None:
    logger.info("%s: %s", record.get("stage"), json.dumps(record.get("stats", {})))


def _cmd_extract(args: argparse.Namespace) -> int:
    from popbert.data.wikipedia import extract_dump

    _report(extract_dump(args.input, _output_dir(args), _workers(args), _part_bytes(args)))
    return 0


def _cmd_sentences(args: argparse.Namespace) -> int:
    from popbert.data.sentences import split_sentences

    parts = _parts(args.input, "jsonl")
    part_bytes = None if args.part_size_mb is None else _part_bytes(args)
    _report(split_sentences(parts, _output_dir(args), _workers(args), args.splitter,
                            args.min_sentences, fmt=args.format, text_field=args.text_field,
                            part_bytes=part_bytes, strict=args.strict))
    return 0


def _cmd_vocab(args: argparse.Namespace) -> int:
    from popbert.data.tokenization import is_tokenizer_json
    from popbert.data.vocab import train_bpe, train_vocab
    from popbert.io.paths import check_output_file

    if args.vocab_size <= 5:
        raise UsageError(f"--vocab-size must be > 5, got {args.vocab_size}")
    if (args.model == "bpe") != is_tokenizer_json(args.output):
        expected = "a tokenizer.json (.json)" if args.model == "bpe" else "a vocab.txt (not .json)"
        raise UsageError(f"--output: --model {args.model} writes {expected}, got {args.output}")
    from popbert.data import storage

    output = storage.location(args.output)
    if isinstance(output, Path):
        check_output_file(output, "--output")
    else:
        _reachable(output, "--output")
    train = train_bpe if args.model == "bpe" else train_vocab
    tokenizer = train(_parts(args.input, "txt"), args.output, args.vocab_size,
                      args.min_frequency)
    logger.info("vocabulary %s: %d entries, sha256 %s", args.output, tokenizer.vocab_size,
                tokenizer.vocab_sha256)
    return 0


def _cmd_instances(args: argparse.Namespace) -> int:
    from popbert.data.prepare import create_instances

    options = _options(args)
    _check_vocab(args.vocab)
    _report(create_instances(_parts(args.input, "txt"), args.vocab, _output_dir(args), options,
                             _workers(args), args.strict))
    return 0


def _check_pack_args(args: argparse.Namespace) -> None:
    if args.max_sequences_per_pack < 1:
        raise UsageError(f"--max-sequences-per-pack must be >= 1, "
                         f"got {args.max_sequences_per_pack}")


def _cmd_pack(args: argparse.Namespace) -> int:
    from popbert.data.prepare import pack_shards

    _check_pack_args(args)
    if args.max_predictions_per_pack is not None and args.max_predictions_per_pack < 1:
        raise UsageError(f"--max-predictions-per-pack must be >= 1, "
                         f"got {args.max_predictions_per_pack}")
    record = pack_shards(_parts(args.input, "h5"), _output_dir(args), strategy=args.strategy,
                         max_sequences_per_pack=args.max_sequences_per_pack,
                         max_predictions_per_pack=args.max_predictions_per_pack,
                         seed=args.seed, workers=_workers(args))
    _report(record)
    return 0


def training_overrides(shard_dir, vocab) -> list[str]:
    """The `popbert pretrain` --set flags that point a run at a stage's shards (local paths
    or URLs)."""
    from popbert.data import storage
    from popbert.data.hdf5 import read_shard_info
    from popbert.data.tokenization import load_tokenizer

    shards = storage.list_parts(shard_dir, "part-*.h5")
    if not shards:
        return []
    info = read_shard_info(shards[0])
    size = load_tokenizer(storage.local_file(vocab)).vocab_size
    flags = [f"--set 'data.input_files=[\"{storage.join(shard_dir, 'part-*.h5')}\"]'",
             f"--set data.vocab_file={vocab}",
             f"--set model.vocab_size={size}",
             f"--set model.sequence_length={info.sequence_length}",
             f"--set model.max_predictions_per_seq={info.max_predictions_per_seq}"]
    if info.packed:
        flags += ["--set model.packed=true",
                  f"--set model.max_sequences_per_pack={info.max_sequences_per_pack}"]
    return flags


def _cmd_wikipedia(args: argparse.Namespace) -> int:
    from popbert.data.prepare import prepare_wikipedia

    options = _options(args)
    _check_pack_args(args)
    if args.vocab is not None:
        _check_vocab(args.vocab)
    from popbert.data import storage
    from popbert.data.errors import DataError

    try:
        found = storage.exists(storage.location(args.input))
    except DataError as exc:
        raise UsageError(f"--input: {exc}") from None
    if not found:
        raise UsageError(f"--input: {args.input} not found")
    result = prepare_wikipedia(
        args.input, _output_dir(args), options, vocab=args.vocab, vocab_size=args.vocab_size,
        workers=_workers(args), splitter=args.splitter, min_sentences=args.min_sentences,
        part_bytes=_part_bytes(args), pack=not args.no_pack, strategy=args.strategy,
        max_sequences_per_pack=args.max_sequences_per_pack, strict=args.strict)
    for record in result.records.values():
        _report(record)
    shards = result.packed if result.packed is not None else result.instances
    logger.info("done; train on it with: %s", " ".join(training_overrides(shards, result.vocab)))
    return 0


def _add_common(p: argparse.ArgumentParser, output_help: str) -> None:
    p.add_argument("--output-dir", "-o", required=True, metavar="DIR", type=paths.DATA_OUTPUT_DIR,
                   help=output_help)
    p.add_argument("--workers", "-j", type=int, default=None, metavar="N",
                   help="worker processes (default: every CPU this process may use, a "
                        "container's CPU limit included)")
    p.add_argument("--dask", default=None, metavar="ADDRESS",
                   help="run the work units on this Dask scheduler's workers instead, e.g. "
                        "tcp://10.0.0.5:8786 (default: $DASK_SCHEDULER_ADDRESS when set; "
                        "needs pip install 'popbert[dask]')")
    p.add_argument("--dask-wait", type=float, default=None, metavar="SECONDS",
                   help="with --dask: how long to wait for a worker, at the start and whenever "
                        "none is left, before stopping in one line (default 120)")


def _add_split_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--splitter", choices=("nupunkt", "pysbd"), default="nupunkt",
                   help="sentence splitter (both need no download; default nupunkt, the faster)")
    p.add_argument("--min-sentences", type=int, default=2, metavar="N",
                   help="drop documents with fewer sentences (default 2)")


def _add_instance_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sequence-length", type=int, required=True, metavar="S")
    p.add_argument("--max-predictions", type=int, required=True, metavar="P",
                   help="masked-LM predictions per sequence (Google: 20 at 128, 80 at 512)")
    p.add_argument("--dupe-factor", type=int, default=5, metavar="N",
                   help="passes over the corpus, each with different masks (default 5)")
    p.add_argument("--masked-lm-prob", type=float, default=0.15)
    p.add_argument("--short-seq-prob", type=float, default=0.1)
    p.add_argument("--whole-word-mask", action="store_true",
                   help="mask all WordPiece pieces of a word together")
    p.add_argument("--seed", type=int, default=12345)
    p.add_argument("--strict", action="store_true",
                   help="stop, leaving nothing, when a part's share of [UNK] tokens shows the "
                        "vocabulary does not fit the text (above 2%%), or a sentence is longer "
                        "than a sequence holds (S - 3 tokens; the rest would be cut); without: "
                        "a warning")


def _add_pack_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--strategy", choices=("spfhp", "lpfhp"), default="spfhp",
                   help="histogram packing: shortest-pack-first (default) or longest-pack-first")
    p.add_argument("--max-sequences-per-pack", type=int, default=3, metavar="K")


def add_commands(subparsers: argparse._SubParsersAction,
                 common_parent: argparse.ArgumentParser) -> None:
    """Register `prepare-data` and its stages on the `popbert` argparse tree."""
    top = subparsers.add_parser(
        "prepare-data", parents=[common_parent],
        help="Wikipedia dump -> sentences -> vocab -> HDF5 shards -> packed shards",
        description="Pre-training data pipeline. `wikipedia` runs every stage; each stage is "
                    "also a command. Parallel, resumable (re-running skips finished parts), "
                    "deterministic for --seed.")
    stages = top.add_subparsers(dest="stage", metavar="STAGE", required=True)

    p = stages.add_parser("wikipedia", parents=[common_parent],
                          help="all stages: dump -> packed HDF5 shards")
    p.add_argument("--input", required=True, metavar="DUMP.xml.bz2", type=paths.DUMP,
                   help="a MediaWiki XML dump, e.g. enwiki-latest-pages-articles.xml.bz2")
    p.add_argument("--vocab", default=None, metavar="VOCAB.txt", type=paths.VOCAB,
                   help="an existing WordPiece vocab.txt or tokenizer.json; default: train a "
                        "vocab.txt (--vocab-size)")
    p.add_argument("--vocab-size", type=int, default=30522, metavar="N")
    _add_common(p, "root directory for every stage's output")
    _add_split_args(p)
    _add_instance_args(p)
    _add_pack_args(p)
    p.add_argument("--no-pack", action="store_true", help="stop after the instance shards")
    p.add_argument("--part-size-mb", type=float, default=8.0, metavar="MB",
                   help="wikitext per work unit and shard (default 8; memory per worker "
                        "grows with it)")
    p.set_defaults(handler=_on_cluster(_cmd_wikipedia))

    p = stages.add_parser("extract", parents=[common_parent],
                          help="dump -> plain-text articles (JSON lines), by wikiextractor")
    p.add_argument("--input", required=True, metavar="DUMP.xml.bz2", type=paths.DUMP)
    _add_common(p, "directory for part-*.jsonl")
    p.add_argument("--part-size-mb", type=float, default=8.0, metavar="MB",
                   help="wikitext per part (default 8)")
    p.set_defaults(handler=_on_cluster(_cmd_extract))

    p = stages.add_parser("sentences", parents=[common_parent],
                          help="articles -> one sentence per line, blank line between documents")
    p.add_argument("--input", required=True, metavar="DIR_OR_GLOB", type=paths.CORPUS,
                   help="the extract stage's directory, or corpus files (comma-separated, "
                        "globs): JSON lines, Parquet, or text with one document a line")
    _add_common(p, "directory for part-*.txt")
    _add_split_args(p)
    p.add_argument("--format", choices=("jsonl", "parquet", "lines"), default=None,
                   help="the input's format (default: by suffix: .jsonl/.json/.ndjson, "
                        ".parquet/.pq, .txt/.text = one document a line)")
    p.add_argument("--text-field", default="text", metavar="NAME",
                   help="the JSON field or Parquet column holding the text (default: text)")
    p.add_argument("--part-size-mb", type=float, default=None, metavar="MB",
                   help="cut input files into work units of about this much (byte ranges of "
                        "text, runs of Parquet row groups); default: a unit per file")
    p.add_argument("--strict", action="store_true",
                   help="stop, leaving nothing, at a document without text (an empty or "
                        "missing text, a JSON or Parquet null); without: left out, counted and "
                        "said once")
    p.set_defaults(handler=_on_cluster(_cmd_sentences))

    p = stages.add_parser("vocab", parents=[common_parent],
                          help="train an uncased WordPiece vocab.txt, or a byte-level BPE "
                               "tokenizer.json (--model bpe), with HF tokenizers")
    p.add_argument("--input", required=True, metavar="DIR_OR_GLOB", type=paths.TEXT,
                   help="the sentences stage's directory, or text files")
    p.add_argument("--output", "-o", required=True, metavar="VOCAB.txt|TOKENIZER.json",
                   type=paths.DATA_OUTPUT_FILE)
    p.add_argument("--model", choices=("wordpiece", "bpe"), default="wordpiece",
                   help="wordpiece: BERT's uncased vocab.txt (default); bpe: a cased "
                        "byte-level BPE tokenizer.json with BERT's special tokens, "
                        "ModernBERT's kind")
    p.add_argument("--vocab-size", type=int, default=30522, metavar="N")
    p.add_argument("--min-frequency", type=int, default=2, metavar="N")
    p.set_defaults(handler=_cmd_vocab)

    p = stages.add_parser("instances", parents=[common_parent],
                          help="sentences -> masked MLM/NSP instances in HDF5 shards")
    p.add_argument("--input", required=True, metavar="DIR_OR_GLOB", type=paths.TEXT,
                   help="the sentences stage's directory, or Google-format text files")
    p.add_argument("--vocab", required=True, metavar="VOCAB.txt", type=paths.VOCAB,
                   help="a WordPiece vocab.txt or any Hugging Face tokenizer.json")
    _add_common(p, "directory for part-*.h5")
    _add_instance_args(p)
    p.set_defaults(handler=_on_cluster(_cmd_instances))

    p = stages.add_parser("pack", parents=[common_parent],
                          help="instance shards -> packed shards (several sequences per row)")
    p.add_argument("--input", required=True, metavar="DIR_OR_GLOB", type=paths.SHARDS,
                   help="the instances stage's directory, or *.h5 shards")
    _add_common(p, "directory for packed part-*.h5")
    _add_pack_args(p)
    p.add_argument("--max-predictions-per-pack", type=int, default=None, metavar="P",
                   help="MLM slots per packed row (default: the most a pack can need)")
    p.add_argument("--seed", type=int, default=12345)
    p.set_defaults(handler=_on_cluster(_cmd_pack))


__all__ = ["add_commands"]
