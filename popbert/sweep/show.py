"""`popbert sweep show`: the trials of a sweep best first, and PNG plots that compare them.

The table ranks finished trials by the metric (then pruned trials by their last value, then
running, waiting and failed ones); skipped trials (never run) are only counted. The plots come
from the trials' own `metrics.jsonl` files and the study: the metric over the steps of every
trial, the final metric against each parameter, and the parameters' importance (Optuna's
fANOVA), written with matplotlib's Agg canvas like the runs' own plots. Several sweeps of one
metric (random against bayes, say) are compared by the best value found so far against the
number of trials finished: which search found its best in fewer trials.
"""

from __future__ import annotations

import io
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.trial import FrozenTrial, TrialState

from popbert.atomic import atomic_write_bytes
from popbert.observe.plots import metric_series, one_record_per_step
from popbert.observe.tracking import read_metrics
from popbert.sweep.study import OUTCOME, Sweep

log = logging.getLogger(__name__)

_ORDER = {TrialState.COMPLETE: 0, TrialState.PRUNED: 1, TrialState.RUNNING: 2,
          TrialState.WAITING: 3, TrialState.FAIL: 4}


@dataclass
class TrialRow:
    number: int
    state: str
    value: float | None
    params: dict[str, Any]
    step: int | None
    run_dir: str
    note: str = ""


def ranked_trials(sweep: Sweep, study: optuna.Study) -> tuple[list[FrozenTrial], int]:
    """The sweep's trials best first, and how many were skipped (never run)."""
    trials = study.get_trials(deepcopy=False)
    skipped = sum(t.user_attrs.get(OUTCOME) == "skipped" for t in trials)
    shown = [t for t in trials if t.user_attrs.get(OUTCOME) != "skipped"]
    sign = 1.0 if sweep.spec.goal == "minimize" else -1.0

    def key(t: FrozenTrial) -> tuple:
        value = t.value if t.value is not None and math.isfinite(t.value) else math.inf
        ranked = t.state in (TrialState.COMPLETE, TrialState.PRUNED)
        return (_ORDER.get(t.state, 5), sign * value if ranked and value != math.inf
                else math.inf, t.number)

    return sorted(shown, key=key), skipped


def trial_rows(sweep: Sweep, study: optuna.Study) -> tuple[list[TrialRow], int]:
    trials, skipped = ranked_trials(sweep, study)
    rows = []
    for t in trials:
        run = Path(t.user_attrs.get("run_dir", ""))
        step = None
        metrics = run / "metrics.jsonl"
        if run.name and metrics.is_file():
            steps = [r.get("step") for r in read_metrics(metrics)]
            step = max((s for s in steps if isinstance(s, int)), default=None)
        note = t.user_attrs.get("error", "") if t.state == TrialState.FAIL else ""
        if t.state == TrialState.FAIL and not note:
            note = "agent died; retried" if OUTCOME not in t.user_attrs else ""
        rows.append(TrialRow(t.number, t.state.name, t.value, dict(t.params), step,
                             run.name, note))
    return rows, skipped


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def table(sweep: Sweep, study: optuna.Study) -> str:
    """The trials as a text table, best first."""
    rows, skipped = trial_rows(sweep, study)
    names = list(sweep.spec.parameters)
    header = ["trial", "state", sweep.spec.metric, *names, "step", "run"]
    body = [[str(r.number), r.state, _fmt(r.value), *(_fmt(r.params.get(n)) for n in names),
             _fmt(r.step), r.run_dir + (f"  ({r.note[:80]})" if r.note else "")] for r in rows]
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h)
              for i, h in enumerate(header)]
    lines = [f"sweep {sweep.id} ({sweep.spec.method}, {sweep.spec.goal} "
             f"{sweep.spec.metric}) in {sweep.directory}"]
    lines.append("  ".join(h.ljust(w) for h, w in zip(header, widths)).rstrip())
    lines += ["  ".join(c.ljust(w) for c, w in zip(b, widths)).rstrip() for b in body]
    counts: dict[str, int] = {}
    for r in rows:
        counts[r.state] = counts.get(r.state, 0) + 1
    summary = ", ".join(f"{n} {s.lower()}" for s, n in counts.items()) or "no trials"
    lines.append(summary + (f"; {skipped} skipped (cap or grid point taken)" if skipped else ""))
    return "\n".join(lines) + "\n"


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    return fig


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return atomic_write_bytes(path, buf.getvalue())


def plot_sweep(sweep: Sweep, study: optuna.Study, output_dir: Path | None = None
               ) -> list[Path]:
    """Write the sweep's PNG plots into `output_dir` (default: the sweep's `plots/`)."""
    out = Path(output_dir) if output_dir is not None else sweep.directory / "plots"
    out.mkdir(parents=True, exist_ok=True)
    trials, _ = ranked_trials(sweep, study)
    spec = sweep.spec
    written = [_plot_curves(spec.metric, trials, out / "metric_by_trial.png")]
    ranked = [t for t in trials if t.state in (TrialState.COMPLETE, TrialState.PRUNED)
              and t.value is not None]
    if ranked:
        written.append(_plot_params(sweep, ranked, out / "metric_vs_params.png"))
    importance = _plot_importance(sweep, study, out / "param_importance.png")
    if importance is not None:
        written.append(importance)
    return written


