"""Tokenizers: a BERT `vocab.txt` (WordPiece) or any Hugging Face `tokenizer.json`, one interface.

One place for how popbert reads a vocabulary, so every part of it (pre-training data, SQuAD
windows, fine-tuning, serving an exported model from the vocabulary in its metadata) agrees on
special token ids, lowercasing and token offsets. `load_tokenizer(path)` is the door: a
`.json` file is a `JsonTokenizer` (BPE, WordPiece or Unigram, as `transformers.AutoTokenizer`
loads it; its special tokens read from it), anything else a `vocab.txt` read by
`WordPieceTokenizer`. Both give the same attributes: the special ids, `vocab_size`, the file's
sha256 recorded in every shard, `is_continuation` for whole-word masking, `roles` (special
token → id, what SQuAD windows need) and `backend`, the `tokenizers.Tokenizer` that encodes
with offsets. The algorithms are HF's Rust implementations, never re-implemented. This module
imports no torch: `popbert.serve` depends on it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
from tokenizers import BertWordPieceTokenizer, Tokenizer

from popbert.data.errors import DataError
from popbert.textfile import read_text

log = logging.getLogger(__name__)

PAD_TOKEN = "[PAD]"
UNK_TOKEN = "[UNK]"
CLS_TOKEN = "[CLS]"
SEP_TOKEN = "[SEP]"
MASK_TOKEN = "[MASK]"
SPECIAL_TOKENS = (PAD_TOKEN, UNK_TOKEN, CLS_TOKEN, SEP_TOKEN, MASK_TOKEN)
WORDPIECE_PREFIX = "##"
# The spellings a `tokenizer.json` may give each special token's role: BERT's, or RoBERTa's
# (the first one present is used).
ROLE_SPELLINGS = {PAD_TOKEN: ("[PAD]", "<pad>"), UNK_TOKEN: ("[UNK]", "<unk>"),
                  CLS_TOKEN: ("[CLS]", "<s>"), SEP_TOKEN: ("[SEP]", "</s>"),
                  MASK_TOKEN: ("[MASK]", "<mask>")}
# What a token starts with when it begins a word, by pre-tokenizer (byte-level BPE, SentencePiece).
WORD_START_MARKERS = {"ByteLevel": "\u0120", "Metaspace": "\u2581"}
TOKENIZER_JSON = "tokenizer.json"


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
    return read_text(path, "a WordPiece vocab.txt (UTF-8 text, one token a line)",
                     error=DataError)


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
    from popbert.data import storage

    digest = hashlib.sha256()
    with storage.open_input(storage.location(path)) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


class TextTokenizer:
    """What every tokenizer gives the rest of popbert (set by the subclasses): the special ids,
    `special_ids`, `is_continuation`, `vocab_sha256`, `vocab_path`, `backend`, and encoding."""

    vocab_path: Path
    vocab_sha256: str
    backend: Tokenizer
    _tokens: list[str]
    pad_id: int
    unk_id: int
    cls_id: int
    sep_id: int
    mask_id: int

    @property
    def roles(self) -> dict[str, int]:
        """Special token → id, under BERT's names (what SQuAD windows read)."""
        return {PAD_TOKEN: self.pad_id, UNK_TOKEN: self.unk_id, CLS_TOKEN: self.cls_id,
                SEP_TOKEN: self.sep_id, MASK_TOKEN: self.mask_id}

    @property
    def vocab_size(self) -> int:
        """Rows of the embedding the ids address."""
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
        """Readable text from ids (pieces joined, specials dropped by default)."""
        return self.backend.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)


class WordPieceTokenizer(TextTokenizer):
    """A BERT WordPiece tokenizer loaded from a `vocab.txt` (one token per line, id = line).

    `lowercase=True` also strips accents (BERT "uncased"). Special tokens `[PAD] [UNK] [CLS]
    [SEP] [MASK]` must be in the vocabulary; their ids are read from it, not assumed. `text`
    gives the file's content instead of a path (an export's metadata); `vocab_path` then only
    names it in messages.
    """

    def __init__(self, vocab_path: str | os.PathLike | None = None, lowercase: bool = True,
                 *, text: str | None = None):
        path = Path(vocab_path) if vocab_path is not None else bundled_vocab_path()
        if text is None:
            if not path.is_file():
                raise DataError(f"{path}: vocabulary file not found")
            text = read_vocab_text(path)
            self.vocab_sha256 = file_sha256(path)
        else:
            self.vocab_sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        tokens = vocab_tokens(text)
        index = vocab_index(tokens, str(path))
        if len(index) != len(tokens):
            log.warning("%s: %d duplicate vocabulary entries; the first id of each is used",
                        path, len(tokens) - len(index))

        self.vocab_path = path
        self.lowercase = lowercase
        self._tokens = tokens
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

    def __repr__(self) -> str:
        return (f"WordPieceTokenizer({str(self.vocab_path)!r}, vocab_size={self.vocab_size}, "
                f"lowercase={self.lowercase})")


