"""Answer SQuAD-style questions with an exported model in ONNX Runtime alone (no torch).

`popbert predict squad --model squad.onnx --data questions.json --output predictions.json`
reads the model's `popbert.*` metadata (vocabulary, lowercasing, window sizes; see
`popbert.io.export.task_metadata`), cuts each context into overlapping windows, runs ONNX Runtime
and picks the best span over all windows.

This module is also the torch-free core that fine-tuning shares (`popbert.data.squad` builds its
training features and predictions on it), so serving and training cut windows and decode spans
with the same code. It imports numpy, tokenizers and onnxruntime only: `popbert.data` imports
torch for the pre-training loader, so nothing from it is imported here.

Windows follow Google's run_squad.py: the question (at most `max_query_length` tokens), then
context tokens in windows of at most `max_seq_length - len(question) - 3` tokens starting every
`doc_stride` tokens; a token is scored only in the window where it has the most context on both
sides. Answers are substrings of the original context, cut at the WordPiece offsets.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from popbert.errors import UsageError
from popbert.io.atomic import atomic_write_text

log = logging.getLogger(__name__)

METADATA_PREFIX = "popbert."
SPECIAL_TOKENS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


# ----------------------------------------------------------------------------------------------
# SQuAD files


@dataclass
class Answer:
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
    try:
        dataset = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise UsageError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"{path}: not a SQuAD JSON file ({' '.join(str(error).split())})"
                         ) from None
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
# Tokenization and windows


def parse_vocab(text: str) -> dict[str, int]:
    """`vocab.txt` content → token → id (first id of a duplicated token, like popbert.data)."""
    lines = [line.rstrip("\r") for line in text.split("\n")]
    while lines and lines[-1] == "":
        lines.pop()
    index: dict[str, int] = {}
    for i, token in enumerate(lines):
        index.setdefault(token, i)
    missing = [t for t in SPECIAL_TOKENS if t not in index]
    if missing:
        raise UsageError(f"vocabulary lacks special tokens {', '.join(missing)}")
    return index


def make_tokenizer(vocab: Mapping[str, int], lowercase: bool = True) -> Any:
    """Hugging Face WordPiece with exactly `popbert.data.WordPieceTokenizer`'s settings."""
    from tokenizers import BertWordPieceTokenizer

    tokenizer = BertWordPieceTokenizer(
        dict(vocab), unk_token="[UNK]", sep_token="[SEP]", cls_token="[CLS]",
        pad_token="[PAD]", mask_token="[MASK]", clean_text=True, handle_chinese_chars=True,
        strip_accents=lowercase, lowercase=lowercase, wordpieces_prefix="##")
    # Text is data: a literal "[SEP]" in a question is characters, never the control token.
    tokenizer._tokenizer.encode_special_tokens = True
    return tokenizer


@dataclass
class Encoding:
    """A text's WordPiece ids and each token's (start, end) character offsets."""

    ids: list[int]
    offsets: list[tuple[int, int]]


def encode_texts(tokenizer: Any, texts: Sequence[str]) -> list[Encoding]:
    """Encode many texts at once (Rust, parallel), without special tokens."""
    if not texts:
        return []
    return [Encoding(list(e.ids), [tuple(o) for o in e.offsets])
            for e in tokenizer.encode_batch(list(texts), add_special_tokens=False)]


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


@dataclass(frozen=True)
class WindowOptions:
    max_seq_length: int = 384
    doc_stride: int = 128
    max_query_length: int = 64

    def validate(self) -> None:
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
                              max_context, start, start + size))
    return windows


def build_windows(questions: Sequence[Question], tokenizer: Any, vocab: Mapping[str, int],
                  options: WindowOptions) -> list[Window]:
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
# Span decoding


@dataclass
class Candidate:
    text: str
    start_logit: float
    end_logit: float
    probability: float = 0.0

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
            chosen.append(Candidate(text, float(start_logits[w][i]), float(end_logits[w][j])))
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
# ONNX Runtime


