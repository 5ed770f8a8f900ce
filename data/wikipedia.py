"""Stage `extract`: a MediaWiki XML dump (`*.xml.bz2` as published) → plain-text articles.

The dump is streamed: `xml.etree.ElementTree.iterparse` reads pages from the decompressing file
and each page element is freed once read, so memory does not grow with the dump. Pages of the
article namespace (0) that are not redirects are grouped into parts of about `part_bytes` of
wikitext; each part is cleaned by the `wikiextractor` package (templates dropped, links reduced to
their text, tables/lists/references/section titles removed) in a worker process and written as
JSON lines `{"id", "title", "text"}` (paragraphs separated by newlines).

Part boundaries depend only on the dump and `part_bytes`, so the output does not depend on the
number of workers, and a re-run recognises the parts it already wrote.
"""

from __future__ import annotations

import bz2
import gzip
import json
import logging
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from tqdm import tqdm

from popbert.data import storage
from popbert.data.errors import DataError
from popbert.data.stages import StageDir, atomic_output, part_name, run_units, workers_label
from popbert.textfile import decode

log = logging.getLogger(__name__)

EXTRACT_SUFFIX = "jsonl"
DEFAULT_PART_BYTES = 8 << 20
ARTICLE_NAMESPACE = "0"
# Short leftovers of removed markup ("Contents", lone punctuation) are not prose.
MIN_PARAGRAPH_CHARS = 20


@dataclass
class Page:
    """One article's raw wikitext as read from the dump."""

    id: str
    title: str
    text: str
    timestamp: str = ""


def _local(tag: str) -> str:
    return tag.rsplit("}", 1)[-1]


def _open_dump(raw: BinaryIO, path: storage.Location) -> BinaryIO:
    suffix = Path(storage.name_of(path)).suffix
    if suffix == ".bz2":
        return bz2.BZ2File(raw, "rb")
    if suffix == ".gz":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    return raw


def iter_pages(path: str | os.PathLike,
               on_progress: Callable[[int], None] | None = None) -> Iterator[Page]:
    """Articles (namespace 0, not redirects) of a MediaWiki export, streamed page by page.

    `on_progress(n)` is called with the (compressed) bytes of the file read so far. The dump
    may be a URL: it is streamed, never copied whole.
    """
    path = storage.location(path)
    if not storage.exists(path):
        raise DataError(f"{path}: dump file not found")
    with storage.open_input(path) as raw, _open_dump(raw, path) as f:
        events = ET.iterparse(f, events=("start", "end"))
        try:
            _, root = next(events)
            if _local(root.tag) != "mediawiki":
                raise DataError(f"{path}: not a MediaWiki XML export (root <{_local(root.tag)}>)")
            for event, elem in events:
                if event != "end" or _local(elem.tag) != "page":
                    continue
                fields = {_local(child.tag): child for child in elem}
                ns = fields.get("ns")
                revision = fields.get("revision")
                if (ns is not None and (ns.text or "").strip() == ARTICLE_NAMESPACE
                        and "redirect" not in fields and revision is not None):
                    rev = {_local(child.tag): child for child in revision}
                    text = rev["text"].text if "text" in rev else None
                    if text:
                        yield Page(id=(fields["id"].text or "").strip(),
                                   title=fields["title"].text or "", text=text,
                                   timestamp=(rev["timestamp"].text or "")
                                   if "timestamp" in rev else "")
                root.clear()  # drop the page just read: memory stays flat
                if on_progress is not None:
                    on_progress(raw.tell())
        except ET.ParseError as exc:
            raise DataError(f"{path}: malformed XML ({exc})") from None
        except (OSError, EOFError) as exc:
            raise DataError(f"{path}: cannot read dump ({exc})") from None


def check_dump(path: str | os.PathLike) -> None:
    """Raise DataError unless `path` starts like a MediaWiki XML export (cheap: first tag)."""
    path = storage.location(path)
    if not storage.exists(path):
        raise DataError(f"{path}: dump file not found")
    try:
        with storage.open_input(path) as raw, _open_dump(raw, path) as f:
            _, root = next(ET.iterparse(f, events=("start",)))
    except (ET.ParseError, StopIteration) as exc:
        raise DataError(f"{path}: not a MediaWiki XML export ({exc or 'empty'})") from None
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot read dump ({exc})") from None
    if _local(root.tag) != "mediawiki":
        raise DataError(f"{path}: not a MediaWiki XML export (root <{_local(root.tag)}>)")


def iter_parts(path: str | os.PathLike, part_bytes: int,
               on_progress: Callable[[int], None] | None = None) -> Iterator[list[Page]]:
    """Pages grouped into parts of about `part_bytes` of wikitext (the last may be smaller)."""
    part: list[Page] = []
    size = 0
    for page in iter_pages(path, on_progress):
        part.append(page)
        size += len(page.text)
        if size >= part_bytes:
            yield part
            part, size = [], 0
    if part:
        yield part


_MAGIC_TIME = re.compile(r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})")


