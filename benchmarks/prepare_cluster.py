"""Preparation throughput on 1 and 2 workers: the local process pool against a Dask cluster,
and what it projects for English Wikipedia next to NVIDIA LDDL's published time.

From extracted text to instance shards, as LDDL measures it (one duplication; LDDL masks at
load time): the `sentences` stage (split into sentences) then the `instances` stage (tokenize,
make MLM/NSP instances, write HDF5 shards), each a `popbert prepare-data` command in its own
process. The input is the repository's own real text, `benchmarks/data/wiki-vital-train.txt.gz`
(6,736 Wikipedia article leads, 3.4 MB) repeated `--copies` times (so each stage runs long enough
that process start-up does not dominate), written as `--parts` extracted parts (JSON lines, one
article a line). Four ways, each `--repeats` times, interleaved so machine noise hits all alike:
`--workers 1`, `--workers 2`, and `--dask` on a Dask `LocalCluster` of 1 and of 2 worker
processes (one thread each, started before the clock). Every run's shards are checked equal to
the first's. Rates: input MB and words of text per second of wall time, and per worker.

Projection: English Wikipedia's 2.5 billion words (LDDL's figure) at the measured per-worker
rate, on N machines of 16 cores each running 16 one-thread workers; LDDL: 0.27 h on one DGX A100
node (128 cores), about 0.05 h on 32 nodes. A 2-core VM's per-core rate is not a server
core's: the projection says what the code does per core, not what a cluster would measure.

    python benchmarks/prepare_cluster.py                  # about 5 minutes on 2 cores
    python benchmarks/prepare_cluster.py --repeats 1 --copies 2
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = ROOT / "benchmarks" / "data" / "wiki-vital-train.txt.gz"
WIKIPEDIA_WORDS = 2.5e9  # English Wikipedia, as LDDL reports it
LDDL_HOURS = {1: 0.27, 32: 0.05}  # DGX A100 nodes (128 cores each) -> hours, from LDDL
INSTANCE_ARGS = ["--sequence-length", "128", "--max-predictions", "20", "--dupe-factor", "1",
                 "--seed", "7"]


def write_extracted(work: Path, parts: int, copies: int) -> tuple[Path, float, int]:
    """The text, `copies` times, as `parts` extracted parts; (directory, input MB, words)."""
    documents = [d for d in gzip.open(TEXT, "rt", encoding="utf-8").read().split("\n\n")
                 if d.strip()] * copies
    directory = work / "extracted"
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    size = words = 0
    for index in range(parts):
        lines = []
        for number, document in enumerate(documents[index::parts]):
            text = " ".join(document.split("\n"))  # a lead as one paragraph of prose
            lines.append(json.dumps({"id": f"{index}-{number}", "title": "", "text": text}))
            size += len(text.encode("utf-8"))
            words += len(text.split())
        (directory / f"part-{index:05d}.jsonl").write_text("\n".join(lines) + "\n",
                                                          encoding="utf-8")
    return directory, size / 1e6, words


def run_stages(extracted: Path, out: Path, how: list[str]) -> float:
    """Wall seconds of `sentences` then `instances` into `out` (removed first)."""
    from popbert.data.tokenization import bundled_vocab_path

    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "TQDM_DISABLE": "1"}
    started = time.perf_counter()
    for argv in (["sentences", "--input", str(extracted), "-o", str(out / "sentences")],
                 ["instances", "--input", str(out / "sentences"), "--vocab",
                  str(bundled_vocab_path()), "-o", str(out / "instances"), *INSTANCE_ARGS]):
        done = subprocess.run([sys.executable, "-m", "popbert", "prepare-data", *argv, *how],
                              env=env, capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"prepare-data {argv[0]} {' '.join(how)} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - started


def same_shards(a: Path, b: Path) -> bool:
    import numpy as np

    from popbert.data import read_shard

    first, second = sorted(a.glob("part-*.h5")), sorted(b.glob("part-*.h5"))
    if [p.name for p in first] != [p.name for p in second]:
        return False
    for x, y in zip(first, second):
        u, v = read_shard(x), read_shard(y)
        if u.keys() != v.keys() or not all(np.array_equal(u[k], v[k]) for k in u):
            return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--parts", type=int, default=16)
    parser.add_argument("--copies", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--work-dir", default="runs/prepare-cluster")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args()
    from distributed import LocalCluster

    work = Path(args.work_dir).absolute()
    extracted, megabytes, words = write_extracted(work, args.parts, args.copies)
    clusters = {n: LocalCluster(n_workers=n, threads_per_worker=1, processes=True,
                                dashboard_address=None) for n in (1, 2)}
    ways = {"local, 1 worker": (1, ["--workers", "1"]),
            "local, 2 workers": (2, ["--workers", "2"]),
            "Dask, 1 worker": (1, ["--dask", clusters[1].scheduler_address]),
            "Dask, 2 workers": (2, ["--dask", clusters[2].scheduler_address])}
    times: dict[str, list[float]] = {name: [] for name in ways}
    load = os.getloadavg()
    started = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    reference = None
    try:
        for repeat in range(args.repeats):
            for index, (name, (_, how)) in enumerate(ways.items()):
                out = work / f"run-{index}"
                times[name].append(run_stages(extracted, out, how))
                if reference is None:
                    reference = work / "reference"
                    shutil.rmtree(reference, ignore_errors=True)
                    shutil.copytree(out / "instances", reference)
                elif not same_shards(out / "instances", reference):
                    sys.exit(f"{name}: shards differ from the first run's")
                print(f"repeat {repeat + 1}: {name}: {times[name][-1]:.1f} s", flush=True)
    finally:
        for cluster in clusters.values():
            cluster.close()
    results = {"started_utc": started, "loadavg_at_start": load, "cpu": _cpu(),
               "input_mb": megabytes, "words": words, "parts": args.parts,
               "copies": args.copies, "ways": {}}
    print(f"\n{args.parts} parts, {megabytes:.2f} MB, {words:,} words; median of "
          f"{args.repeats}; load at start {load[0]:.2f}")
    print("| way | s (median) | MB/s | words/s | words/s per worker | vs 1 worker |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, (workers, _) in ways.items():
        seconds = statistics.median(times[name])
        base = statistics.median(times[name.replace("2 workers", "1 worker")])
        rate = words / seconds
        results["ways"][name] = {"seconds": times[name], "median_s": seconds,
                                 "mb_per_s": megabytes / seconds, "words_per_s": rate,
                                 "words_per_s_per_worker": rate / workers}
        print(f"| {name} | {seconds:.1f} | {megabytes / seconds:.2f} | {rate:,.0f} | "
              f"{rate / workers:,.0f} | {base / seconds:.2f}x |")
    per_core = results["ways"]["Dask, 2 workers"]["words_per_s_per_worker"]
    lddl_per_core = WIKIPEDIA_WORDS / (LDDL_HOURS[1] * 3600 * 128)
    results["lddl_words_per_core_s"] = lddl_per_core
    print(f"\nper core: popbert on Dask {per_core:,.0f} words/s, LDDL {lddl_per_core:,.0f} "
          f"words/s ({per_core / lddl_per_core:.2f}x)")
    print("| machines x 16 cores | popbert, projected | LDDL, published (128-core nodes) |")
    print("| ---: | ---: | ---: |")
    for machines in (1, 8, 32):
        hours = WIKIPEDIA_WORDS / (per_core * 16 * machines) / 3600
        lddl = LDDL_HOURS.get(machines)
        print(f"| {machines} | {hours:.2f} h ({hours * 60:.0f} min) | "
              f"{f'{lddl} h on {machines} node(s)' if lddl else '-'} |")
        results.setdefault("projection_hours", {})[machines] = hours
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


def _cpu() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


if __name__ == "__main__":
    main()
