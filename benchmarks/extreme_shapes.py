"""Stage rates of `popbert prepare-data` on inputs of extreme shape (issue 31 item 4).

    python benchmarks/extreme_shapes.py [--shapes long-line,tiny-files] [--scale 0.25]
                                        [--ratio] [--workers 1] [--work DIR] [--output FILE]

Each shape is written from the bundled Wikipedia text (data/resources/wiki_corpus.txt), then
the stages that read it run as `python -m popbert prepare-data ...`, each in a fresh process:
wall seconds, CPU seconds (user + system of that process and its workers) and peak RSS, and
the rate per wall second in MB of the stage's input and in its items (lines, files, tokens).
`--ratio` also runs every shape at a quarter of its size and reports the CPU ratio of the full
size to the quarter (linear ~4x, a quadratic step ~16x). The Markdown table goes to stdout and,
with `--output`, to that file; the machine (cores, CPU model, load average before and after,
from /proc/cpuinfo and /proc/loadavg) heads it, because a shared machine's wall times say as
much about the other jobs as about popbert.

Shapes (sizes at --scale 1):

- `long-line`: one document of 20 MB of prose on one line (plain text, a document a line):
  sentences (nupunkt), vocab, instances.
- `long-line-pysbd`: the same shape, 2 MB, split by pysbd (whose own time is quadratic in a
  paragraph: popbert gives it 10,000 characters at a time).
- `unbroken-sentence`: one document of one 20 MB sentence without sentence ends (Google's
  format): vocab, instances (the sentence is truncated to one sequence per pass).
- `enormous-document`: one JSON line holding a 20 MB document of 2 KB paragraphs: sentences,
  vocab, instances.
- `one-word-lines`: 1,000,000 lines of one word: sentences (a document a line,
  `--min-sentences 1`), vocab, instances (Google's format: one document of 1M sentences).
- `tiny-files`: 50,000 files of one two-sentence document each, as a glob: sentences (one part
  per file), vocab, instances (one shard per part).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "data" / "resources" / "wiki_corpus.txt"
VOCAB = REPO / "data" / "resources" / "vocab.txt"
MB = 1_000_000
SHAPES = ("long-line", "long-line-pysbd", "unbroken-sentence", "enormous-document",
          "one-word-lines", "tiny-files")


# ------------------------------------------------------------------------------ inputs
def _text() -> tuple[list[str], list[str]]:
    text = CORPUS.read_text(encoding="utf-8")
    sentences = [s for s in text.splitlines() if s.strip()]
    return sentences, re.sub(r"[^\w\s]", "", text.lower()).split()


SENTENCES, WORDS = _text()


def prose(chars: int, start: int = 0) -> str:
    """Real sentences back to back from the `start`-th on, about `chars` characters."""
    out, size, i = [], 0, start
    while size < chars:
        sentence = SENTENCES[i % len(SENTENCES)]
        out.append(sentence)
        size += len(sentence) + 1
        i += 1
    return " ".join(out)


def words(count: int, joiner: str) -> str:
    return joiner.join(WORDS[i % len(WORDS)] for i in range(count))


@dataclass
class Run:
    shape: str
    stage: str
    size: str  # the input, in words
    megabytes: float
    items: int
    unit: str
    wall: float
    cpu: float
    peak_mb: float
    quarter_cpu: float | None = None


def prepare_data(*argv: object) -> tuple[float, float, float]:
    """(wall s, CPU s, peak MB) of one `popbert prepare-data` call in a fresh process."""
    command = [sys.executable, "-m", "popbert", "prepare-data", *map(str, argv)]
    with tempfile.TemporaryFile() as log:  # a pipe could fill up and stall the stage
        started = time.perf_counter()
        process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        _, status, usage = os.wait4(process.pid, 0)
        wall = time.perf_counter() - started
        process.returncode = os.waitstatus_to_exitcode(status)
        if process.returncode != 0:
            log.seek(0)
            err = log.read().decode(errors="replace")
            raise SystemExit(f"failed ({process.returncode}): {' '.join(command)}\n"
                             f"{err[-2000:]}")
    # RUSAGE of the waited child includes its own waited-for workers.
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024


def size_of(path: Path) -> float:
    """MB of a file, or of a directory's data files (not its records or hidden files)."""
    if not path.is_dir():
        return path.stat().st_size / MB
    return sum(p.stat().st_size for p in path.iterdir()
               if p.is_file() and not p.name.startswith(("_", "."))) / MB