def _plot_curves(metric: str, trials: list[FrozenTrial], path: Path) -> Path:
    fig = _figure(9, 5.5)
    ax = fig.add_subplot(1, 1, 1)
    drawn = 0
    for t in trials:
        metrics = Path(t.user_attrs.get("run_dir", "")) / "metrics.jsonl"
        if not metrics.is_file():
            continue
        steps, values = metric_series(one_record_per_step(read_metrics(metrics)), metric)
        if not steps:
            continue
        params = ", ".join(f"{k.rsplit('.', 1)[-1]}={_fmt(v)}" for k, v in t.params.items())
        style = "--" if t.state == TrialState.PRUNED else "-"
        ax.plot(steps, values, style, marker=".", label=f"trial {t.number}: {params}")
        drawn += 1
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(f"{metric} per trial (dashed: pruned)")
    if drawn:
        ax.legend(fontsize="small")
    ax.grid(alpha=0.3)
    return _save(fig, path)


def _plot_params(sweep: Sweep, trials: list[FrozenTrial], path: Path) -> Path:
    names = list(sweep.spec.parameters)
    fig = _figure(4.5 * len(names), 4)
    for i, name in enumerate(names):
        ax = fig.add_subplot(1, len(names), i + 1)
        for state, marker in ((TrialState.COMPLETE, "o"), (TrialState.PRUNED, "x")):
            points = [(t.params[name], t.value) for t in trials
                      if t.state == state and name in t.params]
            if not points:
                continue
            xs = [p[0] if isinstance(p[0], int | float) else str(p[0]) for p in points]
            ax.scatter(xs, [p[1] for p in points], marker=marker,
                       label="finished" if state == TrialState.COMPLETE else "pruned")
        dist = sweep.spec.parameters[name]
        numbers = [t.params.get(name) for t in trials]
        if all(isinstance(x, int | float) and x > 0 for x in numbers) and (
                "log" in dist.distribution or _spread(numbers) >= 10):
            ax.set_xscale("log")
            # Within a decade or two, labelled minor ticks (2×10⁻⁵, 3×10⁻⁵, ...) overlap.
            from matplotlib.ticker import NullFormatter
            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel(name)
        ax.set_ylabel(sweep.spec.metric)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    return _save(fig, path)


def _spread(numbers: list[float]) -> float:
    return max(numbers) / min(numbers) if numbers and min(numbers) > 0 else 1.0


def _plot_importance(sweep: Sweep, study: optuna.Study, path: Path) -> Path | None:
    """fANOVA importance of the parameters that vary (needs two finished trials)."""
    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    varying = [n for n in sweep.spec.parameters
               if len({repr(t.params.get(n)) for t in complete}) > 1]
    if len(complete) < 2 or not varying:
        return None
    try:
        importance = optuna.importance.get_param_importances(study, params=varying)
    except (RuntimeError, ValueError) as error:
        log.warning("no parameter importance: %s", error)
        return None
    fig = _figure(7, 1.2 + 0.5 * len(importance))
    ax = fig.add_subplot(1, 1, 1)
    names = list(importance)[::-1]
    ax.barh(names, [importance[n] for n in names])
    ax.set_xlabel(f"importance for {sweep.spec.metric} (fANOVA, {len(complete)} trials)")
    ax.set_xlim(0, 1)
    return _save(fig, path)


__all__ = ["TrialRow", "plot_sweep", "ranked_trials", "table", "trial_rows"]


def best_so_far(study: optuna.Study, goal: str) -> list[float]:
    """The best metric value after each finished trial, in the order the trials finished
    (completion time: with several agents, trial numbers are the order they started)."""
    done = sorted((t for t in study.get_trials(deepcopy=False)
                   if t.state == TrialState.COMPLETE and t.value is not None
                   and math.isfinite(t.value)),
                  key=lambda t: (t.datetime_complete is None, t.datetime_complete, t.number))
    pick = min if goal == "minimize" else max
    best: list[float] = []
    for trial in done:
        best.append(trial.value if not best else pick(best[-1], trial.value))
    return best


def check_comparable(sweeps: list[Sweep]) -> None:
    """Sweeps compared in one plot must optimise the same metric in the same direction."""
    from popbert.errors import UsageError

    first = sweeps[0].spec
    for sweep in sweeps[1:]:
        if (sweep.spec.metric, sweep.spec.goal) != (first.metric, first.goal):
            raise UsageError(f"sweep show: {sweep.directory} optimises {sweep.spec.goal} "
                             f"{sweep.spec.metric}, {sweeps[0].directory} {first.goal} "
                             f"{first.metric}; compare sweeps of one metric")


def plot_best_so_far(sweeps: list[tuple[Sweep, optuna.Study]], path: Path) -> Path:
    """One line per sweep: the best metric so far against trials finished."""
    check_comparable([sweep for sweep, _ in sweeps])
    first = sweeps[0][0].spec
    fig = _figure(8, 5)
    ax = fig.add_subplot(1, 1, 1)
    for sweep, study in sweeps:
        best = best_so_far(study, first.goal)
        if best:
            ax.plot(range(1, len(best) + 1), best, marker="o",
                    label=f"{sweep.id} ({sweep.spec.method})")
    ax.set_xlabel("trials finished")
    ax.set_ylabel(f"best {first.metric} so far ({first.goal})")
    ax.set_title(f"best {first.metric} found against trials")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return _save(fig, path)
