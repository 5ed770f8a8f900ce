"""GroupBERT vs BERT: validation MLM loss against training FLOPs, each at its own best lr.

The claim of Chelombiev et al. 2021 (arXiv 2106.05822) tested at a scale a CPU can run: BERT and
GroupBERT at a few small sizes, each pair chosen to cost about the same FLOPs per sequence
(GroupBERT's layer, convolution + 2 grouped FFNs + attention, is ~1.6x a BERT layer at the same
width, so GroupBERT gets fewer layers), trained on the same real data (the bundled Wikipedia
slice, `data/resources/wiki_corpus.txt`) with a held-out validation split by document
(`data.validation_fraction`), the same batch, sequence length and token budget, the same
optimizer (AdamW, betas 0.9/0.999, weight decay 0.01, gradient clipping 1.0) and schedule shape
(linear warmup over 10% of the steps, linear decay to ~0), dropout 0 for both (GroupBERT's
pre-training setup). Each model first sweeps `--lrs` on a shortened budget (`--sweep-steps`) and
keeps the lr with the lowest validation MLM loss; then it trains the full budget with it,
evaluating every `--eval-every` steps.

Training FLOPs per step are counted from the training graph by `popbert.plan`'s counter (the
number `popbert plan` reports, times the global batch); the x axis is cumulative training FLOPs.

    python benchmarks/groupbert_vs_bert.py                      # CPU default (~45 min, 1 thread)
    python benchmarks/groupbert_vs_bert.py --sizes h128 --steps 100 --sweep-steps 25  # quick
    python benchmarks/groupbert_vs_bert.py --large --device cuda  # larger sizes, on a GPU

Writes the raw results (`--output`, JSON, rewritten after every run so a stopped run keeps what
it finished) and the plot (`--figure`), and prints a table.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import sys
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

import popbert
from popbert.atomic import atomic_write_text
from popbert.config import RunConfig, load_config
from popbert.data.pretraining import load_training_data, load_validation_data
from popbert.observe.tracking import read_metrics
from popbert.plan import build_training_graph, training_flops_per_sequence
from popbert.train.loop import TrainingDiverged

HERE = Path(__file__).resolve().parent


@dataclass(frozen=True)
class Size:
    """One size of both families: the shared width and each family's depth (picked so that the
    training FLOPs per sequence match within a few percent; the script prints the ratio)."""
    hidden: int
    heads: int
    intermediate: int
    bert_layers: int
    groupbert_layers: int


# CPU sizes (1 thread): H128 and H192 are ~0.35-1.2 s per step of 32 x 128 tokens.
SIZES = {
    "h128": Size(128, 2, 512, 3, 2),
    "h192": Size(192, 3, 768, 3, 2),
    "h256": Size(256, 4, 1024, 3, 2),
}
# --large: a GPU's sizes, up to BERT-mini-like widths and depths.
LARGE_SIZES = {
    "h256": Size(256, 4, 1024, 6, 4),
    "h384": Size(384, 6, 1536, 6, 4),
    "h512": Size(512, 8, 2048, 8, 5),
}
FAMILIES = ("bert", "groupbert")
COLOURS = {"bert": "tab:blue", "groupbert": "tab:red"}
MARKERS = ["o", "s", "^", "D"]
LINESTYLES = ["-", "--", ":", "-."]


def make_config(args: argparse.Namespace, family: str, size: Size, steps: int, lr: float,
                eval_every: int) -> RunConfig:
    layers = size.bert_layers if family == "bert" else size.groupbert_layers
    sets = {
        "model.architecture": family,
        "model.hidden_size": size.hidden, "model.num_heads": size.heads,
        "model.intermediate_size": size.intermediate, "model.num_layers": layers,
        "model.sequence_length": args.seq_len, "model.max_position_embeddings": args.seq_len,
        "model.hidden_dropout": 0.0, "model.attention_dropout": 0.0,
        "data.validation_fraction": args.validation_fraction,
        "data.duplication_factor": args.duplication_factor,
        "optimizer.name": "adamw", "optimizer.lr": lr, "optimizer.weight_decay": 0.01,
        "optimizer.max_grad_norm": 1.0, "optimizer.decay": "linear",
        "optimizer.warmup_steps": max(1, round(0.1 * steps)),
        "execution.device": args.device, "execution.micro_batch_size": args.batch,
        "training.steps": steps, "training.eval_every": eval_every,
        "training.eval_batches": args.eval_batches, "training.log_every": max(1, steps // 10),
        "training.seed": args.seed,
    }
    if args.device == "cpu":
        sets["execution.threads"] = args.threads
    return load_config("tiny", [f"{k}={json.dumps(v)}" for k, v in sets.items()])


def flops_per_step(cfg: RunConfig) -> int:
    """Training FLOPs of one optimizer step, counted from the graph as `popbert plan` does."""
    return training_flops_per_sequence(build_training_graph(cfg)) * cfg.global_batch_size


def train_once(cfg: RunConfig, desc: str) -> dict[str, Any]:
    """One real training run through the Trainer (in a scratch directory); validation MLM
    loss/accuracy at step 0 and every eval_every."""
    tqdm.write(desc)
    with tempfile.TemporaryDirectory() as scratch, \
            popbert.Trainer.from_config(cfg, Path(scratch) / "run") as trainer:
        params = sum(w.numel() for w in trainer.session.weights().values())
        evals = [{"step": 0, **trainer.evaluate()}]
        result = trainer.train()
        records = read_metrics(result.output_dir / "metrics.jsonl")
    per_step = flops_per_step(cfg)
    evals += [{k: r[k] for k in ("step", "val_mlm_loss", "val_mlm_accuracy") if k in r}
              for r in records if "val_mlm_loss" in r]
    for e in evals:
        e["train_flops"] = e["step"] * per_step
    train_losses = [r["mlm_loss"] for r in records if "mlm_loss" in r]
    return {"steps": result.steps, "params": params, "flops_per_step": per_step,
            "seconds": result.seconds, "evals": evals,
            "final_val_mlm_loss": evals[-1]["val_mlm_loss"],
            "final_val_mlm_accuracy": evals[-1].get("val_mlm_accuracy"),
            "last_train_mlm_loss": train_losses[-1] if train_losses else None}


def loss_at(evals: list[dict], flops: float) -> float:
    """Validation loss at `flops` training FLOPs, linear in log FLOPs between evaluations."""
    points = [(e["train_flops"], e["val_mlm_loss"]) for e in evals if e["train_flops"] > 0]
    if flops <= points[0][0]:
        return points[0][1]
    for (f0, l0), (f1, l1) in zip(points, points[1:]):
        if f0 <= flops <= f1:
            t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
            return l0 + t * (l1 - l0)
    return points[-1][1]


def compare(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Per size: both families' validation loss at the smaller of their two final FLOP counts
    (equal FLOPs), and GroupBERT minus BERT (negative: GroupBERT lower)."""
    out = []
    for size in results["sizes"]:
        runs = {f: results["runs"].get(f"{f}-{size}") for f in FAMILIES}
        if not all(r and "full" in r for r in runs.values()):
            continue
        flops = min(r["full"]["evals"][-1]["train_flops"] for r in runs.values())
        at = {f: loss_at(r["full"]["evals"], flops) for f, r in runs.items()}
        out.append({"size": size, "flops": flops, "bert": at["bert"],
                    "groupbert": at["groupbert"], "delta": at["groupbert"] - at["bert"],
                    "relative": (at["groupbert"] - at["bert"]) / at["bert"]})
    return out


def plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 5))
    for i, size in enumerate(results["sizes"]):
        for family in FAMILIES:
            run = results["runs"].get(f"{family}-{size}")
            if not run or "full" not in run:
                continue
            evals = [e for e in run["full"]["evals"] if e["train_flops"] > 0]
            ax.plot([e["train_flops"] for e in evals], [e["val_mlm_loss"] for e in evals],
                    color=COLOURS[family], marker=MARKERS[i % len(MARKERS)],
                    linestyle=LINESTYLES[i % len(LINESTYLES)], markersize=4,
                    label=f"{family} {size} L{run['layers']} (lr {run['lr']:g}, "
                          f"{run['full']['flops_per_step'] / results['batch'] / 1e9:.2f} "
                          f"GFLOP/seq)")
    ax.set_xscale("log")
    ax.set_xlabel("training FLOPs (counted from the graph)")
    ax.set_ylabel("validation MLM loss")
    tokens = results["steps"] * results["batch"] * results["seq_len"]
    ax.set_title(f"GroupBERT vs BERT, bundled Wikipedia slice, {tokens / 1e6:.2f}M tokens each")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=120)
    tmp.replace(path)
    plt.close(fig)


def table(results: dict[str, Any]) -> str:
    rows = ["| model | layers | params | GFLOP/seq | lrs swept: val loss | lr | "
            "final val MLM loss | val MLM acc | training TFLOP | train s |",
            "| --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: |"]
    for key, run in results["runs"].items():
        if "full" not in run:
            continue
        full = run["full"]
        sweep = ", ".join(f"{s['lr']:g}: {s['final_val_mlm_loss']:.3f}" for s in run["sweep"])
        rows.append(
            f"| {key} | {run['layers']} | {full['params'] / 1e6:.2f}M | "
            f"{full['flops_per_step'] / results['batch'] / 1e9:.3f} | {sweep} | "
            f"{run['lr']:g}{' (edge)' if run['lr_at_edge'] else ''} | "
            f"{full['final_val_mlm_loss']:.3f} | {full['final_val_mlm_accuracy']:.3f} | "
            f"{full['evals'][-1]['train_flops'] / 1e12:.2f} | {full['seconds']:.0f} |")
    rows += ["", "| size | FLOPs compared | BERT val loss | GroupBERT val loss | "
             "GroupBERT - BERT |", "| --- | ---: | ---: | ---: | ---: |"]
    for c in compare(results):
        rows.append(f"| {c['size']} | {c['flops']:.3g} | {c['bert']:.3f} | "
                    f"{c['groupbert']:.3f} | {c['delta']:+.3f} ({100 * c['relative']:+.1f}%) |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", nargs="+", default=None,
                        help=f"sizes to run (default: h128 h192; --large: {list(LARGE_SIZES)})")
    parser.add_argument("--large", action="store_true",
                        help="the GPU preset: larger sizes (use with --device cuda)")
    parser.add_argument("--steps", type=int, default=400,
                        help="full-budget optimizer steps (tokens = steps x batch x seq-len)")
    parser.add_argument("--sweep-steps", type=int, default=None,
                        help="steps of each lr-sweep run (default: steps / 4)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[1e-3, 2.5e-3, 6e-3])
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--eval-every", type=int, default=None,
                        help="evaluate every this many steps (default: steps / 10)")
    parser.add_argument("--eval-batches", type=int, default=8,
                        help="validation micro-batches per evaluation (the same ones each time)")
    parser.add_argument("--validation-fraction", type=float, default=0.1,
                        help="fraction of the corpus's documents held out")
    parser.add_argument("--duplication-factor", type=int, default=3,
                        help="maskings of the corpus (fresh masks in later epochs)")
    parser.add_argument("--families", nargs="+", choices=FAMILIES, default=list(FAMILIES),
                        help="train only these (e.g. to extend one family's lr grid)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=42)
    parser.add_argument("--output", type=Path, default=HERE / "groupbert_vs_bert.json")
    parser.add_argument("--figure", type=Path, default=HERE / "figures" / "groupbert_vs_bert.png")
    args = parser.parse_args()
    table_sizes = LARGE_SIZES if args.large else SIZES
    sizes = args.sizes or (list(LARGE_SIZES) if args.large else ["h128", "h192"])
    unknown = [s for s in sizes if s not in table_sizes]
    if unknown:
        parser.error(f"--sizes: unknown {unknown}; expected some of {sorted(table_sizes)}")
    sweep_steps = args.sweep_steps or max(1, args.steps // 4)
    eval_every = args.eval_every or max(1, args.steps // 10)
    if args.device == "cpu":
        torch.set_num_threads(args.threads)

    results: dict[str, Any] = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python", *sys.argv]),
        "machine": {"platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "device": args.device,
                    "threads": args.threads if args.device == "cpu" else None,
                    "cuda": torch.cuda.get_device_name() if args.device == "cuda" else None},
        "sizes": sizes, "steps": args.steps, "sweep_steps": sweep_steps, "lrs": args.lrs,
        "batch": args.batch, "seq_len": args.seq_len, "eval_every": eval_every,
        "eval_batches": args.eval_batches, "validation_fraction": args.validation_fraction,
        "duplication_factor": args.duplication_factor,
        "optimizer": "AdamW (betas 0.9/0.999, eps 1e-6, weight decay 0.01, clip 1.0), "
                     "warmup 10% linear, linear decay", "dropout": 0.0,
        "size_table": {s: vars(table_sizes[s]) for s in sizes}, "runs": {}}

    # Every run reads the same instances and held-out documents: only the model's shapes differ
    # between runs, and the data depends on none of them.
    first = make_config(args, "bert", table_sizes[sizes[0]], args.steps, args.lrs[0], eval_every)
    print(f"data: {len(load_training_data(first)['input_ids'])} training / "
          f"{len(load_validation_data(first)['input_ids'])} held-out sequences of "
          f"{args.seq_len}; {args.eval_batches} x {args.batch} evaluated")

    for size_name in sizes:
        size = table_sizes[size_name]
        per_seq = {f: flops_per_step(make_config(args, f, size, 1, 1e-3, 1)) / args.batch
                   for f in FAMILIES}  # both, even with --families: the pairing is the point
        print(f"{size_name}: GFLOP/seq BERT L{size.bert_layers} {per_seq['bert'] / 1e9:.3f}, "
              f"GroupBERT L{size.groupbert_layers} {per_seq['groupbert'] / 1e9:.3f} "
              f"(ratio {per_seq['groupbert'] / per_seq['bert']:.3f})")

    runs = [(f, s) for s in sizes for f in FAMILIES if f in args.families]
    with tqdm(total=len(runs) * (len(args.lrs) * sweep_steps + args.steps), desc="all runs",
              unit="step", position=1, dynamic_ncols=True) as overall:
        for family, size_name in runs:
            size = table_sizes[size_name]
            key = f"{family}-{size_name}"
            run: dict[str, Any] = {
                "family": family, "size": size_name,
                "layers": size.bert_layers if family == "bert" else size.groupbert_layers,
                "sweep": []}
            results["runs"][key] = run
            for lr in args.lrs:
                cfg = make_config(args, family, size, sweep_steps, lr, sweep_steps)
                try:
                    out = train_once(cfg, f"{key} lr {lr:g} sweep")
                except TrainingDiverged as e:  # too high an lr: out of the running
                    tqdm.write(f"{key} lr {lr:g}: diverged ({e})")
                    out = {"final_val_mlm_loss": math.inf, "seconds": math.nan}
                run["sweep"].append({"lr": lr, "final_val_mlm_loss": out["final_val_mlm_loss"],
                                     "seconds": out["seconds"]})
                overall.update(sweep_steps)
                atomic_write_text(args.output, json.dumps(results, indent=1) + "\n")
            finite = [s for s in run["sweep"] if math.isfinite(s["final_val_mlm_loss"])]
            best = min(finite, key=lambda s: s["final_val_mlm_loss"])
            run["lr"] = best["lr"]
            run["lr_at_edge"] = best["lr"] in (min(args.lrs), max(args.lrs))
            cfg = make_config(args, family, size, args.steps, run["lr"], eval_every)
            run["full"] = train_once(cfg, f"{key} lr {run['lr']:g}")
            overall.update(args.steps)
            tqdm.write(f"{key}: lr {run['lr']:g}, final val MLM loss "
                       f"{run['full']['final_val_mlm_loss']:.4f} in "
                       f"{run['full']['seconds']:.0f} s")
            results["comparison"] = compare(results)
            atomic_write_text(args.output, json.dumps(results, indent=1) + "\n")
            plot(results, args.figure)

    print(table(results))
    print(f"wrote {args.output} and {args.figure}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
