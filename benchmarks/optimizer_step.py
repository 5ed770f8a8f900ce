"""Time one optimizer step over BERT-Base-sized parameters and report memory per parameter.

Compares popbert's Lamb and AdamW (FP32 weights, and FP16/BF16 weights with FP32 moments and
stochastic rounding) against ``torch.optim.AdamW(foreach=True)`` (and ``fused=True`` where the
device supports it) in the same process. Bytes per parameter count weights plus optimizer state
as actually allocated: 4 + 8 for FP32 weights, 2 + 8 for half weights (no master copy).

    python benchmarks/optimizer_step.py            # BERT-Base, ~110M parameters
    python benchmarks/optimizer_step.py --small    # a quick run
    python benchmarks/optimizer_step.py --sr-ratio --threads 2   # half weights + SR vs FP32

``--sr-ratio`` times popbert's own steps round-robin (LAMB and AdamW, FP32 weights and half
weights with stochastic rounding) and reports each half-weight step against the FP32 step of
the same class: medians of wall and process CPU time, and the median of the per-round ratios
(robust to load that drifts during the run on a shared machine).

``--train-step`` puts the optimizer step in context: whole BERT-Base training steps (forward,
backward, LAMB step; batch 4, sequence 128, FP32 compute) of a popbert ``TrainingSession``
with FP32 weights and with BF16 weights + stochastic rounding, interleaved, same ratios.

    python benchmarks/optimizer_step.py --train-step --threads 1 --steps 3 --warmup 1
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from collections.abc import Callable

import torch

from popbert.optimizers import AdamW, Lamb, param_groups_by_name

Shapes = list[tuple[str, tuple[int, ...]]]


def bert_shapes(
    vocab: int = 30522,
    hidden: int = 768,
    layers: int = 12,
    intermediate: int = 3072,
    max_positions: int = 512,
    type_vocab: int = 2,
) -> Shapes:
    """Parameter names and shapes of BERT pre-training (MLM decoder tied to the embedding)."""
    shapes: Shapes = [
        ("Embedding/Embedding_Dict", (vocab, hidden)),
        ("Embedding/Positional_Dict", (max_positions, hidden)),
        ("Embedding/Segment_Dict", (type_vocab, hidden)),
        ("Embedding/Norm/Gamma", (hidden,)),
        ("Embedding/Norm/Beta", (hidden,)),
    ]
    for i in range(layers):
        p = f"Layer{i}"
        shapes += [
            (f"{p}/Attention/QKV/W", (hidden, 3 * hidden)),
            (f"{p}/Attention/QKV/B", (3 * hidden,)),
            (f"{p}/Attention/Out/W", (hidden, hidden)),
            (f"{p}/Attention/Out/B", (hidden,)),
            (f"{p}/Attention/Norm/Gamma", (hidden,)),
            (f"{p}/Attention/Norm/Beta", (hidden,)),
            (f"{p}/FF/1/W", (hidden, intermediate)),
            (f"{p}/FF/1/B", (intermediate,)),
            (f"{p}/FF/2/W", (intermediate, hidden)),
            (f"{p}/FF/2/B", (hidden,)),
            (f"{p}/FF/Norm/Gamma", (hidden,)),
            (f"{p}/FF/Norm/Beta", (hidden,)),
        ]
    shapes += [
        ("CLS/Pooler/W", (hidden, hidden)),
        ("CLS/Pooler/B", (hidden,)),
        ("CLS/NSP/W", (hidden, 2)),
        ("CLS/NSP/B", (2,)),
        ("CLS/MLM/Transform/W", (hidden, hidden)),
        ("CLS/MLM/Transform/B", (hidden,)),
        ("CLS/MLM/Norm/Gamma", (hidden,)),
        ("CLS/MLM/Norm/Beta", (hidden,)),
        ("CLS/MLM/Bias", (vocab,)),
    ]
    return shapes


def make_params(
    shapes: Shapes, dtype: torch.dtype, device: torch.device
) -> list[tuple[str, torch.nn.Parameter]]:
    """Random weights and gradients (gradients stay fixed across the timed steps)."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    named = []
    for name, shape in shapes:
        w = torch.randn(shape, generator=gen) * 0.02
        p = torch.nn.Parameter(w.to(device=device, dtype=dtype))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(device=device, dtype=dtype)
        named.append((name, p))
    return named


def bytes_per_param(
    named: list[tuple[str, torch.nn.Parameter]], opt: torch.optim.Optimizer
) -> float:
    """Weights plus every tensor in the optimizer state, per parameter."""
    numel = sum(p.numel() for _, p in named)
    total = sum(p.numel() * p.element_size() for _, p in named)
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                total += value.numel() * value.element_size()
    return total / numel


