"""Benchmark of `popbert prepare-data`: throughput, peak memory, speed-up over a straightforward
single-process implementation of the same algorithm, and packing efficiency.

    python benchmarks/data_pipeline.py [--data-dir ../shared/data] [--output RESULTS.md]
    python benchmarks/data_pipeline.py --stages [--repeats 5] [--baseline-rev REV]

`--stages`: the whole `prepare-data wikipedia` path on the dump sample, stage by stage in fresh
one-worker processes: compressed dump MB per CPU second (per core) and peak RSS of each stage,
peak against part size, the extrapolation to the full dump on `--cores` cores (`--dump-gb`), and
with `--baseline-rev` the instances stage of that git revision against this tree's, interleaved,
with a check that the shards' datasets are identical.

Inputs (not shipped with popbert): the Wikipedia XML dump sample
`enwiki-sample-pages-articles.xml.bz2` (206 pages) for the `extract` stage, and the 10,033
"vital articles" leads (`wikipedia-vital-articles-summaries-en.json`, ~36k sentences) for the
`sentences` and `instances` stages, written as 8 extracted parts.

Two single-process baselines, run in this script:

- "simple": what one writes first with the same libraries, in one process: clean page after
  page; split article after article; read the whole corpus, tokenize sentence by sentence
  (`tokenizer.encode`), create instances with `InstanceCreator` (Google's per-instance Python
  masking), write one shard.
- "reference": the structure of Google's `create_pretraining_data.py` (which NVIDIA's scripts
  run): the same, but WordPiece in pure Python (Google's BasicTokenizer + WordpieceTokenizer,
  reimplemented below and checked to give HF's ids) and sentences split by pysbd, the splitter
  popbert used before.

The pipeline runs the same algorithms per part over 1 and 2 worker processes, with batched Rust
tokenization and vectorised masking. Every variant runs in a fresh subprocess so its peak RSS
and CPU time (itself plus its workers) are its own.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_DATA = REPO.parent / "shared" / "data"
DUMP = "enwiki-sample-pages-articles.xml.bz2"
VITAL = "wikipedia-vital-articles-summaries-en.json"
PARTS = 8
DUPE = 2


def usage(workers: int) -> tuple[float, float]:
    """(peak MB, CPU seconds) of this process and its workers.

    ru_maxrss of the children is the largest worker's, so peak = own + workers x largest (an
    upper bound); CPU seconds add user and system time of everything.
    """
    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    peak = own.ru_maxrss + (workers * kids.ru_maxrss if workers > 1 else 0)
    cpu = own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime
    return peak / 1024.0, cpu  # Linux: ru_maxrss in kilobytes


# ------------------------------------------------------------------------------ reference WordPiece
class ReferenceWordPiece:
    """Google BERT's `tokenization.FullTokenizer` (uncased), in plain Python, as in
    `create_pretraining_data.py`: basic tokenization (clean, split CJK, lowercase, strip accents,
    split punctuation), then greedy longest-match-first WordPiece per word."""

    def __init__(self, vocab_path: Path):
        tokens = vocab_path.read_text(encoding="utf-8").splitlines()
        self.vocab = {t: i for i, t in enumerate(tokens)}
        self.unk = self.vocab["[UNK]"]

    @staticmethod
    def _is_punctuation(ch: str) -> bool:
        import unicodedata

        cp = ord(ch)
        if 33 <= cp <= 47 or 58 <= cp <= 64 or 91 <= cp <= 96 or 123 <= cp <= 126:
            return True
        return unicodedata.category(ch).startswith("P")

    @staticmethod
    def _is_cjk(cp: int) -> bool:
        return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
                or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F
                or 0x2B820 <= cp <= 0x2CEAF or 0xF900 <= cp <= 0xFAFF
                or 0x2F800 <= cp <= 0x2FA1F)

    def basic(self, text: str) -> list[str]:
        import unicodedata

        out = []
        for ch in text:
            cp = ord(ch)
            if cp == 0 or cp == 0xFFFD:
                continue
            cat = unicodedata.category(ch)
            if ch in ("\t", "\n", "\r") or cat == "Zs" or ch == " ":
                out.append(" ")
            elif cat in ("Cc", "Cf"):
                continue
            elif self._is_cjk(cp):
                out.append(f" {ch} ")
            else:
                out.append(ch)
        words = []
        for token in "".join(out).split():
            token = unicodedata.normalize("NFD", token.lower())
            token = "".join(c for c in token if unicodedata.category(c) != "Mn")
            current = ""
            for ch in token:
                if self._is_punctuation(ch):
                    if current:
                        words.append(current)
                    words.append(ch)
                    current = ""
                else:
                    current += ch
            if current:
                words.append(current)
        return words

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in self.basic(text):
            if len(word) > 100:
                ids.append(self.unk)
                continue
            start, pieces = 0, []
            while start < len(word):
                end, found = len(word), None
                while start < end:
                    piece = word[start:end] if start == 0 else "##" + word[start:end]
                    if piece in self.vocab:
                        found = self.vocab[piece]
                        break
                    end -= 1
                if found is None:
                    pieces = [self.unk]
                    break
                pieces.append(found)
                start = end
            ids.extend(pieces)
        return ids


def write_vital_parts(source: Path, out: Path) -> None:
    """The vital-articles leads as 8 extracted parts (the extract stage's output format)."""
    articles = json.loads(source.read_text(encoding="utf-8"))
    items = sorted(articles.values(), key=lambda a: a["title"])
    out.mkdir(parents=True, exist_ok=True)
    for p in range(PARTS):
        with open(out / f"part-{p:05d}.jsonl", "w", encoding="utf-8") as f:
            for a in items[p::PARTS]:
                text = "\n".join(x.strip() for x in a["extract"].split("\n") if x.strip())
                f.write(json.dumps({"id": a["title"], "title": a["title"], "text": text}) + "\n")


# ------------------------------------------------------------------------------ variants
def simple_extract(dump: Path, work: Path) -> dict:
    from popbert.data.wikipedia import clean_page, iter_pages

    pages = articles = 0
    with open(work / "articles.jsonl", "w", encoding="utf-8") as f:
        for page in iter_pages(dump):
            pages += 1
            lines = clean_page(page)
            if lines:
                articles += 1
                f.write(json.dumps({"id": page.id, "title": page.title,
                                    "text": "\n".join(lines)}) + "\n")
    return {"items": pages, "unit": "pages", "articles": articles}


def pipeline_extract(dump: Path, work: Path, workers: int) -> dict:
    from popbert.data.wikipedia import extract_dump

    record = extract_dump(dump, work / "extracted", workers, part_bytes=256 << 10)
    return {"items": record["stats"]["pages"], "unit": "pages",
            "articles": record["stats"]["articles"]}


def simple_sentences(parts: Path, work: Path, splitter: str) -> dict:
    from popbert.data.sentences import make_splitter
    from popbert.data.wikipedia import read_articles

    split = make_splitter(splitter)
    sentences = 0
    with open(work / "corpus.txt", "w", encoding="utf-8") as f:
        for part in sorted(parts.glob("part-*.jsonl")):
            for article in read_articles(part):
                doc = []
                for paragraph in article["text"].split("\n"):
                    doc.extend(split(paragraph))
                if len(doc) >= 2:
                    f.write("\n".join(doc) + "\n\n")
                    sentences += len(doc)
    return {"items": sentences, "unit": "sentences"}


def pipeline_sentences(parts: Path, work: Path, workers: int, splitter: str) -> dict:
    from popbert.data.sentences import split_sentences

    record = split_sentences(sorted(parts.glob("part-*.jsonl")), work / "sentences", workers,
                             splitter)
    return {"items": record["stats"]["sentences_written_now"], "unit": "sentences"}


def simple_instances(sentences: Path, work: Path, seq: int, pred: int,
                     reference: bool = False) -> dict:
    from popbert.data.corpus import read_text_documents
    from popbert.data.hdf5 import write_shard
    from popbert.data.instances import InstanceCreator, InstanceOptions, instances_to_arrays
    from popbert.data.tokenization import WordPieceTokenizer

    tokenizer = WordPieceTokenizer()
    encode = ReferenceWordPiece(tokenizer.vocab_path).encode if reference else tokenizer.encode
    options = InstanceOptions(seq, pred, dupe_factor=DUPE, seed=1)
    documents = []
    n_sentences = 0
    for doc in read_text_documents(sorted(str(p) for p in sentences.glob("part-*.txt"))):
        ids = [encode(s) for s in doc]
        ids = [s for s in ids if s]
        n_sentences += len(ids)
        if ids:
            documents.append(ids)
    instances = InstanceCreator(tokenizer, options).create_training_instances(documents)
    arrays = instances_to_arrays(instances, seq, pred)
    write_shard(work / "instances.h5", arrays, vocab_size=tokenizer.vocab_size,
                vocab_sha256=tokenizer.vocab_sha256, options=options)
    return {"items": len(instances), "unit": "instances", "sentences": n_sentences}


def pipeline_instances(sentences: Path, work: Path, workers: int, seq: int, pred: int) -> dict:
    from popbert.data.instances import InstanceOptions
    from popbert.data.prepare import create_instances
    from popbert.data.tokenization import bundled_vocab_path

    options = InstanceOptions(seq, pred, dupe_factor=DUPE, seed=1)
    record = create_instances(sorted(sentences.glob("part-*.txt")), bundled_vocab_path(),
                              work / f"instances-{seq}", options, workers)
    s = record["stats"]
    return {"items": s["instances_written_now"], "unit": "instances",
            "sentences": s["sentences_written_now"]}


def pipeline_pack(shards: Path, work: Path, workers: int, strategy: str, k: int) -> dict:
    from popbert.data.prepare import pack_shards

    record = pack_shards(sorted(shards.glob("part-*.h5")), work / f"packed-{strategy}",
                         strategy=strategy, max_sequences_per_pack=k, workers=workers)
    return {"items": record["stats"]["sequences"], "unit": "sequences", **record["stats"]}


# ------------------------------------------------------------------------------ per-stage costs
# The whole `prepare-data wikipedia` path on the dump, one stage per fresh process and one worker,
# so each stage's CPU seconds and peak RSS are its own and per core.
def stage_extract(dump: Path, work: Path, part_bytes: int) -> dict:
    from popbert.data.wikipedia import extract_dump

    record = extract_dump(dump, work / "extracted", 1, part_bytes)
    return {"items": record["stats"]["articles"], "unit": "articles"}


def stage_read(dump: Path, part_bytes: int) -> dict:
    """What the extract stage's main process does alone, whatever the number of workers:
    decompress the dump, parse the XML, group pages into parts (and pickle them for workers)."""
    import pickle

    from popbert.data.wikipedia import iter_parts

    parts = 0
    for part in iter_parts(dump, part_bytes):
        pickle.dumps(part)
        parts += 1
    return {"items": parts, "unit": "parts"}


def stage_sentences(work: Path) -> dict:
    from popbert.data.sentences import split_sentences

    record = split_sentences(sorted((work / "extracted").glob("part-*.jsonl")),
                             work / "sentences", 1)
    return {"items": record["stats"]["sentences_written_now"], "unit": "sentences"}


def stage_vocab(work: Path, name: str) -> dict:
    from popbert.data.vocab import train_vocab

    tokenizer = train_vocab(sorted((work / "sentences").glob("part-*.txt")), work / name)
    return {"items": tokenizer.vocab_size, "unit": "entries"}


def stage_instances(work: Path, seq: int, pred: int, dupe: int, out: str = "",
                    baseline: str = "") -> dict:
    """`baseline`: a file holding another version of `popbert.data.instances` (say the one
    before a change) whose `create_instance_arrays` the stage then runs instead."""
    from popbert.data import prepare
    from popbert.data.instances import InstanceOptions

    if baseline:
        import importlib.util

        spec = importlib.util.spec_from_file_location("instances_baseline", str(baseline))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        prepare.create_instance_arrays = module.create_instance_arrays
    options = InstanceOptions(seq, pred, dupe_factor=dupe)
    record = prepare.create_instances(sorted((work / "sentences").glob("part-*.txt")),
                                      work / "vocab.txt",
                                      work / (out or prepare.instances_dir_name(options)),
                                      options, 1)
    return {"items": record["stats"]["instances_written_now"], "unit": "instances"}


def stage_pack(work: Path, seq: int, pred: int, dupe: int) -> dict:
    from popbert.data.instances import InstanceOptions
    from popbert.data.prepare import instances_dir_name, pack_shards, packed_dir_name

    options = InstanceOptions(seq, pred, dupe_factor=dupe)
    record = pack_shards(sorted((work / instances_dir_name(options)).glob("part-*.h5")),
                         work / packed_dir_name(options), seed=options.seed, workers=1)
    return {"items": record["stats"]["packs"], "unit": "rows"}


VARIANTS = {
    "stage_extract": stage_extract, "stage_read": stage_read,
    "stage_sentences": stage_sentences,
    "stage_vocab": stage_vocab, "stage_instances": stage_instances, "stage_pack": stage_pack,

    "simple_extract": simple_extract, "pipeline_extract": pipeline_extract,
    "simple_sentences": simple_sentences, "pipeline_sentences": pipeline_sentences,
    "simple_instances": simple_instances, "pipeline_instances": pipeline_instances,
    "pipeline_pack": pipeline_pack,
}


def run_one(spec: dict) -> dict:
    """Child process: run one variant, report time and peak memory as JSON."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    fn = VARIANTS[spec["variant"]]
    args = [Path(a) if isinstance(a, str) and a.startswith("/") else a for a in spec["args"]]
    workers = next((a for a in args if isinstance(a, int) and not isinstance(a, bool)), 1)
    if not spec["variant"].startswith("pipeline"):
        workers = 1
    if spec["variant"].startswith("stage"):
        warm_up()
    before = usage(workers)[1]
    start = time.perf_counter()
    result = fn(*args)
    result["seconds"] = time.perf_counter() - start
    result["peak_mb"], result["cpu_seconds"] = usage(workers)
    result["work_cpu_seconds"] = result["cpu_seconds"] - before
    return result


def warm_up() -> None:
    """Pay a process's fixed costs (imports, nupunkt's model) before the clock starts: a worker
    pays them once, whatever the dump's size, so they must not enter a per-MB rate."""
    import h5py  # noqa: F401
    import nupunkt
    import tokenizers  # noqa: F401
    import wikiextractor.extract  # noqa: F401

    import popbert.data.prepare  # noqa: F401

    nupunkt.sent_tokenize("Warm up. The model loads once per process.")


