"""Training steps/s with shards on an S3-compatible server against the same shards on local disk.

The shards: `popbert prepare-data instances` on the repository's own real text
(`benchmarks/data/wiki-vital-train.txt.gz`, 6,736 Wikipedia article leads) cut into `--parts`
files, at sequence 128 with 20 predictions and `--dupe-factor` passes: about 4 MB of shard per
part. They are read three ways by the same `popbert pretrain` job (the `tiny` preset, `--steps`
steps, micro batch `--batch`), each a process of its own, interleaved `--repeats` times:

- `local`: from local disk;
- `s3`: from moto's S3 server on 127.0.0.1 (credentials enforced), through popbert's shard
  cache, started empty for every run, with the next shards fetched ahead;
- `s3-capped`: the same behind a relay that caps the server's replies at `--mbps` megabits per
  second, a remote store's link rather than the loopback's.

The server runs on the same cores as the training (a real store's CPU is elsewhere): the CPU
time it used during each run is printed, to tell its share of any gap.

What counts is the training loop's own time (its "trained N steps in X s" line): the first
shard's fetch and every later one happen inside it. The process's wall time is printed too.

    python benchmarks/s3_training.py                      # about 6 minutes on 2 cores
    python benchmarks/s3_training.py --repeats 1 --steps 150
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the S3 server and relay the tests start

from s3_server import Relay, s3_server  # noqa: E402

TEXT = ROOT / "benchmarks" / "data" / "wiki-vital-train.txt.gz"
BUCKET = "bench"
TRAINED = re.compile(r"trained (\d+) steps \(\d+ → \d+\) in ([0-9.]+) s")


def make_shards(work: Path, parts: int, dupe: int) -> Path:
    """The instance shards of the text cut into `parts` files."""
    documents = [d for d in gzip.open(TEXT, "rt", encoding="utf-8").read().split("\n\n")
                 if d.strip()]
    corpus = work / "corpus"
    corpus.mkdir()
    for i in range(parts):
        share = documents[i * len(documents) // parts:(i + 1) * len(documents) // parts]
        (corpus / f"part-{i:03d}.txt").write_text("\n\n".join(share) + "\n", encoding="utf-8")
    shards = work / "shards"
    subprocess.run([sys.executable, "-m", "popbert", "prepare-data", "instances", "--input",
                    str(corpus / "part-*.txt"), "--vocab",
                    str(ROOT / "data" / "resources" / "vocab.txt"), "-o", str(shards),
                    "--sequence-length", "128", "--max-predictions", "20", "--dupe-factor",
                    str(dupe), "--seed", "7"], check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    return shards


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def cpu_seconds(pid: int) -> float:
    """User + system CPU time a process has used (Linux `/proc`)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def train(inputs: str, work: Path, steps: int, batch: int, env: dict) -> tuple[float, float, int]:
    """(loop seconds, process seconds, steps) of one `popbert pretrain` run on `inputs`."""
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    cache = work / "cache"
    shutil.rmtree(cache, ignore_errors=True)
    command = [sys.executable, "-m", "popbert", "pretrain", "--config", "tiny",
               "-o", str(run), "--set", f"data.input_files=['{inputs}']",
               "--set", f"data.cache_dir={cache}", "--set", f"training.steps={steps}",
               "--set", f"execution.micro_batch_size={batch}", "--set", "training.log_every=50",
               "--set", f"training.checkpoint_every={steps}"]
    start = time.perf_counter()
    done = subprocess.run(command, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"pretrain failed on {inputs}:\n{done.stderr[-3000:]}")
    found = TRAINED.search(done.stderr)
    if found is None:
        raise SystemExit(f"no 'trained' line in the log of the run on {inputs}")
    return float(found.group(2)), wall, int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=int, default=8)
    parser.add_argument("--dupe-factor", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--mbps", type=float, default=100.0,
                        help="the capped link's bandwidth in megabits per second")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="popbert-s3-bench-") as tmp:
        work = Path(tmp)
        shards = make_shards(work, args.parts, args.dupe_factor)
        files = sorted(shards.glob("part-*.h5"))
        shard_mb = statistics.mean(p.stat().st_size for p in files) / 1e6
        print(f"{len(files)} shards, {shard_mb:.1f} MB each on average", flush=True)
        with s3_server() as server:
            fs = server.filesystem()
            fs.mkdir(BUCKET)
            for part in files:
                fs.put_file(str(part), f"{BUCKET}/shards/{part.name}")
            port = int(server.endpoint.rsplit(":", 1)[1])
            relay = Relay(port, bytes_per_s=args.mbps * 1e6 / 8)
            base = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "2")}
            ways = {
                "local": (str(shards / "part-*.h5"), base),
                "s3": (f"s3://{BUCKET}/shards/part-*.h5", {**base, **server.environment()}),
                "s3-capped": (f"s3://{BUCKET}/shards/part-*.h5",
                              {**base, **server.environment(relay.endpoint)}),
            }
            results: dict[str, list[dict]] = {name: [] for name in ways}
            try:
                for repeat in range(args.repeats):
                    for name, (inputs, env) in ways.items():
                        served = cpu_seconds(server.process.pid)
                        loop_s, wall_s, steps = train(inputs, work, args.steps, args.batch, env)
                        served = cpu_seconds(server.process.pid) - served
                        results[name].append({"loop_s": loop_s, "wall_s": wall_s,
                                              "steps_per_s": steps / loop_s,
                                              "server_cpu_s": served})
                        print(f"repeat {repeat + 1} {name:10s} {steps / loop_s:6.2f} steps/s "
                              f"(loop {loop_s:.1f} s, process {wall_s:.1f} s; the S3 server "
                              f"used {served:.1f} s of CPU)", flush=True)
            finally:
                relay.close()
    local = statistics.median(r["steps_per_s"] for r in results["local"])
    summary = {}
    for name, runs in results.items():
        rate = statistics.median(r["steps_per_s"] for r in runs)
        summary[name] = {"steps_per_s": rate, "vs_local": rate / local, "runs": runs}
        print(f"{name:10s} median {rate:6.2f} steps/s = {rate / local:.3f}x local")
    if args.json:
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "cpu": cpu_model(),
            "cores": os.cpu_count(), "load_at_end": os.getloadavg()[0],
            "shards": len(files), "shard_mb": shard_mb, "steps": args.steps,
            "micro_batch": args.batch, "capped_mbps": args.mbps, "results": summary},
            indent=1) + "\n")


if __name__ == "__main__":
    main()