def _timer(device: torch.device) -> Callable[[torch.optim.Optimizer], tuple[float, float]]:
    """Step timer returning (wall ms, process CPU ms).

    CPU time is the robust figure on a shared machine: other processes taking cores inflate
    wall time but not it (it also counts every thread, so it is total work, not latency).
    """
    sync: Callable[[], None] = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed_step(opt: torch.optim.Optimizer) -> tuple[float, float]:
        sync()
        wall, cpu = time.perf_counter(), time.process_time()
        opt.step()
        sync()
        return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3

    return timed_step


def cases(device: torch.device) -> list[tuple[str, torch.dtype, Callable]]:
    wd, lr = 0.01, 1e-3

    def torch_adamw(fused: bool) -> Callable:
        def build(named):
            groups = [
                {"params": g["params"], "weight_decay": g["weight_decay"]}
                for g in param_groups_by_name(named, wd)
            ]
            if fused:
                return torch.optim.AdamW(groups, lr=lr, eps=1e-6, fused=True)
            return torch.optim.AdamW(groups, lr=lr, eps=1e-6, foreach=True)

        return build

    def ours(cls: type) -> Callable:
        return lambda named: cls(param_groups_by_name(named, wd), lr=lr, seed=0)

    result = [("torch AdamW foreach", torch.float32, torch_adamw(False))]
    try:  # fused AdamW exists for CUDA and, in recent torch, CPU
        probe = torch.nn.Parameter(torch.zeros(2, device=device))
        probe.grad = torch.zeros(2, device=device)
        torch.optim.AdamW([probe], lr=lr, fused=True).step()
        result.append(("torch AdamW fused", torch.float32, torch_adamw(True)))
    except (RuntimeError, ValueError):
        pass
    result += [
        ("popbert AdamW", torch.float32, ours(AdamW)),
        ("popbert Lamb", torch.float32, ours(Lamb)),
        ("popbert AdamW bf16+SR", torch.bfloat16, ours(AdamW)),
        ("popbert Lamb bf16+SR", torch.bfloat16, ours(Lamb)),
        ("popbert Lamb fp16+SR", torch.float16, ours(Lamb)),
    ]
    return result


def sr_ratio(shapes: Shapes, device: torch.device, steps: int, warmup: int) -> None:
    """Half weights + stochastic rounding vs FP32 weights, same optimizer, interleaved."""
    wd, lr = 0.01, 1e-3
    timed_step = _timer(device)
    runs = [
        ("Lamb", torch.float32),
        ("Lamb", torch.bfloat16),
        ("Lamb", torch.float16),
        ("AdamW", torch.float32),
        ("AdamW", torch.bfloat16),
    ]
    classes = {"Lamb": Lamb, "AdamW": AdamW}
    opts = []
    for cls, dtype in runs:
        named = make_params(shapes, dtype, device)
        opts.append(classes[cls](param_groups_by_name(named, wd), lr=lr, seed=0))
    for _ in range(warmup):  # the first half-weight step also compiles the rounding kernel
        for opt in opts:
            timed_step(opt)
    times: list[list[tuple[float, float]]] = [[] for _ in runs]
    load_before = os.getloadavg()[0]
    for _ in range(steps):
        for k, opt in enumerate(opts):
            times[k].append(timed_step(opt))
    load_after = os.getloadavg()[0]
    print(f"load average (1 min) {load_before:.1f} before, {load_after:.1f} after")
    header = (f"{'optimizer':<8} {'weights':<9} {'wall med':>9} {'cpu med':>9} "
              f"{'wall x':>7} {'cpu x':>7} {'round wall x':>13} {'round cpu x':>12}")
    print(header)
    print("-" * len(header))
    for k, (cls, dtype) in enumerate(runs):
        base = runs.index((cls, torch.float32))
        wall = statistics.median(t[0] for t in times[k])
        cpu = statistics.median(t[1] for t in times[k])
        base_wall = statistics.median(t[0] for t in times[base])
        base_cpu = statistics.median(t[1] for t in times[base])
        per_round = [(a[0] / b[0], a[1] / b[1]) for a, b in zip(times[k], times[base])]
        kind = str(dtype).replace("torch.", "") + ("+SR" if dtype != torch.float32 else "")
        print(f"{cls:<8} {kind:<9} {wall:>9.1f} {cpu:>9.1f} {wall / base_wall:>6.2f}x "
              f"{cpu / base_cpu:>6.2f}x {statistics.median(r[0] for r in per_round):>12.2f}x "
              f"{statistics.median(r[1] for r in per_round):>11.2f}x")
    print("ms per step, medians over the timed rounds; 'x': against the same class with FP32 "
          "weights; 'round': median of the per-round ratios")


