"""A WikiNER-style named-entity set from real Wikipedia text, for `downstream.py --task ner`.

No NER corpus is available here, so this derives one as Nothman et al. derived WikiNER
("Learning multilingual named entity recognition from Wikipedia", 2013): a wikilink's anchor
text is an entity mention, typed from the article it links to. The labels are noisy; the
point is a fair comparison of trainers on the same labels, not a high F1.

    python benchmarks/ner_data.py      # deterministic: rewrites the two files below

Sources (`../shared/data`; its README, and `benchmarks/data/ATTRIBUTION.md`): the enwiki
sample dump of gensim 4.4.0's test data (106 articles of wikitext) and the vital-articles
summaries (`{title: {title, extract, description, topic}}`, 10,033 articles).

1. Text: each article (namespace 0, not a redirect: `popbert.data.wikipedia.iter_pages`) is
   cleaned by wikiextractor through `popbert.data.wikipedia.clean_page` (templates, tables,
   references, files, categories, lists and section titles removed) with the wikilinks kept
   (`keep_links`) and every paragraph, however short; an anchor's link trail ("[[dog]]s") is
   part of the anchor, as MediaWiki shows it.
2. Words: runs of letters and digits with inner hyphens ("Pierre-Joseph", "20th-century"),
   numbers with inner points or commas ("13.9", "1,000"), abbreviations ("U.S.", "D.C."), and
   every other non-space character on its own (so "Portugal's" is "Portugal", "'", "s"):
   `WORD`. Sentences: pysbd (`Segmenter(language="en", clean=False)`) on each paragraph.
3. Types: vital articles only (the link target, URL-decoded, "_" as a space, "#section"
   dropped, first letter upper-cased). Topic People → PER, Geography → LOC, any other topic →
   MISC. The 1,000 "Uncategorized" articles (the list's top level: China, Plato, World War II,
   Dog ...) are typed by their Wikidata description: LOC when it starts with a place word
   (country, city, capital, continent, sea ...: `PLACE`), PER when it reads as a person's (a
   life span in parentheses, "from 1933 to 1945", or a role such as king or philosopher; and
   no word such as dynasty, empire or war: `PERSON`, `NOT_PERSON`), else MISC.
   Only proper names are entities: a vital title (its parenthesised qualifier dropped) is a
   proper name when, in the vital leads and the dump's text together, it is written
   capitalised in mid-sentence, not next to another capitalised word, more often than
   lower-case ("Lake Ontario" yes; "Dog" no; "Kingdom" no, though "United Kingdom" is common);
   with neither seen, when each of its words but of/the/and/de/... is capitalised. People are
   always proper names.
4. Entities: a link whose anchor starts with a capital letter and whose target is a vital
   proper name, or else whose anchor text itself is one ("[[Kingdom of Greece|Greece]]" is
   Greece, LOC). A one-word anchor of a LOC that is not a word of its title and ends like a
   demonym ("Dutch", "American", "Iraqi") is MISC, as CoNLL tags nationalities. Then, as
   WikiNER infers links, unlinked text: in each article the exact words of its entity anchors,
   its own title, and the last word of its PER names ("Lincoln"), and anywhere the vital proper
   names, each with its type: longest first; an article's own surfaces before the vital names;
   a surface with two types left out; not where the words are only part of a longer name (next
   to another capitalised word, or followed by a number as in "Apollo 8"). Tags IOB2; adjacent
   links each start with B-.
5. Sentences kept: 5 to 100 words, at least one entity. Left out, and counted: sentences with a
   capitalised link that cannot be typed (to an article that is not vital: probably a name
   whose type we do not know, so its O would be wrong), leftover markup (`|{}[]<>=`), fewer than
   5 or more than 100 words (more: a sentence must fit in 128 WordPiece tokens, which
   transformers would cut and popbert would window), no entity. At most `PER_ARTICLE`
   sentences of an article (its first), so that a few long articles do not make up a split.
6. Split by article: articles in ascending sha256 of the title; each goes to the test set
   while it holds under `TEST_SHARE` of the sentences so far, else to training.

Output: CoNLL (a word, a tab, its tag; a blank line between sentences), UTF-8, to
`benchmarks/data/wiki-links-ner-train.conll` and `wiki-links-ner-test.conll`; the counts are
printed.
"""

from __future__ import annotations

import argparse
import collections
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
DUMP = SHARED / "enwiki-sample-pages-articles.xml.bz2"
VITAL = SHARED / "wikipedia-vital-articles-summaries-en.json"
OUT = Path(__file__).parent / "data"
TEST_SHARE = 0.2
MIN_WORDS, MAX_WORDS = 5, 100
PER_ARTICLE = 80

