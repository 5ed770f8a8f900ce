"""Stage `vocab`: train an uncased WordPiece vocabulary (`vocab.txt`) with HF `tokenizers`, or a
byte-level BPE `tokenizer.json` (`train_bpe`, ModernBERT's kind of tokenizer) with BERT's special
tokens.

The trainer (Rust, multi-threaded, streaming over the files) learns the token set; ids are then
fixed deterministically: the five special tokens first (`[PAD]`=0 ... `[MASK]`=4, what BERT
checkpoints and popbert's shards assume), every other entry in code-point order, because the
trainer emits tokens with tied merge counts in a run-dependent order. WordPiece tokenization is
greedy longest-match, so it depends on the set only, never on the ids.

The set itself is not always reproducible: the trainer breaks ties between equally frequent merges
by ids it assigns in hash-map order, which differs between processes (huggingface/tokenizers
issue 1794), so two runs on a small corpus can learn a few different tokens. Every later stage is
deterministic for a given vocabulary: keep `vocab.txt` (or pass `--vocab`) to reproduce shards.
"""

from __future__ import annotations

import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from popbert.data import storage
from popbert.data.corpus import has_text, name_files
from popbert.data.errors import DataError
from popbert.data.tokenization import (
    CLS_TOKEN,
    SEP_TOKEN,
    SPECIAL_TOKENS,
    JsonTokenizer,
    WordPieceTokenizer,
)

log = logging.getLogger(__name__)

DEFAULT_VOCAB_SIZE = 30522


def _training_files(files: Sequence[str | os.PathLike], vocab_size: int) -> list[str]:
    """The corpus files, checked: they exist, hold text, and the size leaves room for text."""
    if vocab_size <= len(SPECIAL_TOKENS):
        raise DataError(f"vocab_size must be > {len(SPECIAL_TOKENS)}, got {vocab_size}")
    missing = [f for f in files if not storage.exists(storage.location(f))]
    if missing:
        raise DataError(f"{missing[0]}: vocabulary training input not found")
    # The trainer reads local files: remote ones are read from their copies in the cache.
    paths = [str(storage.local_file(storage.location(f))) for f in files]
    if not paths:
        raise DataError("no text files to train a vocabulary on")
    if not any(has_text(p) for p in paths):  # the trainer would write the 5 specials alone
        raise DataError(f"{name_files(paths)}: empty corpus: no text to train a vocabulary on")
    return paths


def train_vocab(files: Sequence[str | os.PathLike], output: str | os.PathLike,
                vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2,
                limit_alphabet: int = 1000) -> WordPieceTokenizer:
    """Train on Google-format text files and write `output` atomically; returns its tokenizer.

    A corpus too small for `vocab_size` gives a smaller vocabulary (logged); the model's
    `vocab_size` must then be set to the file's line count.
    """
    from tokenizers import BertWordPieceTokenizer

    paths = _training_files(files, vocab_size)
    trainer = BertWordPieceTokenizer(clean_text=True, handle_chinese_chars=True,
                                     strip_accents=True, lowercase=True)
    log.info("training a %d-entry WordPiece vocabulary on %d file(s)", vocab_size, len(paths))
    trainer.train(files=paths, vocab_size=vocab_size, min_frequency=min_frequency,
                  limit_alphabet=limit_alphabet, special_tokens=list(SPECIAL_TOKENS),
                  wordpieces_prefix="##", show_progress=sys.stderr.isatty())
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(trainer.save_model(tmp)[0])
        lines = written.read_text(encoding="utf-8").splitlines()
    specials = list(SPECIAL_TOKENS)
    if lines[: len(specials)] != specials:
        raise DataError(f"trained vocabulary does not start with {specials}: {lines[:5]}")
    lines = specials + sorted(lines[len(specials):])
    if len(lines) < vocab_size:
        log.warning("corpus yields only %d vocabulary entries (asked for %d)", len(lines),
                    vocab_size)
    output = _publish_text(output, "\n".join(lines) + "\n")
    log.info("wrote %s (%d entries)", output, len(lines))
    return WordPieceTokenizer(storage.local_file(output))


def train_bpe(files: Sequence[str | os.PathLike], output: str | os.PathLike,
              vocab_size: int = DEFAULT_VOCAB_SIZE, min_frequency: int = 2) -> JsonTokenizer:
    """Train a byte-level BPE `tokenizer.json` (cased, no normaliser: the kind ModernBERT uses)
    on text files and write `output` atomically; returns its tokenizer.

    BERT's five special tokens take ids 0-4 (`[PAD]` first, as the shards' padding assumes) and
    a `[CLS] A [SEP] (B [SEP])` post-processor makes `transformers`' `AutoTokenizer` add them as
    popbert's data does. Byte-level: no text is ever `[UNK]`.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    paths = _training_files(files, vocab_size)
    tokenizer = Tokenizer(models.BPE(unk_token=None))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=sys.stderr.isatty())
    log.info("training a %d-entry byte-level BPE tokenizer on %d file(s)", vocab_size,
             len(paths))
    tokenizer.train(paths, trainer)
    cls, sep = tokenizer.token_to_id(CLS_TOKEN), tokenizer.token_to_id(SEP_TOKEN)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{CLS_TOKEN} $A {SEP_TOKEN}", pair=f"{CLS_TOKEN} $A {SEP_TOKEN} $B:1 {SEP_TOKEN}:1",
        special_tokens=[(CLS_TOKEN, cls), (SEP_TOKEN, sep)])
    ids = [tokenizer.token_to_id(t) for t in SPECIAL_TOKENS]
    if ids != list(range(len(SPECIAL_TOKENS))):
        raise DataError(f"trained tokenizer's special ids are {ids}, expected 0-4")
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size < vocab_size:
        log.warning("corpus yields only %d tokens (asked for %d)", size, vocab_size)
    output = _publish_text(output, tokenizer.to_str(pretty=True))
    log.info("wrote %s (%d tokens, byte-level BPE)", output, size)
    return JsonTokenizer(storage.local_file(output))


def _publish_text(output: str | os.PathLike, text: str) -> storage.Location:
    """Write a trained vocabulary whole: a local file atomically, or one object."""
    where = storage.location(output)
    storage.write_bytes(where, text.encode("utf-8"))
    return where