class SquadPredictor:
    """An exported `squad` model in ONNX Runtime, with the tokenizer its metadata describes."""

    def __init__(self, model: Path, threads: int | None = None):
        import onnxruntime as ort

        model = Path(model)
        if not model.is_file():
            raise UsageError(f"--model: file not found: {model}")
        options = ort.SessionOptions()
        if threads:
            options.intra_op_num_threads = threads
        try:
            self.session = ort.InferenceSession(str(model), options,
                                                providers=["CPUExecutionProvider"])
        except Exception as error:  # ORT's own exception types: report, no traceback
            raise UsageError(f"--model: {model}: ONNX Runtime cannot load it "
                             f"({' '.join(str(error).split())[:200]})") from None
        meta = self.session.get_modelmeta().custom_metadata_map
        if meta.get(f"{METADATA_PREFIX}task") != "squad":
            raise UsageError(f"--model: {model} is not a popbert squad export (export it with "
                             "`popbert export --task squad` from a fine-tuned checkpoint)")
        for key in ("vocab", "doc_stride", "max_query_length"):
            if f"{METADATA_PREFIX}{key}" not in meta:
                raise UsageError(f"--model: {model}: metadata {METADATA_PREFIX}{key} missing")
        self.vocab = parse_vocab(meta[f"{METADATA_PREFIX}vocab"])
        self.lowercase = bool(json.loads(meta.get(f"{METADATA_PREFIX}lowercase", "true")))
        self.tokenizer = make_tokenizer(self.vocab, self.lowercase)
        shape = self.session.get_inputs()[0].shape
        self.batch_size = shape[0] if isinstance(shape[0], int) else None
        self.sequence_length = int(shape[1])
        self.options = WindowOptions(self.sequence_length,
                                     int(json.loads(meta[f"{METADATA_PREFIX}doc_stride"])),
                                     int(json.loads(meta[f"{METADATA_PREFIX}max_query_length"])))
        self.output_names = [o.name for o in self.session.get_outputs()]

    def logits(self, windows: Sequence[Window], batch_size: int = 16
               ) -> tuple[np.ndarray, np.ndarray]:
        """Start and end logits [N, S] for `windows`, in batches (padded to a fixed batch)."""
        from tqdm import tqdm

        step = self.batch_size or batch_size
        starts, ends = [], []
        for first in tqdm(range(0, len(windows), step), desc="predict", unit="batch",
                          total=math.ceil(len(windows) / step), disable=len(windows) <= step):
            chunk = list(windows[first:first + step])
            real = len(chunk)
            if self.batch_size is not None:
                chunk += [chunk[-1]] * (self.batch_size - real)
            out = dict(zip(self.output_names, self.session.run(None, window_arrays(chunk))))
            starts.append(np.asarray(out["start_logits"], np.float32)[:real])
            ends.append(np.asarray(out["end_logits"], np.float32)[:real])
        return np.concatenate(starts), np.concatenate(ends)

    def predict(self, questions: Sequence[Question], n_best_size: int = 20,
                max_answer_length: int = 30, batch_size: int = 16
                ) -> tuple[dict[str, str], dict[str, list[Candidate]]]:
        windows = build_windows(questions, self.tokenizer, self.vocab, self.options)
        start, end = self.logits(windows, batch_size)
        return decode_answers(questions, windows, start, end, n_best_size, max_answer_length)


def predict_squad(model: Path, data: Path, output: Path, n_best_size: int = 20,
                  max_answer_length: int = 30, batch_size: int = 16,
                  threads: int | None = None) -> dict[str, str]:
    """`popbert predict squad`: answer every question of `data`, write `output` (+ n-best)."""
    predictor = SquadPredictor(model, threads)
    questions, _ = read_squad(data)
    predictions, nbest = predictor.predict(questions, n_best_size, max_answer_length, batch_size)
    write_predictions(output, predictions, nbest)
    log.info("answered %d questions with %s: %s", len(predictions), model, output)
    return predictions


__all__ = ["Answer", "Candidate", "Encoding", "Question", "SquadPredictor", "Window",
           "WindowOptions", "build_windows", "decode_answers", "encode_texts", "make_tokenizer",
           "make_windows", "parse_vocab", "predict_squad", "read_squad", "window_arrays",
           "write_predictions"]
