"""Several runs' curves in one PNG, each run named by what sets its config apart.

For people without W&B (and for sweep trials): `popbert plot RUN_DIR RUN_DIR ...` reads each run
directory's `metrics.jsonl` and `config.yaml` and overlays the runs, one subplot per metric. The
legend shows only the config keys whose values differ between the runs (``optimizer.lr=0.001,
model.architecture=groupbert``), which is what one wants to see when comparing a sweep's trials;
`tracking.*` keys (run names, W&B groups) say nothing about training and are left out.
"""

from __future__ import annotations

import io
import logging
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from popbert.atomic import atomic_write_bytes
from popbert.errors import UsageError
from popbert.observe.plots import metric_series, one_record_per_step
from popbert.observe.tracking import METRICS_FILE, read_metrics
from popbert.textfile import read_text

logger = logging.getLogger(__name__)

CONFIG_FILE = "config.yaml"
# Config sections that never change what a run computes; left out of the legend.
IGNORED_SECTIONS = ("tracking",)
UNSET = "(unset)"


@dataclass
class RunCurves:
    """One run directory's metrics (one record per step) and its saved config (nested dicts;
    empty when the run has no config.yaml)."""

    run_dir: Path
    records: list[dict[str, Any]]
    config: dict[str, Any] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.run_dir.name

    def metric_keys(self) -> list[str]:
        """The numeric metrics this run logged, in first-logged order (without `step`)."""
        keys: dict[str, None] = {}
        for record in self.records:
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float) \
                        and not isinstance(value, bool):
                    keys.setdefault(key)
        return list(keys)


def load_run(path: str | os.PathLike[str]) -> RunCurves:
    """A run directory (or its metrics.jsonl) as curves and config; UsageError naming the path
    when it is not a run directory or has no logged step."""
    from popbert.config.yaml_io import parse_yaml

    path = Path(path)
    run_dir = path.parent if path.is_file() and path.suffix == ".jsonl" else path
    if not run_dir.is_dir():
        raise UsageError(f"RUN_DIR {path}: not a run directory "
                         f"({'a file' if path.exists() else 'does not exist'})")
    metrics = path if path.is_file() else run_dir / METRICS_FILE
    if not metrics.is_file():
        raise UsageError(f"RUN_DIR {path}: no {METRICS_FILE} (not a popbert run directory, or "
                         f"a run that logged nothing yet)")
    records = one_record_per_step(read_metrics(metrics))
    if not records:
        raise UsageError(f"{metrics}: no logged steps to plot")
    config: dict[str, Any] = {}
    config_path = run_dir / CONFIG_FILE
    if config_path.is_file():
        loaded = parse_yaml(read_text(config_path, "a run's config.yaml"), str(config_path))
        config = loaded if isinstance(loaded, dict) else {}
    else:
        logger.warning("%s has no %s: labelled by its directory name only", run_dir,
                       CONFIG_FILE)
    return RunCurves(run_dir, records, config)


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested config sections as dotted keys (`optimizer.lr`), the form `--set` takes."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, dotted + "."))
        else:
            flat[dotted] = value
    return flat