class JsonTokenizer(TextTokenizer):
    """Any Hugging Face `tokenizer.json` (BPE, WordPiece or Unigram), with the attributes of
    `WordPieceTokenizer`: the five special roles are read from its vocabulary (BERT's or
    RoBERTa's spellings, `ROLE_SPELLINGS`), its normaliser and pre-tokenizer are its own (so
    `lowercase` is whatever the file says). Ids equal `transformers.AutoTokenizer`'s."""

    def __init__(self, path: str | os.PathLike, *, text: str | None = None):
        path = Path(path)
        if text is None:
            text = read_text(path, "a tokenizer.json", error=DataError)
        try:
            spec = json.loads(text)
            backend = Tokenizer.from_str(text)
        except Exception as error:  # JSON or tokenizers' own parse error: one line naming it
            message = " ".join(str(error).split())[:200]
            raise DataError(f"{path}: not a Hugging Face tokenizer.json ({message})") from None
        vocab = backend.get_vocab(with_added_tokens=True)
        roles: dict[str, int] = {}
        for role, spellings in ROLE_SPELLINGS.items():
            found = next((vocab[t] for t in spellings if t in vocab), None)
            if found is not None:
                roles[role] = found
        missing = [" or ".join(ROLE_SPELLINGS[r]) for r in ROLE_SPELLINGS if r not in roles]
        if missing:
            raise DataError(f"{path}: tokenizer lacks special tokens {', '.join(missing)}")
        self.vocab_path = path
        self.lowercase = None  # the file's normaliser decides
        self.vocab_sha256 = hashlib.sha256(text.encode("utf-8")).hexdigest()
        self._tokens = [""] * (max(vocab.values()) + 1)
        for token, index in vocab.items():
            self._tokens[index] = token
        self.pad_id, self.unk_id = roles[PAD_TOKEN], roles[UNK_TOKEN]
        self.cls_id, self.sep_id = roles[CLS_TOKEN], roles[SEP_TOKEN]
        self.mask_id = roles[MASK_TOKEN]
        added = {t["id"] for t in spec.get("added_tokens", []) if t.get("special")}
        self.special_ids = frozenset(added | set(roles.values()))
        self.is_continuation = _continuations(spec, self._tokens, self.special_ids)
        # Text is data: a literal "[SEP]" in a sentence is characters, never a control token.
        backend.encode_special_tokens = True
        self.backend = backend

    def __repr__(self) -> str:
        model = json.loads(self.backend.to_str())["model"]["type"]
        return f"JsonTokenizer({str(self.vocab_path)!r}, {model}, vocab_size={self.vocab_size})"


def _continuations(spec: dict, tokens: Sequence[str], special: frozenset[int]) -> np.ndarray:
    """Which ids continue a word (for whole-word masking): pieces with the model's
    continuing-subword prefix ("##"), or, for byte-level BPE and SentencePiece-style
    pre-tokenizers, pieces that do not start with the word-start marker."""
    model = spec.get("model") or {}
    prefix = model.get("continuing_subword_prefix")
    if prefix:
        flags = (t.startswith(prefix) and len(t) > len(prefix) for t in tokens)
    else:
        marker = _word_start_marker(spec.get("pre_tokenizer"))
        if marker is None:
            log.info("tokenizer has no word-boundary marker: whole-word masking masks pieces")
            flags = (False for _ in tokens)
        else:
            flags = (bool(t) and not t.startswith(marker) for t in tokens)
    out = np.fromiter(flags, dtype=bool, count=len(tokens))
    out[list(special)] = False
    return out


def _word_start_marker(pre_tokenizer: dict | None) -> str | None:
    if not pre_tokenizer:
        return None
    if pre_tokenizer.get("type") == "Sequence":
        found = (_word_start_marker(p) for p in pre_tokenizer.get("pretokenizers", []))
        return next((m for m in found if m), None)
    return WORD_START_MARKERS.get(pre_tokenizer.get("type", ""))


def is_tokenizer_json(path: str | os.PathLike) -> bool:
    """A path names a `tokenizer.json` (by its suffix), not a `vocab.txt`."""
    return Path(path).suffix.lower() == ".json"


def load_tokenizer(path: str | os.PathLike | None = None,
                   lowercase: bool = True) -> TextTokenizer:
    """The tokenizer a file holds: a `tokenizer.json` (any model) or a `vocab.txt` (WordPiece,
    `lowercase` applying); None is the bundled vocabulary."""
    if path is not None and is_tokenizer_json(path):
        return JsonTokenizer(path)
    return WordPieceTokenizer(path, lowercase)


def tokenizer_from_text(text: str, lowercase: bool = True,
                        source: str = "vocabulary") -> TextTokenizer:
    """The tokenizer whose file content is `text` (an export's metadata): JSON is a
    `tokenizer.json`, anything else a `vocab.txt`; `source` names it in errors."""
    if text.lstrip().startswith("{"):
        return JsonTokenizer(source, text=text)
    return WordPieceTokenizer(source, lowercase, text=text)


def tokenizer_file_name(path: str | os.PathLike) -> str:
    """The name a run directory stores a tokenizer under: `tokenizer.json` or `vocab.txt`."""
    return TOKENIZER_JSON if is_tokenizer_json(path) else "vocab.txt"