WORD = re.compile(r"\d+(?:[.,]\d+)+|(?:[^\W\d_]\.){2,}|[^\W_]+(?:-[^\W_]+)*|\S")
LINK = re.compile(r'<a href="([^"]*)">(.*?)</a>([^\W\d_]*)', re.S)
MARKUP = re.compile(r"[|{}\[\]<>=]")
QUALIFIER = re.compile(r"\s*\([^)]*\)$")
SMALL_WORDS = {"of", "the", "and", "de", "in", "von", "van", "ibn", "bin", "al", "a", "an",
               "on", "da", "du", "la", "le", "des", "del", "der", "for", "to", "at", "y"}
SENTENCE_END = {".", "!", "?", ":", ";", '"', "(", "'", "“", "‘"}
TOPIC_TYPES = {"People": "PER", "Geography": "LOC"}
PERSON = re.compile(
    r"\((?:r\. |fl\. |born )?(?:c\. ?)?\d[^()]*\d(?: BCE?| AD| CE)?\)$"  # (1642–1727)
    r"|\bfrom (?:c\. )?(?:AD )?\d+(?: BCE?)? to (?:c\. )?(?:AD )?\d+"  # from 1933 to 1945
    r"|\b(?:emperor|empress|king|queen|pharaoh|leader|ruler|founder|sultan|caliph|prophet|"
    r"president|dictator|statesman|philosopher|mathematician|scientist|physicist|chemist|"
    r"poet|writer|novelist|playwright|artist|painter|composer|singer|actor|inventor|"
    r"explorer|activist|theologian|economist|preacher|polymath)\b", re.I)
NOT_PERSON = re.compile(r"\b(?:dynasty|empire|period|conflict|war|depression|civilization|"
                        r"revolution|band|entity|age)\b", re.I)
PLACE = re.compile(
    r"^(?:\w+ )?(?:country|city|capital|continent|sea|ocean|river|lake|island|mountain|"
    r"desert|region|subregion|peninsula|archipelago|province|gulf|strait|bay)\b", re.I)
DEMONYM = re.compile(r"(?:an|ish|ese|ic|i|ch)$")


def words_of(text: str) -> tuple[str, ...]:
    return tuple(WORD.findall(text))


def normalise_target(href: str) -> str:
    title = re.sub(r"[\s_]+", " ", unquote(href).split("#", 1)[0]).strip()
    return title[:1].upper() + title[1:]


def lower_first(words: tuple[str, ...]) -> tuple[str, ...]:
    return (words[0][:1].lower() + words[0][1:],) + words[1:]


def vital_type(article: dict) -> str:
    topic, description = article.get("topic"), article.get("description") or ""
    if topic != "Uncategorized":
        return TOPIC_TYPES.get(topic, "MISC")
    if PLACE.search(description):
        return "LOC"
    if PERSON.search(description) and not NOT_PERSON.search(description):
        return "PER"
    return "MISC"


def proper_names(vital: dict[str, dict], texts: list[str]) -> dict[tuple[str, ...], str]:
    """The vital titles (qualifier dropped) that are proper names (point 3 of the docstring),
    as words, with their type; a name that two articles of other types share is left out."""
    names: dict[tuple[str, ...], set[str]] = collections.defaultdict(set)
    for title, article in vital.items():
        words = words_of(QUALIFIER.sub("", title))
        if words and words[0][:1].isupper():
            names[words].add(vital_type(article))
    wanted = set(names) | {lower_first(w) for w in names}
    lengths: dict[str, set[int]] = collections.defaultdict(set)
    for words in wanted:
        lengths[words[0]].add(len(words))
    upper_mid: collections.Counter = collections.Counter()
    lower: collections.Counter = collections.Counter()
    for text in texts:
        tokens = WORD.findall(text)
        for i, token in enumerate(tokens):
            for size in lengths.get(token, ()):
                words = tuple(tokens[i:i + size])
                if words in names:  # in mid-sentence and not part of a longer name
                    after = tokens[i + size] if i + size < len(tokens) else ""
                    if (i and tokens[i - 1] not in SENTENCE_END
                            and not tokens[i - 1][:1].isupper() and not after[:1].isupper()):
                        upper_mid[words] += 1
                elif words in wanted:
                    lower[words] += 1
    people = {words_of(QUALIFIER.sub("", t)) for t, a in vital.items()
              if a.get("topic") == "People"}
    proper = {}
    for words, kinds in names.items():
        seen_lower = lower[lower_first(words)]
        if words in people or upper_mid[words] > seen_lower or (
                not upper_mid[words] and not seen_lower
                and all(w[:1].isupper() or not w[:1].isalpha() or w in SMALL_WORDS
                        for w in words)):
            if len(kinds) == 1:
                proper[words] = next(iter(kinds))
    return proper