def config_differences(configs: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Per config, the dotted keys (config order) whose values are not the same in all of them,
    each with its value as the legend writes it (YAML-like; "(unset)" for a key that config
    lacks). `tracking.*` is ignored."""
    flats = [{k: _format_value(v) for k, v in flatten_config(c).items()
              if k.split(".", 1)[0] not in IGNORED_SECTIONS} for c in configs]
    keys: dict[str, None] = {}
    for flat in flats:
        keys.update(dict.fromkeys(flat))
    differing = [k for k in keys if len({f.get(k, UNSET) for f in flats}) > 1]
    return [{k: flat.get(k, UNSET) for k in differing} for flat in flats]


def _format_value(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, list | tuple):
        return "[" + ",".join(_format_value(v) for v in value) + "]"
    return str(value)


def run_labels(runs: Sequence[RunCurves]) -> list[str]:
    """Legend labels: `key=value, ...` of what differs between the configs of the runs that
    have one; the directory name where that says nothing or would name two runs alike."""
    with_config = [i for i, run in enumerate(runs) if run.config]
    labels = [run.name for run in runs]
    if len(with_config) > 1:
        diffs = config_differences([runs[i].config for i in with_config])
        for i, diff in zip(with_config, diffs, strict=True):
            if diff:
                labels[i] = ", ".join(f"{k}={v}" for k, v in diff.items())
    if len(set(labels)) < len(labels):  # equal configs: tell the runs apart by directory
        labels = [label if label == run.name else f"{run.name}: {label}"
                  for label, run in zip(labels, runs, strict=True)]
    return labels


def default_metrics(runs: Sequence[RunCurves]) -> list[str]:
    """The training loss, then every validation metric any run logged (`val_*`)."""
    logged: dict[str, None] = {}
    for run in runs:
        logged.update(dict.fromkeys(run.metric_keys()))
    chosen = ["loss"] if "loss" in logged else []
    chosen += [k for k in logged if k.startswith("val_")]
    # A run without a loss: whatever else it logged, bookkeeping (lr, throughput) last.
    return chosen or sorted(logged, key=lambda k: k in ("lr", "seq_per_s", "loss_scale"))


def draw_comparison(runs: Sequence[RunCurves], labels: Sequence[str],
                    metrics: Sequence[str]) -> Any:
    """The matplotlib Figure: one subplot per metric, one colour per run across subplots, and
    one legend below them (a run missing a metric just has no curve there)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    cols = 1 if len(metrics) == 1 else 2
    rows = math.ceil(len(metrics) / cols)
    legend_rows = math.ceil(len(runs) / (2 if len(runs) > 6 else 1))
    legend_in = 0.25 * legend_rows + 0.4
    fig = Figure(figsize=(6.5 * cols, 3.8 * rows + legend_in), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, cols, squeeze=False)
    colors = [f"C{i % 10}" for i in range(len(runs))]
    handles: dict[int, Any] = {}
    for ax, key in zip(axes.flat, metrics, strict=False):
        for i, run in enumerate(runs):
            steps, values = metric_series(run.records, key)
            if not steps:
                continue
            (line,) = ax.plot(steps, values, color=colors[i],
                              marker="o" if key.startswith("val_") or len(steps) < 30 else None,
                              markersize=3 if len(steps) >= 30 else 4)
            handles.setdefault(i, line)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(True, alpha=0.3)
    for ax in list(axes.flat)[len(metrics):]:
        ax.set_visible(False)
    fig.suptitle(f"{len(runs)} runs compared")
    order = sorted(handles)
    fig.legend([handles[i] for i in order], [labels[i] for i in order], loc="lower center",
               ncol=2 if len(runs) > 6 else 1, fontsize="small", frameon=False)
    fig.tight_layout(rect=(0.0, legend_in / fig.get_figheight(), 1.0, 1.0))
    return fig


def compare_runs(run_dirs: Sequence[str | os.PathLike[str]], output_png: str | os.PathLike[str],
                 metrics: Sequence[str] | None = None) -> Path:
    """Overlay the runs' curves of `metrics` (default: :func:`default_metrics`) in one PNG,
    written atomically. UsageError for a path that is not a run directory, a run with no
    metrics, or a metric no run logged."""
    if not run_dirs:
        raise UsageError("plot: give at least one RUN_DIR")
    runs = [load_run(path) for path in run_dirs]
    logged: dict[str, None] = {}
    for run in runs:
        logged.update(dict.fromkeys(run.metric_keys()))
    if metrics:
        for key in metrics:
            if key not in logged:
                raise UsageError(f"--metric {key}: no run logged it; they log: "
                                 f"{', '.join(logged)}")
        chosen = list(dict.fromkeys(metrics))
    else:
        chosen = default_metrics(runs)
    fig = draw_comparison(runs, run_labels(runs), chosen)
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    logger.info("compared %d runs on %s", len(runs), ", ".join(chosen))
    return atomic_write_bytes(output_png, buf.getvalue())


__all__ = ["CONFIG_FILE", "UNSET", "RunCurves", "compare_runs", "config_differences",
           "default_metrics", "draw_comparison", "flatten_config", "load_run", "run_labels"]