def clean_page(page: Page, keep_links: bool = False,
               min_chars: int = MIN_PARAGRAPH_CHARS) -> list[str]:
    """Paragraphs of plain text of one page, by wikiextractor, each at least `min_chars` long.

    Time-dependent magic words ({{CURRENTYEAR}} ...) are set from the revision's timestamp
    instead of the clock, so a dump always extracts to the same text. `keep_links`: wikilinks
    stay as `<a href="target">anchor</a>` (what a data set tagged from its links reads).
    """
    from wikiextractor.extract import Extractor, clean, compact

    extractor = Extractor(page.id, "", "", page.title, [page.text], keepSections=False,
                          keepLinks=keep_links)
    words = extractor.magicWords
    words["namespace"] = ""
    words["pagename"] = words["fullpagename"] = page.title
    match = _MAGIC_TIME.match(page.timestamp)
    year, month, day, hour, minute, second = match.groups() if match else (
        "2000", "01", "01", "00", "00", "00")
    words["currentyear"], words["currentmonth"], words["currentday"] = year, month, day
    words["currenthour"], words["currenttime"] = hour, f"{hour}:{minute}:{second}"
    text = clean(extractor, page.text, expand_templates=True, html_safe=False)
    paragraphs = compact(text, mark_headers=False, extractor=extractor)
    return [p.strip() for p in paragraphs if len(p.strip()) >= max(min_chars, 1)]


def extract_part(pages: list[Page], out_path: str) -> dict:
    """Clean one part's pages and write them as JSON lines; returns counts for the record."""
    out = storage.location(out_path)
    articles = paragraphs = chars = 0
    with atomic_output(out) as tmp, open(tmp, "w", encoding="utf-8") as f:
        for page in pages:
            lines = clean_page(page)
            if not lines:
                continue
            text = "\n".join(lines)
            f.write(json.dumps({"id": page.id, "title": page.title, "text": text},
                               ensure_ascii=False) + "\n")
            articles += 1
            paragraphs += len(lines)
            chars += len(text)
    return {"pages": len(pages), "articles": articles, "paragraphs": paragraphs, "chars": chars}


def extract_dump(dump: str | os.PathLike, output_dir: str | os.PathLike, workers: int = 1,
                 part_bytes: int = DEFAULT_PART_BYTES) -> dict:
    """Stage `extract`: `dump` → `output_dir/part-*.jsonl`; returns the completion record.

    Finished parts are skipped (their pages are still read from the dump, which is cheap next
    to cleaning them), so an interrupted run resumes where it stopped. A dump that yields no
    article is a DataError naming it, with no completion marker and no directory left behind.
    """
    dump = storage.location(dump)
    if part_bytes < 1:
        raise DataError(f"part_bytes must be >= 1, got {part_bytes}")
    stage = StageDir(output_dir, "extract", {"input": storage.name_of(dump),
                                             "part_bytes": part_bytes})
    check_dump(dump)
    stage.open()
    if stage.complete:
        log.info("%s: extract already complete", stage.path)
        return stage.success()

    skipped: list[dict] = []
    size = storage.size(dump)
    # The bar follows the compressed dump read so far (cleaning trails it by a few parts).
    bar = tqdm(total=size, desc="extract", unit="B", unit_scale=True, dynamic_ncols=True,
               leave=False)

    def advance(position: int) -> None:
        bar.update(position - bar.n)

    done = {storage.name_of(p) for p in stage.parts(EXTRACT_SUFFIX)}

    def jobs() -> Iterator[tuple]:
        for index, pages in enumerate(iter_parts(dump, part_bytes, advance)):
            out = storage.join(stage.path, part_name(index, EXTRACT_SUFFIX))
            if part_name(index, EXTRACT_SUFFIX) in done:
                skipped.append({"pages": len(pages)})
                continue
            yield (pages, str(out))

    log.info("extracting %s (%.1f MB) with %s", dump, size / 1e6, workers_label(workers))
    try:
        results = run_units(extract_part, jobs(), workers, desc="extract", show_bar=False)
    except DataError as exc:  # the cluster lost, a bad page: the lock goes, one line
        raise stage.abandon(str(exc)) from None
    finally:
        bar.close()
    part_paths = stage.parts(EXTRACT_SUFFIX)
    articles = 0
    for path in part_paths:
        with storage.open_input(path) as f:
            articles += sum(1 for line in f if line.strip())
    stats = {"parts": len(part_paths), "parts_skipped": len(skipped),
             "pages": sum(r["pages"] for r in results) + sum(s["pages"] for s in skipped),
             "articles": articles}
    log.info("extract: %d parts (%d already there), %d pages, %d articles", len(part_paths),
             len(skipped), stats["pages"], articles)
    if articles == 0:
        # An empty or wrong dump (say a talk-pages or stub export) must stop here, naming it,
        # rather than leave a finished stage that makes every later stage fail obscurely.
        if stats["pages"] == 0:
            detail = "no articles (pages of namespace 0 that are not redirects and have text)"
        else:
            detail = (f"none of its {stats['pages']} article pages has text left after "
                      f"cleaning (paragraphs of at least {MIN_PARAGRAPH_CHARS} characters)")
        raise stage.abandon(f"{dump}: {detail}; nothing to extract")
    parts = [storage.name_of(p) for p in part_paths]
    return stage.finish(parts, stats)


def read_articles(path: str | os.PathLike) -> Iterator[dict]:
    """Articles of one extracted part (JSON lines with id, title, text)."""
    path = storage.location(path)
    offset = 0
    with storage.open_input(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            line = decode(raw, path, "extracted articles (JSON lines)", offset=offset,
                          error=DataError)
            offset += len(raw)
            if not line.strip():
                continue
            try:
                article = json.loads(line)
                article["text"]  # noqa: B018 - presence check
            except (ValueError, KeyError, TypeError):
                raise DataError(f"{path}:{number}: not an extracted article "
                                f"(JSON with a 'text' field)") from None
            yield article