def measure(variant: str, *args) -> dict:
    spec = json.dumps({"variant": variant, "args": [str(a) if isinstance(a, Path) else a
                                                    for a in args]})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, __file__, "--one", spec], capture_output=True,
                          text=True, env=env, check=False)
    if proc.returncode:
        raise RuntimeError(f"{variant} failed:\n{proc.stderr[-3000:]}")
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    rate = result["items"] / result["seconds"]
    print(f"  {variant}{args[2:] if len(args) > 2 else ''}: {result['items']} {result['unit']} "
          f"in {result['seconds']:.2f} s ({result['cpu_seconds']:.2f} CPU s) = {rate:,.0f}/s, "
          f"peak {result['peak_mb']:.0f} MB", file=sys.stderr)
    return result


def row(name: str, result: dict, base: dict | None) -> str:
    rate = result["items"] / result["seconds"]
    base = base or result
    return (f"| {name} | {result['items']:,} {result['unit']} | {result['seconds']:.2f} | "
            f"{result['cpu_seconds']:.2f} | {rate:,.0f} | {result['peak_mb']:.0f} | "
            f"{ratio(base['seconds'], result['seconds'])} | "
            f"{ratio(base['cpu_seconds'], result['cpu_seconds'])} |")


def ratio(base: float, this: float) -> str:
    value = base / this
    return f"{value:.1f}x" if value >= 0.1 else f"{value:.2f}x"


