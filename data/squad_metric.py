"""The official SQuAD v1.1 metric: exact match and F1, as `evaluate-v1.1.py` computes them.

Kept apart from the windows and decoding of `popbert.data.squad` because it is a transcription
of a fixed external script (lowercase, strip punctuation, drop the articles a/an/the, collapse
whitespace; best score over the gold answers; an unanswered question scores 0), changed only
when the official rules change; scores are percentages.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from popbert.data.errors import DataError

log = logging.getLogger(__name__)

__all__ = ["evaluate", "exact_match_score", "f1_score", "normalize_answer"]

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