def train_ratio(steps: int, warmup: int, batch_size: int = 4) -> None:
    """Whole training steps, FP32 weights vs BF16 weights + stochastic rounding (LAMB)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from bert_helpers import padded_batch

    from popbert.builders.bert import build_bert
    from popbert.builders.bert_config import BertConfig
    from popbert.runtime.options import SessionOptions
    from popbert.runtime.session import TrainingSession

    config = BertConfig()
    model = build_bert(config, seed=3).model()
    batch = padded_batch(config, batch_size, seed=5)

    def lamb(named: list[tuple[str, torch.nn.Parameter]]) -> Lamb:
        return Lamb(param_groups_by_name(named, 0.01), lr=1e-4, seed=0)

    runs = {}
    for weights in ("float32", "bfloat16"):
        torch.manual_seed(0)
        session = TrainingSession(model, "loss", lamb, SessionOptions(weight_dtype=weights))
        runs[weights] = session

    def timed(session: TrainingSession) -> tuple[float, float]:
        wall, cpu = time.perf_counter(), time.process_time()
        session.run(batch)
        return (time.perf_counter() - wall) * 1e3, (time.process_time() - cpu) * 1e3

    for _ in range(warmup):
        for session in runs.values():
            timed(session)
    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    load_before = os.getloadavg()[0]
    for _ in range(steps):
        for key, session in runs.items():
            times[key].append(timed(session))
    load_after = os.getloadavg()[0]
    print(f"BERT-Base training step (forward + backward + LAMB), batch {batch_size}, sequence "
          f"{config.sequence_length}; load average (1 min) {load_before:.1f} before, "
          f"{load_after:.1f} after")
    base = times["float32"]
    for key, rows in times.items():
        wall = statistics.median(t[0] for t in rows)
        cpu = statistics.median(t[1] for t in rows)
        per_round = statistics.median(a[0] / b[0] for a, b in zip(rows, base, strict=True))
        print(f"weights {key:<9} wall {wall:8.1f} ms  cpu {cpu:8.1f} ms  "
              f"wall x FP32 {wall / statistics.median(t[0] for t in base):.3f}  "
              f"(per round {per_round:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a 2-layer, 256-wide model")
    parser.add_argument("--steps", type=int, default=5, help="timed steps per optimizer")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    default_device = "cuda" if torch.cuda.is_available() else "cpu"
    parser.add_argument("--device", default=default_device)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    parser.add_argument("--sr-ratio", action="store_true",
                        help="only half weights + stochastic rounding vs FP32, same optimizer")
    parser.add_argument("--train-step", action="store_true",
                        help="whole BERT-Base training steps, BF16 + SR weights vs FP32 (CPU)")
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    if args.train_step:
        train_ratio(args.steps, args.warmup)
        return
    device = torch.device(args.device)
    if args.small:
        shapes = bert_shapes(vocab=8000, hidden=256, layers=2, intermediate=1024)
    else:
        shapes = bert_shapes()
    n_params = sum(torch.Size(s).numel() for _, s in shapes)
    print(
        f"device={device} torch={torch.__version__} threads={torch.get_num_threads()} "
        f"params={n_params / 1e6:.1f}M tensors={len(shapes)} steps={args.steps}"
    )
    if args.sr_ratio:
        sr_ratio(shapes, device, args.steps, args.warmup)
        return
    timed_step = _timer(device)
    all_cases = cases(device)
    base_name, base_dtype, base_build = all_cases[0]
    base_named = make_params(shapes, base_dtype, device)
    base_opt = base_build(base_named)
    base_times: list[tuple[float, float]] = []
    rows = []
    for name, dtype, build in all_cases[1:]:
        named = make_params(shapes, dtype, device)
        opt = build(named)
        for _ in range(args.warmup):
            timed_step(base_opt)
            timed_step(opt)
        # Interleave with the baseline so load from other processes hits both alike.
        pair_base, times = [], []
        for _ in range(args.steps):
            pair_base.append(timed_step(base_opt))
            times.append(timed_step(opt))
        base_times += pair_base
        rows.append((name, dtype, times, pair_base, bytes_per_param(named, opt)))
        del named, opt
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    base_bpp = bytes_per_param(base_named, base_opt)
    rows.insert(0, (base_name, base_dtype, base_times, base_times, base_bpp))

    header = (
        f"{'optimizer':<24} {'weights':<9} {'wall ms':>8} {'vs base':>8} "
        f"{'cpu ms':>8} {'vs base':>8} {'bytes/param':>11}"
    )
    print(header)
    print("-" * len(header))
    for name, dtype, times, base, bpp in rows:
        wall, cpu = min(t[0] for t in times), min(t[1] for t in times)
        base_wall, base_cpu = min(t[0] for t in base), min(t[1] for t in base)
        kind = str(dtype).replace("torch.", "")
        print(
            f"{name:<24} {kind:<9} {wall:>8.1f} {wall / base_wall:>7.2f}x "
            f"{cpu:>8.1f} {cpu / base_cpu:>7.2f}x {bpp:>11.2f}"
        )
    print(
        "min over the timed steps; 'vs base': against the torch AdamW foreach steps interleaved "
        "with that row"
    )


if __name__ == "__main__":
    main()