def stages(shape: str, work: Path, source: Path, units: tuple[int, str], workers: int,
           sentences_args: list | None, vocab_input: Path | None,
           instances_input: Path | None) -> list[Run]:
    """Run the shape's stages on `source`; the instance stage reads `instances_input` (the
    sentences stage's output, or the source itself in Google's format)."""
    runs = []
    label = f"{units[0]:,} {units[1]}"
    if sentences_args is not None:
        wall, cpu, peak = prepare_data("sentences", "--input", source, "-o", work / "sentences",
                                       "--workers", workers, *sentences_args)
        record = json.loads((work / "sentences" / "_SUCCESS.json").read_text())
        runs.append(Run(shape, "sentences", label, size_of(source if source.is_file()
                                                           else source.parent),
                        record["stats"]["sentences_written_now"], "sentences", wall, cpu, peak))
    if vocab_input is not None:
        wall, cpu, peak = prepare_data("vocab", "--input", vocab_input, "-o", work / "vocab.txt",
                                       "--vocab-size", 8192)
        runs.append(Run(shape, "vocab", label, size_of(vocab_input), 0, "", wall, cpu, peak))
    if instances_input is not None:
        wall, cpu, peak = prepare_data("instances", "--input", instances_input, "--vocab", VOCAB,
                                       "--sequence-length", 128, "--max-predictions", 20,
                                       "--dupe-factor", 1, "--workers", workers,
                                       "-o", work / "instances")
        stats = json.loads((work / "instances" / "_SUCCESS.json").read_text())["stats"]
        runs.append(Run(shape, "instances", label, size_of(instances_input),
                        stats["instances_written_now"], "instances", wall, cpu, peak))
    return runs


def shape_runs(shape: str, work: Path, scale: float, workers: int) -> list[Run]:
    """Write the shape's input under `work` at `scale` and run its stages."""
    work.mkdir(parents=True)
    if shape in ("long-line", "long-line-pysbd"):
        megabytes = (20 if shape == "long-line" else 2) * scale
        source = work / "line.txt"
        source.write_text(prose(int(megabytes * MB)) + "\n", encoding="utf-8")
        splitter = ["--splitter", "pysbd"] if shape == "long-line-pysbd" else []
        return stages(shape, work, source, (1, "line"), workers, splitter,
                      work / "sentences", work / "sentences")
    if shape == "unbroken-sentence":
        count = int(20 * MB * scale / 6)
        source = work / "sentence.txt"
        source.write_text(words(count, " ") + "\n", encoding="utf-8")
        return stages(shape, work, source, (count, "words in 1 sentence"), workers, None,
                      source, source)
    if shape == "enormous-document":
        paragraphs = int(20 * MB * scale / 2000)
        source = work / "document.jsonl"
        text = "\n".join(prose(2000, 20 * i) for i in range(paragraphs))
        source.write_text(json.dumps({"text": text}) + "\n", encoding="utf-8")
        return stages(shape, work, source, (paragraphs, "paragraphs in 1 document"), workers,
                      [], work / "sentences", work / "sentences")
    if shape == "one-word-lines":
        lines = int(1_000_000 * scale)
        source = work / "words.txt"
        source.write_text(words(lines, "\n") + "\n", encoding="utf-8")
        return stages(shape, work, source, (lines, "lines"), workers, ["--min-sentences", 1],
                      source, source)
    if shape == "tiny-files":
        files = int(50_000 * scale)
        folder = work / "in"
        folder.mkdir()
        for i in range(files):
            (folder / f"doc-{i:07d}.txt").write_text(
                f"{SENTENCES[2 * i % len(SENTENCES)]} {SENTENCES[(2 * i + 1) % len(SENTENCES)]}\n",
                encoding="utf-8")
        return stages(shape, work, folder / "*.txt", (files, "files"), workers, [],
                      work / "sentences", work / "sentences")
    raise SystemExit(f"unknown shape {shape!r}; choose from {', '.join(SHAPES)}")


