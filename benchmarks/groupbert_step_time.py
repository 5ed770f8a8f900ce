"""GroupBERT's training step time against a BERT of about equal FLOPs per step, side by side.

Each pair is `groupbert_vs_bert.py`'s: the same width, BERT with more layers so that both cost
about the same training FLOPs per sequence (counted from the graph as `popbert plan` does). Both
train through `TrainingSession` on the same batches of the bundled corpus (same batch, sequence
length, AdamW, FP32, threads, dropout 0), in one process, steps interleaved (BERT, GroupBERT,
BERT, ...) so that load from elsewhere on the machine hits both alike; the median of `--steps`
timed steps after `--warmup` untimed ones. Reported: each step time, the time ratio GroupBERT /
BERT, and the FLOP-normalised throughput ratio (GroupBERT's achieved FLOP/s over BERT's).

Why GroupBERT costs more per FLOP: its grouped ops (the FFN's block-diagonal I→H matmul, the
grouped convolution over the sequence) do little arithmetic per byte moved. `--breakdown`
profiles a few steps of each model and splits the step time by op kind; the op table times each
kind alone (forward + backward, the lowering's layouts) and gives its achieved GFLOP/s next to a
dense matmul's: what low arithmetic intensity costs on this machine.

    python benchmarks/groupbert_step_time.py                    # CPU, 1 thread, h128 and h256
    python benchmarks/groupbert_step_time.py --device cuda --large
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from groupbert_vs_bert import FAMILIES, LARGE_SIZES, SIZES, Size  # noqa: E402
from step_time import timed  # noqa: E402  (the one timing routine of the benchmarks)

import popbert  # noqa: E402
from popbert.atomic import atomic_write_text  # noqa: E402
from popbert.config import RunConfig, load_config  # noqa: E402
from popbert.plan import build_training_graph, training_flops_per_sequence  # noqa: E402
from popbert.train.trainer import micro_batches  # noqa: E402


def make_config(family: str, size: Size, args: argparse.Namespace) -> RunConfig:
    sets = {
        "model.architecture": family, "model.hidden_size": size.hidden,
        "model.num_heads": size.heads, "model.intermediate_size": size.intermediate,
        "model.num_layers": size.bert_layers if family == "bert" else size.groupbert_layers,
        "model.sequence_length": args.seq_len, "model.max_position_embeddings": args.seq_len,
        "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
        "optimizer.name": "adamw", "execution.device": args.device,
        "execution.micro_batch_size": args.batch, "training.seed": 0,
    }
    if args.device == "cpu":
        sets["execution.threads"] = args.threads
    return load_config("tiny", [f"{k}={json.dumps(v)}" for k, v in sets.items()])


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


class Model:
    """One family's session and its batches: `step()` is one training step."""

    def __init__(self, family: str, size: Size, args: argparse.Namespace) -> None:
        cfg = make_config(family, size, args)
        self.family = family
        self.layers = cfg.model.num_layers
        self.flops_per_seq = training_flops_per_sequence(build_training_graph(cfg))
        # The run as the Trainer assembles it (in a scratch directory); only its steps are timed.
        self.scratch = tempfile.TemporaryDirectory()
        cfg = dataclasses.replace(cfg, training=dataclasses.replace(cfg.training, seed=0))
        self.trainer = popbert.Trainer.from_config(cfg, Path(self.scratch.name) / "run")
        self.session = self.trainer.session
        self.batches = micro_batches(self.trainer.loader, self.session.micro_batches_per_run())
        self.times: list[float] = []

    def step(self) -> None:
        self.session.run(next(self.batches))


