"""WordPiece tokenization over a BERT `vocab.txt`, backed by Hugging Face `tokenizers`.

One wrapper so every part of popbert (pre-training data, SQuAD, export checks) agrees on special
token ids, vocabulary size and the vocabulary's identity (its sha256, recorded in every shard).
The WordPiece algorithm itself is HF's Rust implementation, never re-implemented here.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Sequence
from importlib import resources
from pathlib import Path

import numpy as np
from tokenizers import BertWordPieceTokenizer

from popbert.data.errors import DataError

log = logging.getLogger(__name__)

PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"
CLS_TOKEN = "[CLS]"
SEP_TOKEN = "[SEP]"
MASK_TOKEN = "[MASK]"
SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN)
WORDPIECE_PREFIX = "##"


def _resource(name: str) -> Path:
    return Path(str(resources.files("popbert.data").joinpath("resources", name)))


def bundled_corpus_path() -> Path:
    """Path of the bundled Wikipedia slice (Google format), so runs work from a fresh clone."""
    return _resource("wiki_corpus.txt")


def bundled_vocab_path() -> Path:
    """Path of the bundled 8192-entry uncased WordPiece vocabulary trained on the bundled corpus."""
    return _resource("vocab.txt")


def file_sha256(path: str | os.PathLike) -> str:
    """Hex sha256 of a file's bytes: the identity of a vocabulary recorded in shards."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class WordPieceTokenizer:
    """A BERT WordPiece tokenizer loaded from a `vocab.txt` (one token per line, id = line).

    `lowercase=True` also strips accents (BERT "uncased"). Special tokens `[PAD] [UNK] [CLS]
    [SEP] [MASK]` must be in the vocabulary; their ids are read from it, not assumed.
    """

    def __init__(self, vocab_path: str | os.PathLike | None = None, lowercase: bool = True):
        path = Path(vocab_path) if vocab_path is not None else bundled_vocab_path()
        if not path.is_file():
            raise DataError(f"{path}: vocabulary file not found")
        with open(path, encoding="utf-8") as f:
            tokens = [line.rstrip("\n").rstrip("\r") for line in f]
        while tokens and tokens[-1] == "":
            tokens.pop()
        if not tokens:
            raise DataError(f"{path}: vocabulary file is empty")
        index = {}
        for i, token in enumerate(tokens):
            index.setdefault(token, i)
        missing = [t for t in SPECIAL_TOKENS if t not in index]
        if missing:
            raise DataError(f"{path}: vocabulary lacks special tokens {', '.join(missing)}")
        if len(index) != len(tokens):
            log.warning("%s: %d duplicate vocabulary entries; the first id of each is used",
                        path, len(tokens) - len(index))

        self.vocab_path = path
        self.lowercase = lowercase
        self._tokens = tokens
        self._index = index
        self.vocab_sha256 = file_sha256(path)
        self.pad_id = index[PAD_TOKEN]
        self.unk_id = index[UNK_TOKEN]
        self.cls_id = index[CLS_TOKEN]
        self.sep_id = index[SEP_TOKEN]
        self.mask_id = index[MASK_TOKEN]
        self.special_ids = frozenset(index[t] for t in SPECIAL_TOKENS)
        # True for "##xx" pieces: lets whole-word masking group a word's pieces by id alone.
        self.is_continuation = np.fromiter(
            (t.startswith(WORDPIECE_PREFIX) and len(t) > len(WORDPIECE_PREFIX) for t in tokens),
            dtype=bool, count=len(tokens))
        self.backend = BertWordPieceTokenizer(
            index, unk_token=UNK_TOKEN, sep_token=SEP_TOKEN, cls_token=CLS_TOKEN,
            pad_token=PAD_TOKEN, mask_token=MASK_TOKEN, clean_text=True,
            handle_chinese_chars=True, strip_accents=lowercase, lowercase=lowercase,
            wordpieces_prefix=WORDPIECE_PREFIX)
        # Text is data: a literal "[SEP]" in a sentence is tokenized as characters (as Google's
        # tokenizer does), never turned into the control token.
        self.backend._tokenizer.encode_special_tokens = True

    @property
    def vocab_size(self) -> int:
        """Number of lines in vocab.txt: the model's embedding rows."""
        return len(self._tokens)

    def encode_batch(self, sentences: Sequence[str]) -> list[list[int]]:
        """Token ids of many sentences at once (Rust, parallel), no [CLS]/[SEP] added."""
        if not sentences:
            return []
        encodings = self.backend.encode_batch(list(sentences), add_special_tokens=False)
        return [e.ids for e in encodings]

    def encode(self, text: str) -> list[int]:
        """Token ids of one text, no special tokens added."""
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        """Readable text from ids (WordPiece pieces joined, specials dropped by default)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str:
        """The vocabulary entry of an id."""
        return self._tokens[int(token_id)]

    def token_to_id(self, token: str) -> int | None:
        """The id of a vocabulary entry, None if absent."""
        return self._index.get(token)

    def convert_ids_to_tokens(self, ids: Iterable[int]) -> list[str]:
        """Vocabulary entries of many ids."""
        return [self._tokens[int(i)] for i in ids]

    def normalize(self, text: str) -> str:
        """The text as the tokenizer sees it before splitting (lowercased, accents stripped)."""
        return self.backend.normalizer.normalize_str(text)

    def __repr__(self) -> str:
        return (f"WordPieceTokenizer({str(self.vocab_path)!r}, vocab_size={self.vocab_size}, "
                f"lowercase={self.lowercase})")