# ------------------------------------------------------------------------------ report
def machine() -> dict[str, str]:
    model = next((line.split(":", 1)[1].strip()
                  for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor() or "unknown")
    return {"cores": str(os.cpu_count()), "cpu": model,
            "python": platform.python_version(),
            "revision": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO,
                                       capture_output=True, text=True).stdout.strip()}


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def table(runs: list[Run]) -> list[str]:
    ratio = any(r.quarter_cpu is not None for r in runs)
    head = ("| shape | stage | input | MB | wall s | CPU s | MB/s (wall) | items/s (wall) "
            "| peak MB |" + (" CPU x (4x input) |" if ratio else ""))
    lines = [head, "| " + " | ".join(["---"] * (head.count("|") - 1)) + " |"]
    for r in runs:
        rate = f"{r.items / r.wall:,.0f} {r.unit}" if r.items else ""
        cells = [r.shape, r.stage, r.size, f"{r.megabytes:.1f}", f"{r.wall:.2f}",
                 f"{r.cpu:.2f}", f"{r.megabytes / r.wall:.2f}", rate, f"{r.peak_mb:.0f}"]
        if ratio:
            cells.append(f"{r.cpu / r.quarter_cpu:.1f}x" if r.quarter_cpu else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Shapes: " + ", ".join(SHAPES))
    parser.add_argument("--shapes", default=",".join(SHAPES),
                        help="comma-separated shapes to run (default: all)")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every shape's size (default 1: 20 MB lines, 1M lines, "
                             "50k files)")
    parser.add_argument("--ratio", action="store_true",
                        help="also run each shape at a quarter of its size and report the "
                             "CPU ratio (linear ~4x, quadratic ~16x)")
    parser.add_argument("--workers", type=int, default=1,
                        help="worker processes per stage (default 1: rates per core)")
    parser.add_argument("--work", default=None,
                        help="directory for inputs and outputs (default: a temporary one, "
                             "removed after)")
    parser.add_argument("--output", default=None, help="also write the table to this file")
    args = parser.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = sorted(set(shapes) - set(SHAPES))
    if unknown:
        parser.error(f"unknown shapes {unknown}; choose from {', '.join(SHAPES)}")
    root = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="extreme-shapes-"))
    before, started = load(), time.strftime("%Y-%m-%d %H:%M %Z")
    runs: list[Run] = []
    try:
        for shape in shapes:
            full = shape_runs(shape, root / shape, args.scale, args.workers)
            if args.ratio:
                quarter = shape_runs(shape, root / f"{shape}-quarter", args.scale / 4,
                                     args.workers)
                for run, small in zip(full, quarter):
                    run.quarter_cpu = small.cpu
            runs.extend(full)
            for line in table(full)[2:]:
                print(line, file=sys.stderr, flush=True)
    finally:
        if not args.work:
            shutil.rmtree(root, ignore_errors=True)
    info = machine()
    startup = min(prepare_data("sentences", "--help")[0] for _ in range(3))
    lines = [f"Machine: {info['cores']} cores ({info['cpu']}), Python {info['python']}, "
             f"popbert {info['revision']}; {started}; load average (1, 5, 15 min) {before} "
             f"before, {load()} after; --scale {args.scale:g}, --workers {args.workers}. "
             f"Every figure includes a process's start-up ({startup:.2f} s for "
             f"`prepare-data sentences --help`).", "", *table(runs)]
    print("\n".join(lines))
    if args.output:
        Path(args.output).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