def breakdown(model: Model, device: str, steps: int) -> dict[str, float]:
    """Share of a training step's profiled time by op kind (self time of the aten ops)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            model.step()
        sync(device)
    kinds = {"dense matmul (mm/addmm)": ("aten::mm", "aten::addmm"),
             "grouped FFN matmul (bmm)": ("aten::bmm",),
             "grouped conv": ("aten::convolution_backward", "aten::_convolution",
                              "aten::mkldnn_convolution", "aten::convolution",
                              "aten::cudnn_convolution", "aten::_slow_conv2d_forward",
                              "aten::thnn_conv2d"),
             "attention (SDPA)": ("aten::_scaled_dot_product_flash_attention_for_cpu",
                                  "aten::_scaled_dot_product_flash_attention_for_cpu_backward",
                                  "aten::_scaled_dot_product_flash_attention",
                                  "aten::_scaled_dot_product_efficient_attention",
                                  "aten::_efficient_attention_backward",
                                  "aten::_flash_attention_backward")}
    attr = "self_device_time_total" if device == "cuda" else "self_cpu_time_total"
    totals = {k: 0.0 for k in [*kinds, "copies (copy_/contiguous)", "everything else"]}
    for event in prof.key_averages():
        t = float(getattr(event, attr, 0.0) or 0.0)
        kind = next((k for k, names in kinds.items() if event.key in names), None)
        if kind is None:
            kind = ("copies (copy_/contiguous)" if event.key in ("aten::copy_", "aten::clone")
                    else "everything else")
        totals[kind] += t
    total = sum(totals.values()) or 1.0
    return {k: v / total for k, v in totals.items()}


def op_table(size: Size, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Each kind of matmul/conv of a GroupBERT layer alone, forward + backward, median time and
    achieved GFLOP/s (FLOPs: 3 x the forward's 2·M·N·K, as the graph counter counts)."""
    device, tokens = args.device, args.batch * args.seq_len
    h, inner, groups = size.hidden, size.intermediate, 4
    conv_group, kernel = 16, 7
    gen = torch.Generator().manual_seed(0)

    def leaf(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device).requires_grad_(True)

    x_in, x_h = leaf(tokens, inner), leaf(tokens, h)
    w_up, w_hh = leaf(h, inner), leaf(h, h)
    w_grouped = leaf(groups, inner // groups, h // groups)
    w_conv = leaf(h, conv_group, kernel)
    x_conv = leaf(args.batch, h, args.seq_len)

    def group_major() -> torch.Tensor:
        g = x_in.reshape(tokens, groups, inner // groups).transpose(0, 1)
        return torch.matmul(g, w_grouped).transpose(0, 1).reshape(tokens, h)

    def broadcast() -> torch.Tensor:
        g = x_in.reshape(args.batch, args.seq_len, groups, 1, inner // groups)
        return torch.matmul(g, w_grouped).reshape(tokens, h)

    def conv() -> torch.Tensor:
        return F.conv1d(x_conv, w_conv, groups=h // conv_group, padding=kernel // 2)

    ops = [
        ("dense H→I matmul (FFN up, both families)", lambda: x_h @ w_up,
         2 * tokens * h * inner),
        ("dense H→H matmul (GroupBERT's mixing/output)", lambda: x_h @ w_hh,
         2 * tokens * h * h),
        (f"grouped I→H matmul, {groups} groups, group-major (the lowering)", group_major,
         2 * tokens * inner * h // groups),
        (f"grouped I→H matmul, {groups} groups, broadcast [B,S,G,1,k] (before the fix)",
         broadcast, 2 * tokens * inner * h // groups),
        (f"grouped conv1d, {conv_group} ch/group, kernel {kernel}", conv,
         2 * tokens * h * conv_group * kernel),
    ]
    rows = []
    for name, fn, fwd_flops in ops:
        def run(fn: Callable[[], torch.Tensor] = fn) -> None:
            out = fn()
            out.backward(torch.ones_like(out))
        for _ in range(2):
            run()
        times = [timed(run, device) for _ in range(args.op_reps)]
        med = statistics.median(times)
        rows.append({"op": name, "ms": 1000 * med, "gflop": 3 * fwd_flops / 1e9,
                     "gflop_per_s": 3 * fwd_flops / med / 1e9})
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=None,
                        help=f"pairs (default h128 h256; --large: {list(LARGE_SIZES)})")
    parser.add_argument("--large", action="store_true", help="the GPU sizes")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=10, help="timed steps per model (median)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--breakdown", action=argparse.BooleanOptionalAction, default=True,
                        help="profile each model's step by op kind, and time the op kinds alone")
    parser.add_argument("--op-reps", type=int, default=10)
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()
    table = LARGE_SIZES if args.large else SIZES
    sizes = args.sizes or (list(LARGE_SIZES) if args.large else ["h128", "h256"])
    unknown = [s for s in sizes if s not in table]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; expected some of {sorted(table)}")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    print(f"device {args.device}"
          f"{f', {args.threads} thread(s)' if args.device == 'cpu' else ''}, batch {args.batch} "
          f"x seq {args.seq_len}, AdamW, FP32, dropout 0; median of {args.steps} interleaved "
          f"steps after {args.warmup}")

    results: dict[str, Any] = {"device": args.device, "threads": args.threads,
                               "batch": args.batch, "seq_len": args.seq_len, "pairs": []}
    rows = ["| size | BERT L | GroupBERT L | GFLOP/seq BERT / GroupBERT | BERT ms | "
            "GroupBERT ms | time ratio | FLOP-normalised throughput ratio |",
            "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for size_name in sizes:
        size = table[size_name]
        models = [Model(f, size, args) for f in FAMILIES]
        for _ in range(args.warmup):
            for m in models:
                timed(m.step, args.device)
        for _ in range(args.steps):
            for m in models:  # interleaved: contention hits both alike
                m.times.append(timed(m.step, args.device))
        bert, group = models
        t_b, t_g = statistics.median(bert.times), statistics.median(group.times)
        time_ratio = t_g / t_b
        throughput_ratio = (group.flops_per_seq / t_g) / (bert.flops_per_seq / t_b)
        pair: dict[str, Any] = {
            "size": size_name, "bert_layers": bert.layers, "groupbert_layers": group.layers,
            "bert_gflop_per_seq": bert.flops_per_seq / 1e9,
            "groupbert_gflop_per_seq": group.flops_per_seq / 1e9,
            "bert_ms": 1000 * t_b, "groupbert_ms": 1000 * t_g, "time_ratio": time_ratio,
            "flop_throughput_ratio": throughput_ratio,
            "bert_achieved_gflop_per_s": bert.flops_per_seq * args.batch / t_b / 1e9,
            "groupbert_achieved_gflop_per_s": group.flops_per_seq * args.batch / t_g / 1e9}
        rows.append(f"| {size_name} | {bert.layers} | {group.layers} | "
                    f"{bert.flops_per_seq / 1e9:.3f} / {group.flops_per_seq / 1e9:.3f} | "
                    f"{1000 * t_b:.1f} | {1000 * t_g:.1f} | {time_ratio:.2f} | "
                    f"{throughput_ratio:.2f} |")
        print(rows[-1], flush=True)
        if args.breakdown:
            pair["breakdown"] = {m.family: breakdown(m, args.device, 3) for m in models}
            pair["ops"] = op_table(size, args)
        results["pairs"].append(pair)
        del models

    print("\n".join(rows))
    for pair in results["pairs"]:
        if "breakdown" not in pair:
            continue
        print(f"\n{pair['size']}: share of the profiled step time by op kind")
        print("| op kind | BERT | GroupBERT |\n| --- | ---: | ---: |")
        for kind in pair["breakdown"]["bert"]:
            print(f"| {kind} | {100 * pair['breakdown']['bert'][kind]:.1f}% | "
                  f"{100 * pair['breakdown']['groupbert'][kind]:.1f}% |")
        print(f"\n{pair['size']}: each op kind alone, forward + backward, batch x seq tokens")
        print("| op | ms | GFLOP | GFLOP/s |\n| --- | ---: | ---: | ---: |")
        for op in pair["ops"]:
            print(f"| {op['op']} | {op['ms']:.2f} | {op['gflop']:.3f} | "
                  f"{op['gflop_per_s']:.1f} |")
    if args.json:
        atomic_write_text(args.json, json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
