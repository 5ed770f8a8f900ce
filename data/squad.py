"""SQuAD v1.1 as popbert reads it: questions, windows, training labels and answer decoding.

Training (`popbert finetune squad`) and serving (`popbert predict squad`, ONNX Runtime alone)
both cut contexts into windows and decode spans with this module, so a served model sees exactly
the inputs it was trained on; it therefore imports numpy and tokenizers only, never torch. The
windows and the functions: docs/design.md, section "popbert.data.squad".
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import Tokenizer

from popbert.atomic import atomic_write_text
from popbert.data.errors import DataError
from popbert.data.squad_metric import evaluate
from popbert.data.tokenization import Encoding, encode_texts
from popbert.errors import UsageError
from popbert.textfile import read_json

log = logging.getLogger(__name__)

__all__ = [
    "Answer",
    "Candidate",
    "Question",
    "SquadFeatures",
    "Window",
    "WindowOptions",
    "answer_token_span",
    "build_windows",
    "decode_answers",
    "evaluate_files",
    "make_windows",
    "read_squad",
    "squad_features",
    "window_arrays",
    "write_predictions",
]


# ----------------------------------------------------------------------------------------------
# SQuAD files


@dataclass
class Answer:
    """A gold answer: its text and where it starts, so labels can be checked against the context."""

    text: str
    start: int  # character offset in the context


@dataclass
class Question:
    """One SQuAD question with its context (answers are empty for unlabelled data)."""

    id: str
    question: str
    context: str
    answers: list[Answer] = field(default_factory=list)
    context_index: int = 0  # questions of one paragraph share it (its context is encoded once)


def read_squad(path: Path) -> tuple[list[Question], dict[str, Any]]:
    """Questions of a SQuAD v1.1 JSON file (`{"data": [{"paragraphs": [...]}]}`) and the file.

    Structural problems are one-line UsageErrors naming the file and where in it.
    """
    path = Path(path)
    dataset = read_json(path, "a SQuAD v1.1 JSON file", error=UsageError)
    if not isinstance(dataset, dict) or not isinstance(dataset.get("data"), list):
        raise UsageError(f"{path}: expected a SQuAD JSON object with a 'data' list")
    questions: list[Question] = []
    seen: set[str] = set()
    paragraphs = 0
    for a, article in enumerate(dataset["data"]):
        for p, paragraph in enumerate(_field(article, "paragraphs", list, path, f"data[{a}]")):
            where = f"data[{a}].paragraphs[{p}]"
            context = _field(paragraph, "context", str, path, where)
            for q, qa in enumerate(_field(paragraph, "qas", list, path, where)):
                at = f"{where}.qas[{q}]"
                qid = str(_field(qa, "id", (str, int), path, at))
                if qid in seen:
                    raise UsageError(f"{path}: {at}: duplicate question id {qid!r}")
                seen.add(qid)
                answers = []
                for n, answer in enumerate(qa.get("answers", []) or []):
                    text = _field(answer, "text", str, path, f"{at}.answers[{n}]")
                    start = _field(answer, "answer_start", int, path, f"{at}.answers[{n}]")
                    answers.append(Answer(text, start))
                questions.append(Question(qid, _field(qa, "question", str, path, at), context,
                                          answers, paragraphs))
            paragraphs += 1
    if not questions:
        raise UsageError(f"{path}: no questions")
    return questions, dataset


def _field(node: Any, key: str, types: type | tuple[type, ...], path: Path, where: str) -> Any:
    if not isinstance(node, dict) or key not in node:
        raise UsageError(f"{path}: {where}: missing {key!r}")
    value = node[key]
    if not isinstance(value, types) or isinstance(value, bool):
        raise UsageError(f"{path}: {where}.{key}: unexpected value {str(value)[:40]!r}")
    return value


# ----------------------------------------------------------------------------------------------
# Windows


@dataclass
class Window:
    """One model input: [CLS] question [SEP] context slice [SEP], padded to the sequence length.

    `spans[i]` is the character span of position i in the context (None outside the context);
    `max_context[i]` says whether this window is the one that scores that context token.
    """

    question_index: int
    input_ids: np.ndarray
    segment_ids: np.ndarray
    input_mask: np.ndarray
    spans: list[tuple[int, int] | None]
    max_context: list[bool]
    context_start: int  # index of the window's first context token in the whole context
    context_end: int  # one past its last
    query_truncated: bool = False  # the question had more than max_query_length tokens


@dataclass(frozen=True)
class WindowOptions:
    """How contexts are cut into windows; a model must be served with the ones it trained on
    (export records `doc_stride` and `max_query_length` in its metadata)."""

    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64

    def validate(self) -> None:
        """Raise a one-line UsageError naming the option that leaves no valid window."""
        for key in ("max_seq_length", "doc_stride", "max_query_length"):
            if getattr(self, key) < 1:
                raise UsageError(f"--{key.replace('_', '-')} must be >= 1, "
                                 f"got {getattr(self, key)}")
        if self.max_seq_length - self.max_query_length - 3 < 1:
            raise UsageError(f"--max-seq-length ({self.max_seq_length}) leaves no room for the "
                             f"context after a question of --max-query-length "
                             f"({self.max_query_length}) tokens and 3 special tokens")


def _doc_spans(length: int, max_tokens: int, stride: int) -> list[tuple[int, int]]:
    """(start, length) of each window over `length` context tokens (Google's loop)."""
    spans: list[tuple[int, int]] = []
    start = 0
    while start < length:
        size = min(length - start, max_tokens)
        spans.append((start, size))
        if start + size == length:
            break
        start += min(size, stride)
    return spans or [(0, 0)]


def _is_max_context(spans: Sequence[tuple[int, int]], current: int, position: int) -> bool:
    """Whether window `current` gives token `position` the most context (Google's rule)."""
    best_score, best = None, None
    for index, (start, size) in enumerate(spans):
        end = start + size - 1
        if position < start or position > end:
            continue
        score = min(position - start, end - position) + 0.01 * size
        if best_score is None or score > best_score:
            best_score, best = score, index
    return current == best


def make_windows(question_index: int, question: Encoding, context: Encoding,
                 options: WindowOptions, vocab: Mapping[str, int]) -> list[Window]:
    """All windows of one question over its context."""
    cls, sep, pad = vocab["[CLS]"], vocab["[SEP]"], vocab["[PAD]"]
    seq = options.max_seq_length
    query = question.ids[:options.max_query_length]
    max_tokens = seq - len(query) - 3
    spans = _doc_spans(len(context.ids), max_tokens, options.doc_stride)
    windows = []
    for index, (start, size) in enumerate(spans):
        ids = [cls, *query, sep, *context.ids[start:start + size], sep]
        first_context = len(query) + 2
        segments = [0] * first_context + [1] * (size + 1)
        char_spans: list[tuple[int, int] | None] = [None] * seq
        max_context = [False] * seq
        for j in range(size):
            char_spans[first_context + j] = context.offsets[start + j]
            max_context[first_context + j] = _is_max_context(spans, index, start + j)
        used = len(ids)
        input_ids = np.full(seq, pad, np.int64)
        input_ids[:used] = ids
        segment_ids = np.zeros(seq, np.int64)
        segment_ids[:used] = segments
        input_mask = np.zeros(seq, np.int64)
        input_mask[:used] = 1
        windows.append(Window(question_index, input_ids, segment_ids, input_mask, char_spans,
                              max_context, start, start + size,
                              len(question.ids) > options.max_query_length))
    return windows


def build_windows(questions: Sequence[Question], tokenizer: Tokenizer,
                  vocab: Mapping[str, int], options: WindowOptions) -> list[Window]:
    """Windows of every question, in question order (each context encoded once)."""
    options.validate()
    contexts: dict[int, str] = {}
    for q in questions:
        contexts.setdefault(q.context_index, q.context)
    order = sorted(contexts)
    encoded = dict(zip(order, encode_texts(tokenizer, [contexts[i] for i in order])))
    asked = encode_texts(tokenizer, [q.question for q in questions])
    windows: list[Window] = []
    for index, (q, query) in enumerate(zip(questions, asked)):
        windows.extend(make_windows(index, query, encoded[q.context_index], options, vocab))
    return windows


def window_arrays(windows: Sequence[Window]) -> dict[str, np.ndarray]:
    """The model inputs of `windows`, stacked ([N, S] int64)."""
    return {"input_ids": np.stack([w.input_ids for w in windows]),
            "segment_ids": np.stack([w.segment_ids for w in windows]),
            "input_mask": np.stack([w.input_mask for w in windows])}


# ----------------------------------------------------------------------------------------------
# Training features


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


def _unusable(question: Question) -> str | None:
    """Why a training question cannot be trained on (None: it can): it needs an answer whose
    text is at its answer_start."""
    if not question.answers:
        return "no answer"
    answer = question.answers[0]
    found = question.context[answer.start:answer.start + len(answer.text)]
    if found != answer.text:
        return "the answer is not at its answer_start"
    return None


def _say_cut(source: str, what: str, ids: list[str], total: int) -> None:
    """One line for everything of a kind a step leaves out (with the first few ids)."""
    if ids:
        shown = ", ".join(ids[:3]) + (", ..." if len(ids) > 3 else "")
        log.warning("%s: %d of %d questions %s (%s)", source, len(ids), total, what, shown)


def squad_features(questions: Sequence[Question], tokenizer: Tokenizer,
                   vocab: Mapping[str, int], options: WindowOptions, training: bool = False,
                   source: str = "<squad>") -> SquadFeatures:
    """Windows and model inputs; with `training`, also the labels of each window.

    Training uses each question's first answer (SQuAD v1.1 train has exactly one) and skips
    questions whose answer text is not found at its `answer_start`.
    """
    questions = list(questions)
    if training:
        reasons = {q.id: _unusable(q) for q in questions}
        for reason in ("no answer", "the answer is not at its answer_start"):
            _say_cut(source, f"skipped for training: {reason}",
                     [i for i, r in reasons.items() if r == reason], len(questions))
        questions = [q for q in questions if reasons[q.id] is None]
        if not questions:
            raise DataError(f"{source}: no question with a usable answer to train on")
    windows = build_windows(questions, tokenizer, vocab, options)
    arrays = window_arrays(windows)
    if training:
        starts, ends = [], []
        answered: set[int] = set()
        for window in windows:
            answer = questions[window.question_index].answers[0]
            start, end = answer_token_span(window, answer.start, answer.start + len(answer.text))
            starts.append(start)
            ends.append(end)
            if start:
                answered.add(window.question_index)
        arrays["start_positions"] = np.asarray(starts, np.int64)
        arrays["end_positions"] = np.asarray(ends, np.int64)
        _say_cut(source, f"have their answer in no window of {options.max_seq_length} tokens "
                 f"(trained as no answer; a larger --max-seq-length or --doc-stride overlap "
                 f"keeps them)", [q.id for i, q in enumerate(questions) if i not in answered],
                 len(questions))
    return SquadFeatures(questions, windows, arrays)


# ----------------------------------------------------------------------------------------------
# Span decoding


@dataclass
class Candidate:
    """One n-best answer with the logits that chose it (kept for `nbest_predictions.json`)."""

    text: str
    start_logit: float
    end_logit: float
    probability: float = 0.0
    start: int = 0  # the answer's character span in the context (`popbert serve`'s /predict)
    end: int = 0

    @property
    def score(self) -> float:
        return self.start_logit + self.end_logit


def _top(values: np.ndarray, n: int) -> np.ndarray:
    return np.argsort(-values, kind="stable")[:n]


def decode_answers(questions: Sequence[Question], windows: Sequence[Window],
                   start_logits: np.ndarray, end_logits: np.ndarray, n_best_size: int = 20,
                   max_answer_length: int = 30) -> tuple[dict[str, str],
                                                         dict[str, list[Candidate]]]:
    """Best answer per question and its n-best list (Google's post-processing).

    Candidates: the `n_best_size` highest start and end logits of each window, kept if both lie
    in the context, the start is scored in this window (max context), end >= start and the span
    has at most `max_answer_length` tokens; ranked by start + end logit over all windows of the
    question, duplicates of a text dropped. A question with no valid span gets "".
    """
    if n_best_size < 1 or max_answer_length < 1:
        raise UsageError("--n-best-size and --max-answer-length must be >= 1")
    by_question: dict[int, list[int]] = {}
    for index, window in enumerate(windows):
        by_question.setdefault(window.question_index, []).append(index)
    predictions: dict[str, str] = {}
    nbest: dict[str, list[Candidate]] = {}
    for q_index, question in enumerate(questions):
        scored: list[tuple[float, int, int, int]] = []
        for w in by_question.get(q_index, []):
            window, starts, ends = windows[w], start_logits[w], end_logits[w]
            for i in _top(starts, n_best_size):
                if window.spans[i] is None or not window.max_context[i]:
                    continue
                for j in _top(ends, n_best_size):
                    if window.spans[j] is None or j < i or j - i + 1 > max_answer_length:
                        continue
                    scored.append((float(starts[i] + ends[j]), w, int(i), int(j)))
        scored.sort(key=lambda c: -c[0])
        chosen: list[Candidate] = []
        seen: set[str] = set()
        for _, w, i, j in scored:
            text = question.context[windows[w].spans[i][0]:windows[w].spans[j][1]]
            if text in seen:
                continue
            seen.add(text)
            chosen.append(Candidate(text, float(start_logits[w][i]), float(end_logits[w][j]),
                                    start=windows[w].spans[i][0], end=windows[w].spans[j][1]))
            if len(chosen) == n_best_size:
                break
        if not chosen:
            chosen = [Candidate("", 0.0, 0.0)]
        scores = np.array([c.score for c in chosen], np.float64)
        probabilities = np.exp(scores - scores.max())
        probabilities /= probabilities.sum()
        for candidate, probability in zip(chosen, probabilities):
            candidate.probability = float(probability)
        predictions[question.id] = chosen[0].text
        nbest[question.id] = chosen
    return predictions, nbest


def write_predictions(output: Path, predictions: Mapping[str, str],
                      nbest: Mapping[str, Iterable[Candidate]] | None = None) -> Path:
    """`predictions.json` in the official format ({id: answer}), and the n-best list next to
    it (`nbest_predictions.json`) when given; both written atomically."""
    output = Path(output)
    atomic_write_text(output, json.dumps(dict(predictions), indent=2, ensure_ascii=False))
    if nbest is not None:
        atomic_write_text(output.with_name("nbest_predictions.json"), json.dumps(
            {qid: [{"text": c.text, "probability": c.probability, "start_logit": c.start_logit,
                    "end_logit": c.end_logit} for c in candidates]
             for qid, candidates in nbest.items()}, indent=2, ensure_ascii=False))
    return output


# ----------------------------------------------------------------------------------------------
# Evaluating a predictions file


def evaluate_files(data: Path, predictions: Path) -> dict[str, float]:
    """`popbert evaluate squad`: a SQuAD v1.1 file and a predictions.json → EM/F1."""
    _, dataset = read_squad(data)  # parsed once, with one-line errors on bad structure
    version = dataset.get("version")
    if version is not None and version != "1.1":
        log.warning("%s: evaluation expects v-1.1, but got dataset with v-%s", data, version)
    path = Path(predictions)
    answers = read_json(path, "SQuAD predictions (a JSON object of question id to answer)",
                        error=DataError)
    if not isinstance(answers, dict) or not all(isinstance(v, str) for v in answers.values()):
        raise DataError(f"{path}: expected a JSON object mapping question ids to answer strings")
    return evaluate(dataset["data"], answers)