@dataclass
class Link:
    start: int
    end: int
    target: str
    anchor: str


def unlink(paragraph: str) -> tuple[str, list[Link]]:
    """The paragraph's plain text and its links (character spans in that text)."""
    parts: list[str] = []
    links, cursor, length = [], 0, 0
    for m in LINK.finditer(paragraph):
        parts.append(paragraph[cursor:m.start()])
        length += m.start() - cursor
        anchor = re.sub(r"<[^>]*>", "", m.group(2)) + m.group(3)
        links.append(Link(length, length + len(anchor), normalise_target(m.group(1)), anchor))
        parts.append(anchor)
        length += len(anchor)
        cursor = m.end()
    parts.append(paragraph[cursor:])
    return "".join(parts), links


def sentence_spans(text: str, segmenter) -> list[tuple[int, int]]:
    spans, cursor = [], 0
    for sentence in segmenter.segment(text):
        sentence = sentence.strip()
        if not sentence:
            continue
        start = text.find(sentence, cursor)
        if start < 0:
            return []  # pysbd changed the text: the paragraph is left out
        spans.append((start, start + len(sentence)))
        cursor = start + len(sentence)
    return spans


@dataclass
class Article:
    title: str
    paragraphs: list[tuple[str, list[Link]]]
    kept: list[tuple[list[str], list[str]]] = field(default_factory=list)


class Tagger:
    """Points 3-5 of the docstring for one article at a time."""

    def __init__(self, vital: dict[str, dict], proper: dict[tuple[str, ...], str]) -> None:
        self.vital = vital
        self.proper = proper
        self.vital_folded = {t.lower() for t in vital}
        self.counts: collections.Counter = collections.Counter()

    def link_type(self, link: Link) -> str | None:
        """The entity type of a link; None: not an entity; "": a name we cannot type."""
        if not link.anchor[:1].isupper():
            return None
        anchor = words_of(link.anchor)
        if link.target in self.vital:
            kind = self.proper.get(words_of(QUALIFIER.sub("", link.target)))
            if kind is None:
                return None  # a common noun ("[[Philosophy]] is ...")
        else:
            kind = self.proper.get(anchor)
            if kind is None:
                return None if link.target.lower() in self.vital_folded else ""
        if (kind == "LOC" and len(anchor) == 1 and anchor[0] not in words_of(link.target)
                and DEMONYM.search(anchor[0])):
            return "MISC"
        return kind

    def tag(self, article: Article, segmenter) -> None:
        rows = []  # (words, [(start, end, type)], linked spans, untyped?, sentence text)
        local: dict[tuple[str, ...], set[str]] = collections.defaultdict(set)
        own = self.proper.get(words_of(QUALIFIER.sub("", article.title)))
        if own:
            local[words_of(QUALIFIER.sub("", article.title))].add(own)
        for text, links in article.paragraphs:
            for start, end in sentence_spans(text, segmenter):
                words = [(m.group(), m.start(), m.end())
                         for m in WORD.finditer(text, start, end)]
                inside = [link for link in links if start <= link.start and link.end <= end
                          and link.anchor.strip()]
                typed = [(link, self.link_type(link)) for link in inside]
                for link, kind in typed:
                    if kind:
                        local[words_of(link.anchor)].add(kind)
                rows.append((words, [(k.start, k.end, t) for k, t in typed if t],
                             [(k.start, k.end) for k in inside], any(t == "" for _, t in typed),
                             text[start:end]))
        for name, kinds in list(local.items()):
            if kinds == {"PER"} and len(name) > 1 and re.fullmatch(r"[A-Z][a-z]+", name[-1]) \
                    and all(w[:1].isupper() or not w.isalpha() for w in name):
                local[(name[-1],)].add("PER")
        surfaces = dict(self.proper)
        for name, kinds in local.items():
            if len(kinds) == 1:
                surfaces[name] = next(iter(kinds))
            else:
                surfaces.pop(name, None)
        for row in rows:
            tagged = self.sentence(*row, surfaces)
            if tagged and len(article.kept) < PER_ARTICLE:
                article.kept.append(tagged)
            elif tagged:
                self.counts["left out: over the per-article cap"] += 1

    def sentence(self, words, entities, linked, untyped, text, surfaces
                 ) -> tuple[list[str], list[str]] | None:
        self.counts["sentences"] += 1
        if len(words) < MIN_WORDS:
            self.counts["left out: fewer than 5 words"] += 1
            return None
        if len(words) > MAX_WORDS:
            self.counts["left out: more than 100 words"] += 1
            return None
        if MARKUP.search(text):
            self.counts["left out: leftover markup"] += 1
            return None
        if untyped:
            self.counts["left out: a capitalised link that cannot be typed"] += 1
            return None
        tags = ["O"] * len(words)
        covered = [False] * len(words)
        for s, e, kind in entities:
            overlap = [i for i, (_, ws, we) in enumerate(words) if ws < e and we > s
                       and not covered[i]]
            for n, i in enumerate(overlap):
                tags[i] = ("B-" if n == 0 else "I-") + kind
                covered[i] = True
        for s, e in linked:
            for i, (_, ws, we) in enumerate(words):
                covered[i] = covered[i] or (ws < e and we > s)
        tokens = [w for w, _, _ in words]
        longest = max(map(len, surfaces), default=0)
        i = 0
        while i < len(tokens):  # unlinked mentions, longest first, not part of a longer name
            inner = False
            for size in range(min(longest, len(tokens) - i), 0, -1):
                kind = surfaces.get(tuple(tokens[i:i + size]))
                if not kind or any(covered[i:i + size]):
                    continue
                after = tokens[i + size][:1] if i + size < len(tokens) else ""
                if (i > 1 and tokens[i - 1][:1].isupper()) or after.isupper() or after.isdigit():
                    inner = True
                    continue
                tags[i:i + size] = [f"B-{kind}"] + [f"I-{kind}"] * (size - 1)
                self.counts["unlinked mentions tagged"] += 1
                i += size
                break
            else:
                self.counts["unlinked mentions inside a longer name, left O"] += inner
                i += 1
        if all(t == "O" for t in tags):
            self.counts["left out: no entity"] += 1
            return None
        self.counts["linked mentions tagged"] += len(entities)
        return tokens, tags


