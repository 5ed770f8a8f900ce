"""SQuAD v1.1: training features with answer labels, and the official EM/F1 evaluation.

Windows (document stride, maximum query length) and n-best span decoding are shared with
serving and live in `popbert.serve.predict`, which must not import torch (this package does, for the
pre-training loader); this module adds what training and evaluation need on top:

- `squad_features`: model inputs for every window plus `start_positions`/`end_positions`
  (token indices of the answer in that window, or 0 = [CLS] when the window does not contain
  the whole answer, as Google's run_squad.py labels them);
- `evaluate`: exact match and F1 exactly as the official v1.1 script computes them (lowercase,
  strip punctuation, drop the articles a/an/the, collapse whitespace; best score over the gold
  answers; an unanswered question scores 0), as percentages.
"""

from __future__ import annotations

import json
import logging
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from popbert.data.errors import DataError
from popbert.serve.predict import (
    Question,
    Window,
    WindowOptions,
    build_windows,
    decode_answers,
    read_squad,
    window_arrays,
)

log = logging.getLogger(__name__)

__all__ = [
    "SquadFeatures",
    "answer_token_span",
    "decode_answers",
    "evaluate",
    "evaluate_files",
    "exact_match_score",
    "f1_score",
    "normalize_answer",
    "read_squad",
    "squad_features",
]


@dataclass
class SquadFeatures:
    """Windows of a set of questions and their stacked model inputs (and labels if training)."""

    questions: list[Question]
    windows: list[Window]
    arrays: dict[str, np.ndarray]

    def __len__(self) -> int:
        return len(self.windows)


def answer_token_span(window: Window, start_char: int, end_char: int) -> tuple[int, int]:
    """Positions of the first and last token of [start_char, end_char) in `window`, or (0, 0)
    when the window does not hold the whole answer."""
    start = end = None
    for position, span in enumerate(window.spans):
        if span is None:
            continue
        if start is None and span[1] > start_char:
            start = position
        if span[0] < end_char:
            end = position
    if start is None or end is None or end < start:
        return 0, 0
    first = window.spans[start]
    last = window.spans[end]
    if first[0] > start_char or last[1] < end_char:
        return 0, 0  # the answer begins before or ends after this window
    return start, end


def _usable(question: Question, path: str) -> bool:
    """A training question needs an answer whose text is at its answer_start."""
    if not question.answers:
        log.warning("%s: question %s has no answer; skipped for training", path, question.id)
        return False
    answer = question.answers[0]
    found = question.context[answer.start:answer.start + len(answer.text)]
    if found != answer.text:
        log.warning("%s: question %s: answer %r is not at answer_start %d (found %r); skipped",
                    path, question.id, answer.text, answer.start, found)
        return False
    return True


def squad_features(questions: Sequence[Question], tokenizer: Any, vocab: Mapping[str, int],
                   options: WindowOptions, training: bool = False,
                   source: str = "<squad>") -> SquadFeatures:
    """Windows and model inputs; with `training`, also the labels of each window.

    Training uses each question's first answer (SQuAD v1.1 train has exactly one) and skips
    questions whose answer text is not found at its `answer_start`.
    """
    questions = list(questions)
    if training:
        questions = [q for q in questions if _usable(q, source)]
        if not questions:
            raise DataError(f"{source}: no question with a usable answer to train on")
    windows = build_windows(questions, tokenizer, vocab, options)
    arrays = window_arrays(windows)
    if training:
        starts, ends = [], []
        for window in windows:
            answer = questions[window.question_index].answers[0]
            start, end = answer_token_span(window, answer.start, answer.start + len(answer.text))
            starts.append(start)
            ends.append(end)
        arrays["start_positions"] = np.asarray(starts, np.int64)
        arrays["end_positions"] = np.asarray(ends, np.int64)
    return SquadFeatures(questions, windows, arrays)


# ----------------------------------------------------------------------------------------------
# Official v1.1 evaluation

_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize_answer(text: str) -> str:
    """Lowercase, remove punctuation, remove articles, collapse whitespace (in that order)."""
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match_score(prediction: str, ground_truth: str) -> bool:
    return normalize_answer(prediction) == normalize_answer(ground_truth)


def f1_score(prediction: str, ground_truth: str) -> float:
    """Token-overlap F1 of the normalised strings (0 when they share no token)."""
    predicted = normalize_answer(prediction).split()
    gold = normalize_answer(ground_truth).split()
    same = sum((Counter(predicted) & Counter(gold)).values())
    if same == 0:
        return 0.0
    precision, recall = same / len(predicted), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def evaluate(dataset: Sequence[Mapping[str, Any]], predictions: Mapping[str, str]
             ) -> dict[str, float]:
    """`{"exact_match": ..., "f1": ...}` in percent over every question of `dataset` (the
    file's `data` list); each question scores its best over the gold answers, 0 if unanswered."""
    exact = f1 = 0.0
    total = 0
    unanswered = []
    for article in dataset:
        for paragraph in article["paragraphs"]:
            for qa in paragraph["qas"]:
                total += 1
                qid = str(qa["id"])
                if qid not in predictions:
                    unanswered.append(qid)
                    continue
                golds = [answer["text"] for answer in qa["answers"]]
                prediction = predictions[qid]
                exact += max((float(exact_match_score(prediction, g)) for g in golds),
                             default=0.0)
                f1 += max((f1_score(prediction, g) for g in golds), default=0.0)
    if total == 0:
        raise DataError("the dataset has no questions")
    if unanswered:
        log.warning("%d unanswered questions score 0 (first: %s)", len(unanswered),
                    unanswered[0])
    return {"exact_match": 100.0 * exact / total, "f1": 100.0 * f1 / total}


def evaluate_files(data: Path, predictions: Path) -> dict[str, float]:
    """`popbert evaluate squad`: a SQuAD v1.1 file and a predictions.json → EM/F1."""
    _, dataset = read_squad(data)  # parsed once, with one-line errors on bad structure
    version = dataset.get("version")
    if version is not None and version != "1.1":
        log.warning("%s: evaluation expects v-1.1, but got dataset with v-%s", data, version)
    path = Path(predictions)
    try:
        answers = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise DataError(f"{path}: not a predictions JSON file "
                        f"({' '.join(str(error).split())})") from None
    if not isinstance(answers, dict) or not all(isinstance(v, str) for v in answers.values()):
        raise DataError(f"{path}: expected a JSON object mapping question ids to answer strings")
    return evaluate(dataset["data"], answers)
