"""Throughput and memory of data-parallel replicas, RTS, recomputation and pipelining.

Each variant trains the same model through `TrainingSession` on the bundled corpus, one process
per replica (torch.multiprocessing; gloo on CPU, NCCL on GPU), with a fixed micro batch and
accumulation per replica (weak scaling: the global batch grows with the replicas). Reported per
(variant, processes): sequences/s of the whole job, scaling efficiency against 1 process of the
same variant, step time, and per replica: CPU time per step (all threads of the process; on a
shared machine far steadier than wall time), peak memory of a training step (CPU: bytes of the
tensors a step creates and holds at once, measured over one extra, untimed step; GPU: the
allocator's peak over the timed steps, weights and optimizer state included) and the FP32
optimizer state it holds.

    python benchmarks/scaling.py                                 # CPU, tiny, 1/2/4 processes
    python benchmarks/scaling.py --device cuda --config base-128 --processes 1 \\
        --micro-batch 32 --accumulation 4 --variants dp rts recompute rts+recompute
    python benchmarks/scaling.py --json results.json             # also write the numbers

Variants: dp (plain data parallel), rts (replicated tensor sharding), recompute (activation
checkpointing from the graph's checkpoints), pipeline (1F1B over the graph's stages, on the
replica's devices), combined with "+".
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

# The workers measure with the tests' memory helpers (tests/memory_helpers.py).
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

VARIANTS = {"dp": {}, "rts": {"execution.replicated_tensor_sharding": True},
            "recompute": {"execution.recompute": True}, "pipeline": {"execution.pipeline": True}}


def variant_overrides(name: str) -> dict:
    out: dict = {}
    for part in name.split("+"):
        if part not in VARIANTS:
            raise SystemExit(f"unknown variant {part!r}; expected {sorted(VARIANTS)}")
        out.update(VARIANTS[part])
    return out


def make_config(args: argparse.Namespace, variant: str, processes: int):
    from popbert.config import load_config

    sets = {"execution.device": args.device, "execution.replicas": processes,
            "execution.micro_batch_size": args.micro_batch,
            "execution.gradient_accumulation": args.accumulation,
            "training.global_batch_size": None, **variant_overrides(variant)}
    if args.device == "cpu":
        sets["execution.threads"] = args.threads
    if "recompute" in variant or "pipeline" in variant:
        sets.setdefault("model.recompute", True)
        base = load_config(args.config, args.set).model
        if not base.layers_per_ipu:
            # The placement the graph's stages and checkpoints come from: recomputation alone
            # puts every layer on one device (a checkpoint after each but the last);
            # pipelining gives the embeddings a device and splits the layers over two more.
            layers = base.num_layers
            sets["model.layers_per_ipu"] = ([0, layers // 2, layers - layers // 2]
                                            if "pipeline" in variant else [layers])
    extra = [f"{k}={json.dumps(v)}" for k, v in sets.items()]
    cfg = load_config(args.config, [*extra, *args.set])
    return cfg


def worker(rank: int, world: int, port: int, args: argparse.Namespace, variant: str,
           out: str) -> None:
    import torch.distributed as dist
    from memory_helpers import PeakMemory, optimizer_state_bytes

    from popbert.distributed import Replicas
    from popbert.train.trainer import Trainer, micro_batches

    cfg = make_config(args, variant, world)
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(args.threads)
    replicas = Replicas.single()
    if world > 1:
        dist.init_process_group("nccl" if cuda else "gloo",
                                init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world)
        replicas = Replicas.from_group(None, local_rank=rank, owns_process_group=True)
    # The run as the Trainer assembles it (each replica its own scratch directory; replica 0
    # writes there); only the training steps are timed.
    scratch = tempfile.TemporaryDirectory()
    trainer = Trainer.from_config(cfg, Path(scratch.name) / "run", replicas=replicas)
    session = trainer.session
    batches = micro_batches(trainer.loader, session.micro_batches_per_run())

    def batch() -> dict:
        return next(batches)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()
        replicas.barrier()

    for _ in range(args.warmup):
        session.run(batch())
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    sync()
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(args.steps):
        session.run(batch())
    sync()
    elapsed, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    if cuda:
        memory = torch.cuda.max_memory_allocated()
    else:
        with PeakMemory() as peak:
            session.run(batch())
        memory = peak.peak_bytes
    result = {"rank": rank, "seconds": elapsed, "cpu_seconds": cpu, "memory_bytes": memory,
              "optimizer_state_bytes": optimizer_state_bytes(session.optimizer),
              "parameters": sum(p.numel() for _, p in session.named_parameters)}
    gathered = replicas.all_gather_object(result)
    if rank == 0:
        Path(out).write_text(json.dumps(gathered))
    replicas.shutdown()  # barrier, then tear down


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def measure(args: argparse.Namespace, variant: str, processes: int, scratch: Path) -> dict:
    out = scratch / f"{variant}-{processes}.json"
    mp.spawn(worker, args=(processes, free_port(), args, variant, str(out)), nprocs=processes,
             join=True)
    ranks = json.loads(out.read_text())
    cfg = make_config(args, variant, processes)
    seconds = max(r["seconds"] for r in ranks)
    sequences = cfg.global_batch_size * cfg.execution.device_iterations * args.steps
    return {"variant": variant, "processes": processes, "seq_per_s": sequences / seconds,
            "step_ms": 1000 * seconds / args.steps, "global_batch": cfg.global_batch_size,
            "cpu_ms": 1000 * max(r["cpu_seconds"] for r in ranks) / args.steps,
            "memory_mb": max(r["memory_bytes"] for r in ranks) / 2**20,
            "optimizer_state_mb": max(r["optimizer_state_bytes"] for r in ranks) / 2**20,
            "parameters": ranks[0]["parameters"]}


def table(rows: list[dict], device: str) -> str:
    memory = "step peak tensors / replica" if device == "cpu" else "peak allocated / replica"
    lines = [f"| variant | processes | global batch | seq/s | scaling efficiency | step ms | "
             f"CPU ms / step / replica | {memory} | optimizer state / replica |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = {r["variant"]: r["seq_per_s"] for r in rows if r["processes"] == 1}
    for r in rows:
        eff = (f"{r['seq_per_s'] / (r['processes'] * base[r['variant']]):.0%}"
               if r["variant"] in base else "-")
        lines.append(f"| {r['variant']} | {r['processes']} | {r['global_batch']} | "
                     f"{r['seq_per_s']:.1f} | {eff} | {r['step_ms']:.1f} | {r['cpu_ms']:.1f} | "
                     f"{r['memory_mb']:.0f} MiB | {r['optimizer_state_mb']:.2f} MiB |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--config", default="tiny", help="preset or YAML file (default tiny)")
    parser.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE")
    parser.add_argument("--processes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--variants", nargs="+", default=["dp", "rts"])
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--accumulation", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per CPU process")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.device == "cuda" and max(args.processes) > torch.cuda.device_count():
        parser.error(f"{max(args.processes)} processes need as many GPUs; "
                     f"{torch.cuda.device_count()} visible")
    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))

    from popbert.data.pretraining import load_training_data

    load_training_data(make_config(args, args.variants[0], 1))  # fill the instance cache once
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"popbert-scaling-{os.getpid()}"
    scratch.mkdir(parents=True, exist_ok=True)
    rows = []
    for variant in args.variants:
        for processes in args.processes:
            row = measure(args, variant, processes, scratch)
            rows.append(row)
            print(f"{variant} x {processes}: {row['seq_per_s']:.1f} seq/s", file=sys.stderr,
                  flush=True)
    device = (torch.cuda.get_device_name(0) if args.device == "cuda"
              else f"CPU, {os.cpu_count()} cores, {args.threads} thread(s) per process")
    print(f"\n{args.config}, micro batch {args.micro_batch} x accumulation "
          f"{args.accumulation} per replica, {args.steps} timed steps; {device}; load average "
          f"{os.getloadavg()[0]:.1f} at the end\n")
    print(table(rows, args.device))
    if args.json is not None:
        args.json.write_text(json.dumps({"device": device, "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