def build(dump: Path, vital_path: Path) -> tuple[list, list, dict, collections.Counter]:
    import pysbd

    from popbert.data.wikipedia import clean_page, iter_pages

    vital = json.loads(vital_path.read_text(encoding="utf-8"))
    articles = [Article(page.title, [unlink(p) for p in clean_page(page, keep_links=True,
                                                                   min_chars=1)])
                for page in iter_pages(dump)]
    texts = [a.get("extract") or "" for a in vital.values()]
    texts += [text for article in articles for text, _ in article.paragraphs]
    tagger = Tagger(vital, proper_names(vital, texts))
    segmenter = pysbd.Segmenter(language="en", clean=False)
    for article in articles:
        tagger.tag(article, segmenter)
    tagger.counts["articles"] = len(articles)
    split: dict[str, list] = {"train": [], "test": []}
    rows: dict[str, list] = {"train": [], "test": []}
    for _, article in sorted((hashlib.sha256(a.title.encode()).hexdigest(), a)
                             for a in articles if a.kept):
        total = len(rows["train"]) + len(rows["test"]) + len(article.kept)
        name = "test" if len(rows["test"]) < TEST_SHARE * total else "train"
        rows[name].extend(article.kept)
        split[name].append(article.title)
    return rows["train"], rows["test"], split, tagger.counts


def write_conll(path: Path, rows: list[tuple[list[str], list[str]]]) -> None:
    path.write_text("".join("".join(f"{w}\t{t}\n" for w, t in zip(words, tags)) + "\n"
                            for words, tags in rows), encoding="utf-8")


def summary(rows: list[tuple[list[str], list[str]]]) -> dict:
    kinds = collections.Counter(t[2:] for _, tags in rows for t in tags if t.startswith("B-"))
    return {"sentences": len(rows), "words": sum(len(w) for w, _ in rows),
            "entities": dict(sorted(kinds.items())),
            "longest": max((len(w) for w, _ in rows), default=0)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dump", type=Path, default=DUMP)
    parser.add_argument("--vital", type=Path, default=VITAL)
    parser.add_argument("--out-dir", type=Path, default=OUT)
    args = parser.parse_args()
    train, test, split, counts = build(args.dump, args.vital)
    for name, rows in (("train", train), ("test", test)):
        path = args.out_dir / f"wiki-links-ner-{name}.conll"
        write_conll(path, rows)
        print(name, json.dumps({**summary(rows), "articles": len(split[name]),
                                "bytes": path.stat().st_size,
                                "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}))
    print("test articles:", ", ".join(split["test"]))
    print(json.dumps(dict(sorted(counts.items())), indent=1))


if __name__ == "__main__":
    main()
