"""Training curves from `metrics.jsonl`: losses, accuracies, learning rate, throughput.

Uses matplotlib's object API with the Agg canvas (no pyplot state, no display needed), so it works
on headless machines and from training processes.
"""

from __future__ import annotations

import io
import math
import os
from pathlib import Path
from typing import Any

from popbert.atomic import atomic_write_bytes
from popbert.errors import UsageError
from popbert.observe.tracking import read_metrics


def metric_series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of the records that logged `key` as a number (NaN and non-numbers left
    out, so a curve has only points that can be drawn)."""
    steps, values = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool) and not math.isnan(v):
            steps.append(int(r["step"]))
            values.append(float(v))
    return steps, values


def one_record_per_step(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One record per step, the last logged (a resumed run re-logs steps after its checkpoint)."""
    latest: dict[int, dict[str, Any]] = {}
    for r in records:
        step = r.get("step")
        if isinstance(step, int | float) and not isinstance(step, bool):
            latest[int(step)] = r
    return [latest[s] for s in sorted(latest)]


def plot_metrics(metrics_jsonl: str | os.PathLike[str],
                 output_png: str | os.PathLike[str]) -> Path:
    """Render a 2x2 PNG (losses, accuracies, lr and loss scale, throughput); written atomically.

    Raises UsageError when the file is missing or holds no steps.
    """
    metrics_jsonl = Path(metrics_jsonl)
    if not metrics_jsonl.is_file():
        raise UsageError(f"metrics file not found: {metrics_jsonl}")
    records = one_record_per_step(read_metrics(metrics_jsonl))
    if not records:
        raise UsageError(f"{metrics_jsonl}: no logged steps to plot")
    fig = draw_metrics(records, f"Pre-training metrics: {metrics_jsonl.resolve().parent.name}")
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write_bytes(output_png, buf.getvalue())


def draw_metrics(records: list[dict[str, Any]], title: str) -> Any:
    """The 2x2 matplotlib Figure of `plot_metrics` for metrics records (one per step): training
    curves, with the validation ones (`val_*`, dashed, only at evaluated steps) beside them."""
    # Imported here: matplotlib costs ~0.5 s and is only needed once a plot is really drawn.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 8), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2)
    fig.suptitle(title)

    def line(ax: Any, key: str, label: str, **kw: Any) -> bool:
        steps, values = metric_series(records, key)
        if steps:
            kw.setdefault("marker", "." if len(steps) < 30 else None)
            ax.plot(steps, values, label=label, **kw)
        return bool(steps)

    ax = axes[0, 0]
    drawn = [line(ax, "loss", "total", color="black"),
             line(ax, "mlm_loss", "masked LM", color="tab:blue"),
             line(ax, "nsp_loss", "next sentence", color="tab:orange"),
             line(ax, "val_loss", "validation total", color="black", linestyle="--",
                  marker="o"),
             line(ax, "val_mlm_loss", "validation masked LM", color="tab:blue",
                  linestyle="--", marker="o")]
    ax.set_title("Loss")
    ax.set_ylabel("loss")
    if any(drawn):
        ax.legend()

    ax = axes[0, 1]
    drawn = [line(ax, "mlm_accuracy", "masked LM", color="tab:blue"),
             line(ax, "nsp_accuracy", "next sentence", color="tab:orange"),
             line(ax, "val_mlm_accuracy", "validation masked LM", color="tab:blue",
                  linestyle="--", marker="o"),
             line(ax, "val_nsp_accuracy", "validation next sentence", color="tab:orange",
                  linestyle="--", marker="o")]
    ax.set_title("Accuracy")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0.0, 1.0)
    if any(drawn):
        ax.legend(loc="lower right")

    ax = axes[1, 0]
    has_lr = line(ax, "lr", "learning rate", color="tab:purple")
    ax.set_title("Learning rate" + (" and loss scale" if metric_series(records, "loss_scale")[0]
                                    else ""))
    ax.set_ylabel("learning rate")
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    handles, labels = ax.get_legend_handles_labels() if has_lr else ([], [])
    if metric_series(records, "loss_scale")[0]:
        ax2 = ax.twinx()
        line(ax2, "loss_scale", "loss scale", color="tab:red", linestyle="--")
        ax2.set_yscale("log", base=2)
        ax2.set_ylabel("loss scale")
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    if handles:
        ax.legend(handles, labels, loc="upper right")

    ax = axes[1, 1]
    line(ax, "seq_per_s", "sequences/s", color="tab:green")
    ax.set_title("Throughput")
    ax.set_ylabel("sequences / s")

    for ax in axes.flat:
        ax.set_xlabel("step")
        ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


__all__ = ["draw_metrics", "metric_series", "one_record_per_step", "plot_metrics"]
