"""WordPiece tokenization over a BERT `vocab.txt`, backed by Hugging Face `tokenizers`.

One place for how popbert reads a vocabulary and configures WordPiece, so every part of it
(pre-training data, SQuAD windows, serving an exported model from the vocabulary in its
metadata) agrees on special token ids, lowercasing and token offsets. `WordPieceTokenizer` wraps
a `vocab.txt` file and adds what pre-training needs (vocabulary size, its sha256 recorded in
every shard); `parse_vocab` + `make_tokenizer` + `encode_texts` are the lighter path SQuAD and
serving use. The WordPiece algorithm itself is HF's Rust implementation, never re-implemented.
This module imports no torch: `popbert.serve` depends on it.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
from tokenizers import BertWordPieceTokenizer, Tokenizer

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


def read_vocab_text(path: str | os.PathLike) -> str:
    """The text of a `vocab.txt`; a file that is not UTF-8 (a binary file, a vocabulary saved
    in another encoding) is a DataError naming it, not a UnicodeDecodeError from deep inside.

    Text mode turns "\r\n" and a lone "\r" into "\n", as reading the file line by line did.
    """
    try:
        return Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        bad = error.object[error.start:error.start + 1].hex()
        raise DataError(f"{path}: not a vocabulary: expected UTF-8 text, one WordPiece token a "
                        f"line (byte 0x{bad} at offset {error.start} is not UTF-8)") from None


def vocab_tokens(text: str) -> list[str]:
    """The entries of `vocab.txt` content, one a line (id = line number), trailing blanks cut.

    Lines end at "\n" only (a stray "\r" before it is dropped): `\u2028` and friends are
    legitimate characters of a vocabulary entry, so `str.splitlines` would shift the ids.
    """
    tokens = [line.rstrip("\r") for line in text.split("\n")]
    while tokens and tokens[-1] == "":
        tokens.pop()
    return tokens


def vocab_index(tokens: Sequence[str], source: str = "vocabulary") -> dict[str, int]:
    """Token → id of a vocabulary's entries; a duplicated token keeps its first id.

    Raises a DataError naming `source` when the vocabulary is empty or lacks one of the special
    tokens, since every model input starts with [CLS] and the ids are read, not assumed.
    """
    if not tokens:
        raise DataError(f"{source}: vocabulary is empty")
    index: dict[str, int] = {}
    for i, token in enumerate(tokens):
        index.setdefault(token, i)
    missing = [t for t in SPECIAL_TOKENS if t not in index]
    if missing:
        raise DataError(f"{source}: vocabulary lacks special tokens {', '.join(missing)}")
    return index


def parse_vocab(text: str, source: str = "vocabulary") -> dict[str, int]:
    """`vocab.txt` content → token → id, exactly as `WordPieceTokenizer` reads the file."""
    return vocab_index(vocab_tokens(text), source)


def make_tokenizer(vocab: Mapping[str, int], lowercase: bool = True) -> Tokenizer:
    """A Hugging Face WordPiece tokenizer over `vocab` with BERT's normalisation.

    `lowercase=True` also strips accents (BERT "uncased"). `WordPieceTokenizer` uses it as its
    backend, so pre-training data, SQuAD windows and serving tokenize text identically.
    """
    bert = BertWordPieceTokenizer(
        dict(vocab), unk_token=UNK_TOKEN, sep_token=SEP_TOKEN, cls_token=CLS_TOKEN,
        pad_token=PAD_TOKEN, mask_token=MASK_TOKEN, clean_text=True, handle_chinese_chars=True,
        strip_accents=lowercase, lowercase=lowercase, wordpieces_prefix=WORDPIECE_PREFIX)
    # The wrapper keeps its `Tokenizer` private; its serialised form rebuilds one we may set.
    tokenizer = Tokenizer.from_str(bert.to_str())
    # Text is data: a literal "[SEP]" in a sentence or question is tokenized as characters (as
    # Google's tokenizer does), never turned into the control token.
    tokenizer.encode_special_tokens = True
    return tokenizer


@dataclass
class Encoding:
    """A text's WordPiece ids and each token's (start, end) character offsets in the text.

    The offsets let SQuAD cut answers out of the original context, not out of normalised text.
    """

    ids: list[int]
    offsets: list[tuple[int, int]]


def encode_texts(tokenizer: Tokenizer, texts: Sequence[str]) -> list[Encoding]:
    """Encode many texts at once (Rust, parallel), without special tokens."""
    if not texts:
        return []
    return [Encoding(list(e.ids), [tuple(o) for o in e.offsets])
            for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]


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
        tokens = vocab_tokens(read_vocab_text(path))
        index = vocab_index(tokens, str(path))
        if len(index) != len(tokens):
            log.warning("%s: %d duplicate vocabulary entries; the first id of each is used",
                        path, len(tokens) - len(index))

        self.vocab_path = path
        self.lowercase = lowercase
        self._tokens = tokens
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
        self.backend = make_tokenizer(index, lowercase)

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

    def __repr__(self) -> str:
        return (f"WordPieceTokenizer({str(self.vocab_path)!r}, vocab_size={self.vocab_size}, "
                f"lowercase={self.lowercase})")