def check_reference_tokenizer(sentences: Path) -> str:
    """How often the pure-Python WordPiece gives HF's ids (it should: same algorithm)."""
    from popbert.data.corpus import read_text_documents
    from popbert.data.tokenization import WordPieceTokenizer

    tokenizer = WordPieceTokenizer()
    reference = ReferenceWordPiece(tokenizer.vocab_path)
    sample = [s for d in read_text_documents([str(sorted(sentences.glob("part-*.txt"))[0])])
              for s in d][:2000]
    same = sum(reference.encode(s) == ids for s, ids in zip(sample, tokenizer.encode_batch(sample)))
    return f"{same} of {len(sample)} sentences"


# ------------------------------------------------------------------------------ per-stage report
STAGES = ("extract", "sentences", "vocab", "instances", "pack")
SEQ, PRED, DUPE_CLI = 128, 20, 5  # `prepare-data wikipedia`'s defaults at phase 1
FULL_DUMP_GB = 25.0  # assumption, see RESULTS_data.md: enwiki pages-articles.xml.bz2, late 2026
DEFAULT_PART_BYTES = 8 << 20


def shard_digests(directory: Path) -> dict[str, str]:
    """sha256 of every dataset of every shard: what must not change when the code gets faster."""
    import hashlib

    import h5py
    import numpy as np

    out = {}
    for shard in sorted(directory.glob("part-*.h5")):
        with h5py.File(shard, "r") as f:
            for name in sorted(f):
                data = np.ascontiguousarray(f[name][()])
                out[f"{shard.name}/{name}"] = hashlib.sha256(data.tobytes()).hexdigest()
    return out


