"""What `popbert serve --max-padding` buys (issue 41): one embedding export served at 128
closed-loop clients with each padding bound in turn, rounds interleaved, and what the server's
own `/metrics` say the batcher did: rows and tokens per model run, the share of computed tokens
that were padding, and the share of the wall time the model ran.

On a CPU a batch saves little beyond the per-run overhead while padding is computed work, so
the bound trades batch size against wasted tokens; 0 batches only rows of one length. The load
is `benchmarks/serve.py`'s (its async httpx clients, its texts, its server process handling);
the export is one `benchmarks/serve.py` builds under its `--work` directory (e.g. the
OpenVINO static INT8 one, `openvino-int8/`).

    python benchmarks/serve_padding.py --model /tmp/popbert-serve-bench/openvino-int8 \
        --paddings 0 0.02 0.05 0.1 0.25 --rounds 3 --out benchmarks/serve_padding.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

import serve as bench  # noqa: E402  (benchmarks/serve.py: the load and the server handling)

# The batcher's running totals read from `/metrics`.
BATCH_TOTALS = {f"{name}_{part}" for name in ("popbert_batch_rows", "popbert_batch_tokens",
                                              "popbert_batch_duration_seconds")
                for part in ("sum", "count")} | {"popbert_padding_tokens_total"}


def batch_totals(base: str) -> dict[str, float]:
    """The batcher's running totals from `/metrics` (summed over workers)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(base + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name in BATCH_TOTALS:
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
    return totals


def one_setting(model: Path, padding: float, args: argparse.Namespace,
                texts: list[str]) -> dict:
    """Start `popbert serve` with `--max-padding padding`, warm it, load it, read its metrics."""
    import httpx

    command = [sys.executable, "-m", "popbert", "serve", "--model", str(model), "--host",
               "127.0.0.1", "--threads", str(args.threads), "--workers", str(args.workers),
               "--max-padding", str(padding)]
    side = bench.Side(f"padding-{padding}", command, "/v1/embeddings", "/v1/models",
                      workers=args.workers)
    server = bench.Server(side, args.work / f"serve-padding-{padding}.log")
    try:
        server.wait_ready(side.health, 300)
        if args.workers > 1:
            server.wait_workers(args.workers, 300)
        name = httpx.get(server.base + "/v1/models", timeout=10).json()["data"][0]["id"]
        url = server.base + side.route
        body = bench.body_for(side, name)
        asyncio.run(bench.load(url, body, texts, 8, 48, 60))  # warm-up
        before, cpu_before = batch_totals(server.base), server.cpu_seconds()
        level = asyncio.run(bench.load(url, body, texts, args.clients, 100_000, args.seconds))
        after, cpu_after = batch_totals(server.base), server.cpu_seconds()
    finally:
        server.stop()
    done = {key: after[key] - before.get(key, 0.0) for key in after}
    runs = done["popbert_batch_rows_count"]
    tokens = done["popbert_batch_tokens_sum"]  # the rows' own tokens
    padding_tokens = done.get("popbert_padding_tokens_total", 0.0)
    return {"max_padding": padding, "requests_per_second": level["requests_per_second"],
            "p95_ms": level["p95_ms"], "errors": level["errors"],
            "server_cpu_ms_per_request": 1000 * (cpu_after - cpu_before) / level["requests"],
            "client_cores": level["client_cpu_seconds"] / level["seconds"],
            "rows_per_run": done["popbert_batch_rows_sum"] / runs,
            "tokens_per_run": tokens / runs,
            "padding_share": padding_tokens / (tokens + padding_tokens),  # of computed tokens
            "model_busy_share": done["popbert_batch_duration_seconds_sum"] / level["seconds"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="an embedding export")
    parser.add_argument("--paddings", nargs="+", type=float, default=[0, 0.02, 0.05, 0.1, 0.25])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=128)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--work", type=Path, default=Path("/tmp/popbert-serve-bench"))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    texts = bench.read_texts()
    rows: dict[float, list[dict]] = {padding: [] for padding in args.paddings}
    for round_index in range(args.rounds):
        for padding in args.paddings:
            row = one_setting(args.model, padding, args, texts)
            rows[padding].append(row)
            print(f"round {round_index + 1} max_padding {padding}: " + ", ".join(
                f"{key} {value:.3g}" for key, value in row.items() if key != "max_padding"),
                flush=True)
    summary = {str(padding): {key: statistics.median(r[key] for r in runs)
                              for key in runs[0] if key != "max_padding"}
               for padding, runs in rows.items()}
    print(f"{'max_padding':>11} {'req/s':>7} {'p95 ms':>7} {'CPU ms/req':>10} {'rows/run':>8} "
          f"{'padding':>7} {'model busy':>10}   (medians of {args.rounds} rounds)")
    for padding, row in summary.items():
        print(f"{padding:>11} {row['requests_per_second']:7.1f} {row['p95_ms']:7.0f} "
              f"{row['server_cpu_ms_per_request']:10.2f} {row['rows_per_run']:8.1f} "
              f"{row['padding_share']:7.1%} {row['model_busy_share']:10.2f}")
    if args.out is not None:
        args.out.write_text(json.dumps({
            "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "model": str(args.model),
            "clients": args.clients, "seconds": args.seconds, "threads": args.threads,
            "workers": args.workers, "cpu": bench.cpu_model(), "median": summary,
            "rounds": {str(p): runs for p, runs in rows.items()}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
