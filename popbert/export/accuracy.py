"""What a cheaper export (INT8, FP16, fused) costs in accuracy, on data the user gives.

`popbert export --eval FILE` runs the plain FP32 export and the new one through the same
serving code (`popbert.serve.predict`) and compares: how often they agree (predicted labels, or
SQuAD answer strings) and the task metric of each where the file has gold answers. The drop is
in points of the task's main metric (classification accuracy, SQuAD F1), or, for a file without
labels, the share of examples whose prediction changed. No torch on this path.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path

import numpy as np

from popbert.data.classification import (
    ClassificationData,
    classification_metrics,
    label_ids,
    label_scores,
    regression_metrics,
)
from popbert.data.squad import read_squad
from popbert.data.squad_metric import evaluate as squad_evaluate
from popbert.errors import PopbertError, UsageError
from popbert.serve.predict import ClassifyPredictor, SquadPredictor, predictor_class, read_texts

log = logging.getLogger(__name__)

EVAL_TASKS = ("classification", "squad")


class AccuracyError(PopbertError):
    """The export's accuracy drop is over the threshold the user set (nothing is written)."""


@dataclasses.dataclass(frozen=True)
class AccuracyCost:
    """The candidate export against the FP32 reference on `examples` examples of `data`."""

    task: str
    data: str
    examples: int
    agreement: float  # share of examples with the reference's label / answer string
    metric: str  # "accuracy" or "f1" (points, 0-100), or "changed" without gold answers
    reference: dict[str, float]  # task metrics in points; empty without gold answers
    candidate: dict[str, float]
    drop: float  # points: reference - candidate of `metric` (or 100 * (1 - agreement))

    def line(self) -> str:
        """One readable sentence for the log."""
        scores = (f"; {self.metric} {self.reference[self.metric]:.2f} -> "
                  f"{self.candidate[self.metric]:.2f}" if self.reference else "")
        return (f"on {self.examples} examples of {self.data}: agreement with FP32 "
                f"{100 * self.agreement:.2f}%{scores}; drop {self.drop:.2f} points")


def _regression(ref: ClassifyPredictor, new: ClassifyPredictor, rows: ClassificationData,
                data: Path) -> AccuracyCost:
    """A regression export: agreement is the share of rows whose score is within 1% of the
    reference scores' range of the reference's; the metric Pearson's correlation (points)."""
    expected, got = ref.scores(rows), new.scores(rows)
    spread = float(expected.max() - expected.min()) or 1.0
    agreement = float(np.mean(np.abs(expected - got) <= 0.01 * spread))
    if rows.labels is None:
        return AccuracyCost("classification", str(data), len(expected), agreement, "changed",
                            {}, {}, 100 * (1 - agreement))
    gold = label_scores(rows)
    scores = [{k: 100 * v for k, v in regression_metrics(p, gold).items()}
              for p in (expected, got)]
    return AccuracyCost("classification", str(data), len(expected), agreement, "pearson",
                        scores[0], scores[1], scores[0]["pearson"] - scores[1]["pearson"])


def _classification(reference: Path, candidate: Path, data: Path,
                    threads: int | None) -> AccuracyCost:
    rows = read_texts(data)
    ref, new = ClassifyPredictor(reference, threads), ClassifyPredictor(candidate, threads)
    if ref.regression:
        return _regression(ref, new, rows, data)
    expected = ref.probabilities(rows).argmax(axis=1)
    got = new.probabilities(rows).argmax(axis=1)
    agreement = float(np.mean(expected == got))
    if rows.labels is None:
        return AccuracyCost("classification", str(data), len(expected), agreement, "changed",
                            {}, {}, 100 * (1 - agreement))
    gold = label_ids(rows, ref.labels)
    scores = [{k: 100 * v for k, v in classification_metrics(p, gold, len(ref.labels)).items()}
              for p in (expected, got)]
    return AccuracyCost("classification", str(data), len(expected), agreement, "accuracy",
                        scores[0], scores[1], scores[0]["accuracy"] - scores[1]["accuracy"])


def _squad(reference: Path, candidate: Path, data: Path, threads: int | None) -> AccuracyCost:
    questions, dataset = read_squad(data)
    expected, _ = SquadPredictor(reference, threads).predict(questions)
    got, _ = SquadPredictor(candidate, threads).predict(questions)
    agreement = float(np.mean([expected[q] == got[q] for q in expected])) if expected else 1.0
    scores = [dict(squad_evaluate(dataset["data"], answers)) for answers in (expected, got)]
    return AccuracyCost("squad", str(data), len(expected), agreement, "f1", scores[0],
                        scores[1], scores[0]["f1"] - scores[1]["f1"])


def calibration_rows(model: Path, task: str, data: Path, rows: int) -> list[dict[str, np.ndarray]]:
    """Up to `rows` model rows of `data` (classification rows, tagged words, SQuAD windows, or
    every text of embedding pairs), encoded as the export `model` is served, one row each cut
    to its length: what static quantization (`popbert.export.openvino.quantize`) calibrates
    its activation ranges on."""
    chosen = predictor_class(task)
    if chosen is None:
        raise UsageError(f"--calibration: a {task} export has no calibration rows")
    predictor = chosen(model)
    arrays = predictor.calibration_arrays(data)
    lengths = np.asarray(arrays["input_mask"]).sum(axis=1)
    return [{name: np.ascontiguousarray(np.asarray(value)[i:i + 1, :max(1, int(lengths[i]))])
             for name, value in arrays.items() if name in predictor.input_names}
            for i in range(min(rows, len(lengths)))]


def check_eval_task(task: str) -> None:
    """UsageError (one line) unless exports of `task` can be scored."""
    if task not in EVAL_TASKS:
        raise UsageError(f"--eval: a {task} export has no task to score; --eval applies to "
                         f"{' and '.join(EVAL_TASKS)} exports")


def accuracy_cost(reference: Path, candidate: Path, task: str, data: Path,
                  threads: int | None = None) -> AccuracyCost:
    """Score `candidate` against the FP32 `reference` export of the same `task` on `data` (a
    classification file as `popbert predict classify` reads it, or a SQuAD JSON file)."""
    check_eval_task(task)
    if task == "classification":
        return _classification(reference, candidate, data, threads)
    return _squad(reference, candidate, data, threads)


def check_drop(cost: AccuracyCost, max_drop: float | None, output: Path) -> None:
    """AccuracyError (one line) if `cost.drop` exceeds `max_drop` points."""
    if max_drop is not None and cost.drop > max_drop:
        raise AccuracyError(f"{output}: not written: the export loses {cost.drop:.2f} points "
                            f"of {cost.metric} against FP32 on {cost.data} (more than "
                            f"--max-accuracy-drop {max_drop:g}); agreement "
                            f"{100 * cost.agreement:.2f}%")


__all__ = ["EVAL_TASKS", "AccuracyCost", "AccuracyError", "accuracy_cost", "calibration_rows",
           "check_drop", "check_eval_task"]