def largest_part_mb(dump: Path, part_bytes: int) -> float:
    """Wikitext MB of the largest extract part: what bounds a worker's memory."""
    from popbert.data.wikipedia import iter_parts

    return max(sum(len(p.text) for p in part) for part in iter_parts(dump, part_bytes)) / 2**20


def median(values: list[float]) -> float:
    values = sorted(values)
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def stage_report(dump: Path, repeats: int, baseline_rev: str | None, dump_gb: float,
                 cores: int) -> str:
    """Per stage of `prepare-data wikipedia` on the dump: compressed MB per CPU second (per
    core), peak RSS per worker, the extrapolation to the full dump on `cores` cores, and (with
    `baseline_rev`) the instances stage before/after, interleaved, with shard digests."""
    mb = dump.stat().st_size / 1e6
    load = os.getloadavg()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="popbert-stages-") as tmp:
        root = Path(tmp)
        runs: dict[str, list[dict]] = {name: [] for name in (*STAGES, "read")}
        small: dict[str, dict] = {}
        for rep in range(repeats):
            work = root / f"run{rep}"
            print(f"stages, run {rep + 1} of {repeats}", file=sys.stderr)
            runs["extract"].append(measure("stage_extract", dump, work, DEFAULT_PART_BYTES))
            runs["read"].append(measure("stage_read", dump, DEFAULT_PART_BYTES))
            runs["sentences"].append(measure("stage_sentences", work))
            if rep == 0:
                runs["vocab"].append(measure("stage_vocab", work, "vocab.txt"))
            else:  # one vocabulary for all runs, so instances and pack do the same work
                runs["vocab"].append(measure("stage_vocab", work, "vocab-again.txt"))
                shutil.copy(root / "run0" / "vocab.txt", work / "vocab.txt")
            runs["instances"].append(measure("stage_instances", work, SEQ, PRED, DUPE_CLI))
            runs["pack"].append(measure("stage_pack", work, SEQ, PRED, DUPE_CLI))
        # Memory against part size: the same path with 2 MB parts (several parts, 1 worker).
        work = root / "small"
        small_bytes = 2 << 20
        small["extract"] = measure("stage_extract", dump, work, small_bytes)
        small["sentences"] = measure("stage_sentences", work)
        shutil.copy(root / "run0" / "vocab.txt", work / "vocab.txt")
        small["vocab"] = runs["vocab"][0]
        small["instances"] = measure("stage_instances", work, SEQ, PRED, DUPE_CLI)
        small["pack"] = measure("stage_pack", work, SEQ, PRED, DUPE_CLI)
        part_default = largest_part_mb(dump, DEFAULT_PART_BYTES)
        part_small = largest_part_mb(dump, small_bytes)

        ab = None
        if baseline_rev:
            baseline = root / "instances_baseline.py"
            source = subprocess.run(["git", "-C", str(REPO), "show",
                                     f"{baseline_rev}:data/instances.py"], capture_output=True,
                                    text=True, check=True).stdout
            baseline.write_text(source, encoding="utf-8")
            ab = {"before": [], "after": []}
            work = root / "run0"
            for rep in range(repeats):
                for name, path in (("before", str(baseline)), ("after", "")):
                    print(f"instances {name}, run {rep + 1}", file=sys.stderr)
                    out = f"ab-{name}-{rep}"
                    ab[name].append(measure("stage_instances", work, SEQ, PRED, DUPE_CLI, out,
                                            path))
            digests = {name: shard_digests(work / f"ab-{name}-0") for name in ab}
            same = digests["before"] == digests["after"] and bool(digests["before"])

    def rate(cpu: float) -> float:
        return mb / cpu

    lines += [f"Dump: `{dump.name}`, {mb:.2f} MB compressed ({runs['extract'][0]['items']} "
              f"articles). Defaults of `prepare-data wikipedia`: parts of 8 MB of wikitext, "
              f"nupunkt, a {runs['vocab'][0]['items']:,}-entry vocabulary trained on the "
              f"sample (asked for 30,522), seq {SEQ}, {PRED} predictions, dupe factor "
              f"{DUPE_CLI}, SPFHP packing (3 per row); 1 worker per stage, each stage in a fresh "
              f"process, {repeats} runs. Load average before: {load[0]:.1f} / {load[1]:.1f} / "
              f"{load[2]:.1f} (1/5/15 min), after: {os.getloadavg()[0]:.1f}.", "",
              "Work CPU s: user + system CPU of the stage after imports and model loading "
              "(a fixed cost per process); median (min–max) of the runs. MB/CPU s: compressed "
              "dump MB per CPU second of that stage, i.e. per core. Peak MB: the process's max "
              "RSS (imports included).", "",
              "| stage | output | work CPU s | process CPU s | MB/CPU s (per core) | "
              "peak MB (1 worker) |",
              "| --- | --- | ---: | ---: | ---: | ---: |"]
    total_cpu = 0.0
    medians = {}
    for name in STAGES:
        cpu = [r["work_cpu_seconds"] for r in runs[name]]
        medians[name] = median(cpu)
        total_cpu += medians[name]
        first = runs[name][0]
        lines.append(f"| {name} | {first['items']:,} {first['unit']} | {medians[name]:.2f} "
                     f"({min(cpu):.2f}–{max(cpu):.2f}) | "
                     f"{median([r['cpu_seconds'] for r in runs[name]]):.2f} | "
                     f"{rate(medians[name]):.2f} | "
                     f"{max(r['peak_mb'] for r in runs[name]):.0f} |")
    lines.append(f"| **dump → packed shards** | | {total_cpu:.2f} | | {rate(total_cpu):.2f} | |")
    read_cpu = median([r["work_cpu_seconds"] for r in runs["read"]])
    lines += ["", f"Of extract's work, the main process's own part (decompress bz2, parse the "
              f"XML, group pages into parts, pickle them for the workers: serial, one core "
              f"whatever the workers) takes {read_cpu:.2f} CPU s "
              f"({min(r['work_cpu_seconds'] for r in runs['read']):.2f}–"
              f"{max(r['work_cpu_seconds'] for r in runs['read']):.2f}): "
              f"{rate(read_cpu):.2f} MB/CPU s, the most any number of workers can extract."]

    # Peak per worker against the largest part's wikitext: a line through the two part sizes.
    lines += ["", f"Peak RSS per worker against part size (largest part: {part_small:.1f} MB "
              f"of wikitext with 2 MB parts, {part_default:.1f} MB with the default 8 MB parts, "
              f"the sample being smaller than one default part); a straight line through the "
              f"two, read at 8.5 MB (a default part: 8 MB plus the page that crosses it):", "",
              "| stage | peak MB, 2 MB parts | peak MB, default | per MB of part | at 8.5 MB |",
              "| --- | ---: | ---: | ---: | ---: |"]
    per_worker = {}
    for name in STAGES:
        lo, hi = small[name]["peak_mb"], max(r["peak_mb"] for r in runs[name])
        slope = max(0.0, (hi - lo) / (part_default - part_small))
        per_worker[name] = hi + slope * (8.5 - part_default)
        if name == "vocab":
            lines.append(f"| vocab | – | {hi:.0f} | – | – (one trainer over the whole corpus; "
                         f"see below) |")
            continue
        lines.append(f"| {name} | {lo:.0f} | {hi:.0f} | {slope:.1f} | {per_worker[name]:.0f} |")

    full_mb = dump_gb * 1000
    lines += ["", f"Extrapolation to the full English dump: {dump_gb:.0f} GB compressed "
              f"(assumed), {cores} cores, {cores} workers, linear scaling in compressed bytes "
              f"and across workers assumed:", "",
              "| stage | CPU hours | hours on " f"{cores} cores | peak memory, "
              f"{cores} workers |", "| --- | ---: | ---: | ---: |"]
    total_h = wall_h = 0.0
    read_h = full_mb / rate(read_cpu) / 3600
    for name in STAGES:
        cpu_h = full_mb / rate(medians[name]) / 3600
        hours = f"{cpu_h / cores:.2f}"
        stage_wall = cpu_h / cores
        if name == "extract":
            # The serial reader feeds the workers: the stage is no faster than it.
            clean_h = cpu_h - read_h
            stage_wall = max(read_h, clean_h / (cores - 1))
            hours = (f"{cpu_h / cores:.2f} if linear; **{stage_wall:.2f}** bound by the serial "
                     f"reader ({read_h:.2f} h on one core)")
        total_h += cpu_h
        wall_h += stage_wall
        memory = (f"{cores} × {per_worker[name]:.0f} MB = "
                  f"{cores * per_worker[name] / 1024:.1f} GB") if name != "vocab" else \
            "one process; grows with distinct words (not measured at scale)"
        lines.append(f"| {name} | {cpu_h:.1f} | {hours} | {memory} |")
    lines.append(f"| **total** | {total_h:.1f} | {total_h / cores:.2f} if linear; "
                 f"**{wall_h:.2f}** with the serial reader | |")

    if ab is not None:
        before = [r["work_cpu_seconds"] for r in ab["before"]]
        after = [r["work_cpu_seconds"] for r in ab["after"]]
        lines += ["", f"### instances stage before/after (`{baseline_rev}`'s "
                  f"`create_instance_arrays` vs this tree's), interleaved, same inputs", "",
                  "| version | work CPU s per run | median | MB/CPU s | peak MB |",
                  "| --- | --- | ---: | ---: | ---: |"]
        for name, cpu in (("before", before), ("after", after)):
            lines.append(f"| {name} | {', '.join(f'{c:.2f}' for c in cpu)} | "
                         f"{median(cpu):.2f} | {rate(median(cpu)):.2f} | "
                         f"{max(r['peak_mb'] for r in ab[name]):.0f} |")
        lines += ["", f"Speed-up of the stage: {median(before) / median(after):.2f}x fewer CPU "
                  f"seconds. Shard datasets identical before and after (sha256 of all "
                  f"{len(digests['after'])} datasets): {'yes' if same else 'NO'}."]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--output", type=Path, default=None, help="also write the table here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--stages", action="store_true",
                        help="instead: per-stage cost of `prepare-data wikipedia` on the dump "
                             "sample and its extrapolation to the full dump")
    parser.add_argument("--repeats", type=int, default=3, help="runs per stage (--stages)")
    parser.add_argument("--baseline-rev", default=None, metavar="REV",
                        help="--stages: also time the instances stage with REV's "
                             "data/instances.py, interleaved with this tree's")
    parser.add_argument("--dump-gb", type=float, default=FULL_DUMP_GB,
                        help="compressed size of the full dump assumed for the extrapolation")
    parser.add_argument("--cores", type=int, default=16)
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(run_one(json.loads(args.one))))
        return 0
    if args.stages:
        dump = args.data_dir / DUMP
        if not dump.is_file():
            parser.error(f"{dump} not found (see --data-dir)")
        report = stage_report(dump, args.repeats, args.baseline_rev, args.dump_gb, args.cores)
        print(report)
        if args.output:
            args.output.write_text(report, encoding="utf-8")
        return 0
    dump, vital = args.data_dir / DUMP, args.data_dir / VITAL
    for path in (dump, vital):
        if not path.is_file():
            parser.error(f"{path} not found (see --data-dir)")

    load_before = os.getloadavg()[0]
    lines: list[str] = []
    header = ["| variant | work | wall s | CPU s | per wall s | peak MB | wall vs base | "
              "CPU vs base |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    with tempfile.TemporaryDirectory(prefix="popbert-bench-") as tmp:
        root = Path(tmp)

        def fresh(name: str) -> Path:
            path = root / name
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir(parents=True)
            return path

        print("extract (dump sample)", file=sys.stderr)
        base = measure("simple_extract", dump, fresh("se"))
        lines += [f"### extract: {DUMP} ({base['articles']} articles)", "", *header,
                  row("simple (1 process)", base, None)]
        for w in (1, 2):
            lines.append(row(f"pipeline, {w} worker(s)",
                             measure("pipeline_extract", dump, fresh(f"pe{w}"), w), base))

        parts = root / "vital-extracted"
        write_vital_parts(vital, parts)
        print("sentences (vital articles)", file=sys.stderr)
        lines += ["", "### sentences: vital-articles leads (8 parts); base: simple, nupunkt", "",
                  *header]
        simple_nupunkt = measure("simple_sentences", parts, fresh("ss-n"), "nupunkt")
        lines.append(row("simple, nupunkt", simple_nupunkt, None))
        pipe_sent = {}
        for w in (1, 2):
            pipe_sent[w] = measure("pipeline_sentences", parts, fresh(f"ps{w}"), w, "nupunkt")
            lines.append(row(f"pipeline, nupunkt, {w} worker(s)", pipe_sent[w], simple_nupunkt))
        simple_pysbd = measure("simple_sentences", parts, fresh("ss-p"), "pysbd")
        lines.append(row("simple, pysbd (reference)", simple_pysbd, simple_nupunkt))
        sentences = root / "ps2" / "sentences"

        print("instances (vital articles)", file=sys.stderr)
        agreement = check_reference_tokenizer(sentences)
        lines += ["", f"### instances: seq 128, 20 predictions, dupe factor {DUPE}, bundled "
                  "8192 vocab; base: simple", "", *header]
        simple_inst = measure("simple_instances", sentences, fresh("si"), 128, 20, False)
        reference_inst = measure("simple_instances", sentences, fresh("ri"), 128, 20, True)
        lines.append(row("simple (HF encode per sentence, per-instance masking)", simple_inst,
                         None))
        lines.append(row("reference (pure-Python WordPiece, per-instance masking)",
                         reference_inst, simple_inst))
        pipe_inst = {}
        for w in (1, 2):
            pipe_inst[w] = measure("pipeline_instances", sentences, fresh(f"pi{w}"), w, 128, 20)
            lines.append(row(f"pipeline, {w} worker(s)", pipe_inst[w], simple_inst))
        lines += ["", f"The pure-Python WordPiece gives HF's ids for {agreement}."]

        def total(*results: dict) -> tuple[float, float]:
            return (sum(r["seconds"] for r in results), sum(r["cpu_seconds"] for r in results))

        simple_t = total(simple_nupunkt, simple_inst)
        reference_t = total(simple_pysbd, reference_inst)
        lines += ["", "### sentences + instances, end to end (extracted text -> shards)", "",
                  "| variant | wall s | CPU s | wall: simple / this | wall: reference / this |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for name, (wall, cpu) in (("simple (nupunkt, HF per sentence)", simple_t),
                                  ("reference (pysbd, pure-Python WordPiece)", reference_t),
                                  *((f"pipeline, {w} worker(s)",
                                     total(pipe_sent[w], pipe_inst[w])) for w in (1, 2))):
            lines.append(f"| {name} | {wall:.2f} | {cpu:.2f} | {simple_t[0] / wall:.1f}x | "
                         f"{reference_t[0] / wall:.1f}x |")

        print("packing (vital articles at 128 and 512)", file=sys.stderr)
        measure("pipeline_instances", sentences, root / "pi2", 2, 512, 80)
        lines += ["", "### packing", "",
                  "| instances | strategy | max per row | sequences | rows | padding before | "
                  "padding after | sequences per row | wall s (2 workers) |",
                  "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
        for seq, k in ((128, 3), (512, 3), (512, 8)):
            for strategy in ("spfhp", "lpfhp"):
                r = measure("pipeline_pack", root / "pi2" / f"instances-{seq}",
                            fresh(f"pack{seq}{strategy}{k}"), 2, strategy, k)
                lines.append(f"| seq {seq} | {strategy} | {k} | {r['sequences']:,} | "
                             f"{r['packs']:,} | {100 * r['padding_before']:.1f}% | "
                             f"{100 * r['padding_after']:.1f}% | {r['speedup']:.3f} | "
                             f"{r['seconds']:.2f} |")
    preamble = [f"Machine: {os.cpu_count()} CPUs visible, Python {sys.version.split()[0]}; load "
                f"average {load_before:.1f} before and {os.getloadavg()[0]:.1f} after the run "
                f"(other processes share the cores). Peak MB: max RSS of the process plus "
                f"workers x the largest worker's. CPU s: user + system time of all processes.",
                ""]
    table = "\n".join(preamble + lines) + "\n"
    print(table)
    if args.output:
        args.output.write_text(table, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
