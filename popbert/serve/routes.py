"""What each route of `popbert serve` computes, with no HTTP in it: requests' fields in, JSON-ready
answers out, through the same predictors as `popbert predict` (so a route and the batch command
cannot disagree). `popbert.serve.app` puts these behind FastAPI.

A `Served` model is one export with its predictor: the task, labels, tokenizer and maximum
length come from the export's metadata. Client mistakes raise `RequestError` with the HTTP
status and the field to blame.
"""

from __future__ import annotations

import base64
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from popbert.data.classification import ClassificationData
from popbert.data.squad import Question
from popbert.errors import UsageError
from popbert.graph.annotations import METADATA_PREFIX
from popbert.serve.predict import (
    ClassifyPredictor,
    PredictStats,
    export_task,
    predictor_class,
)
from popbert.serve.rerank import pair_scores
from popbert.serve.tag import tag_texts
from popbert.tasks.embedding import TOKEN_STATES

log = logging.getLogger(__name__)


class RequestError(Exception):
    """A request the server will not answer: its HTTP status, the message, the field, and the
    error type where the status alone does not say it (None: the status's)."""

    def __init__(self, status: int, message: str, field: str | None = None,
                 kind: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.field = field
        self.kind = kind


@dataclass
class Usage:
    """Tokens a request fed the model, how many of its inputs were cut to fit, the characters
    they held, and where its time went (seconds): encoding the inputs, waiting in the batcher
    for a model run, the model runs (from the first with its rows to the end of the last);
    `began` is time.monotonic() as its inputs began to be encoded."""

    tokens: int = 0
    truncated: int = 0
    characters: int = 0
    encode_seconds: float = 0.0
    queue_seconds: float = 0.0
    inference_seconds: float = 0.0
    began: float = 0.0

    @classmethod
    def of(cls, stats: PredictStats, characters: int = 0,
           truncated: int | None = None) -> Usage:
        if truncated is None:
            truncated = stats.truncated or 0
        handed = stats.handed_over if stats.handed_over is not None else stats.began
        return cls(stats.tokens, truncated, characters, handed - stats.began,
                   stats.queue_seconds, stats.model_seconds, stats.began)


class Served:
    """One export behind the server: its predictor, and what each route does with it."""

    def __init__(self, model: Path, threads: int | None = None,
                 served_model_name: str | None = None,
                 max_input_tokens: int | None = None, device: str = "cpu") -> None:
        model = Path(model)
        self.task = export_task(model)
        predictor = predictor_class(self.task)
        if predictor is None:
            from popbert.tasks import TASKS

            raise UsageError(f"--model: {model} is a popbert {self.task} export, which "
                             f"`popbert serve` does not serve (it serves "
                             f"{', '.join(t for t in TASKS if predictor_class(t))})")
        self.path = model
        self.predictor: Any = predictor(model, threads, spinning=False,
                                        device=None if device == "cpu" else device)
        self.name = served_model_name or (model.stem if model.is_file() else model.name)
        if max_input_tokens is not None:  # only lowers the export's length, or it does nothing
            length = self.predictor.sequence_length
            if not self.predictor.dynamic_sequence and max_input_tokens != length:
                raise UsageError(f"--max-input-tokens {max_input_tokens}: {model} has a fixed "
                                 f"sequence length of {length}, which every input is cut or "
                                 "padded to; leave the flag out")
            if max_input_tokens > length:
                raise UsageError(f"--max-input-tokens {max_input_tokens}: {model} takes at most "
                                 f"{length} tokens (the length it was trained at); give at "
                                 "most that, or leave the flag out")
            self.predictor.sequence_length = max_input_tokens
        self.max_input_tokens = int(self.predictor.sequence_length)
        self.tokenizer = self.predictor.text_tokenizer
        # ONNX Runtime's dynamic INT8 scales activations by the whole batch's range.
        self.batch_dependent = (self.predictor.runtime == "ONNX Runtime"
                                and f"{METADATA_PREFIX}quantized" in self.predictor.meta)
        self.reranker = self.task == "classification" and (
            self.predictor.regression or len(self.predictor.labels or []) == 2)
        self.prompts: dict[str, str] = getattr(self.predictor, "prompts", {})
        self.default_prompt: str | None = None  # `use_default_prompt`

    def use_default_prompt(self, name: str | None = None, text: str | None = None) -> None:
        """Put the export's prompt `name`, or `text`, before every text whose request names no
        `prompt_name` (TEI's --default-prompt-name and --default-prompt)."""
        if name is None and text is None:
            return
        flag = "--default-prompt-name" if name is not None else "--default-prompt"
        if self.task != "embedding":
            raise UsageError(f"{flag}: {self.path} is a {self.task} export; a prompt is put "
                             "before an embedding model's texts")
        if name is not None:
            if name not in self.prompts:
                raise UsageError(f"{flag} {name}: {self.path} has "
                                 + (f"the prompts {', '.join(sorted(self.prompts))}"
                                    if self.prompts else "no prompts; give the prompt's text "
                                                         "with --default-prompt"))
            text = self.prompts[name]
        self.default_prompt = text

    # --- what describes the model ---------------------------------------------------------

    def info(self) -> dict[str, Any]:
        """The model's side of `GET /info`."""
        meta = self.predictor.meta
        out: dict[str, Any] = {
            "model_id": self.name, "model_path": str(self.path), "task": self.task,
            "runtime": self.predictor.runtime,
            "model_dtype": json_or_text(meta.get(f"{METADATA_PREFIX}dtype", "float32")),
            "quantized": f"{METADATA_PREFIX}quantized" in meta,
            "max_input_length": self.max_input_tokens,
            "vocab_size": self.tokenizer.vocab_size,
        }
        precision = meta.get(f"{METADATA_PREFIX}precision")
        if precision is not None:
            out["precision"] = json_or_text(precision)
        if self.task == "embedding":
            out.update(pooling=self.predictor.pooling, normalize=self.predictor.normalize,
                       prompts=sorted(self.prompts), default_prompt=self.default_prompt)
        labels = getattr(self.predictor, "labels", None)
        if labels is not None:
            out["labels"] = labels
        if self.task == "classification":
            out["reranker"] = self.reranker
        return out

    def routes(self) -> tuple[str, ...]:
        """The task routes this model answers."""
        if self.task == "embedding":
            token_states = TOKEN_STATES in self.predictor.output_names  # exports since 2026-11
            return ("/v1/embeddings", "/embed", *(("/embed_all",) if token_states else ()),
                    "/similarity", "/score", "/v1/score")
        if self.task != "classification":
            return ("/predict",)
        return (("/predict", "/classify", "/rerank", "/v1/rerank", "/v2/rerank", "/score",
                 "/v1/score") if self.reranker else ("/predict", "/classify"))

    def own_route(self) -> str:
        """The route `POST /` answers, as TEI picks it by the model's type: embeddings, a
        reranker's scores for a model of one output, else predictions."""
        if self.task == "embedding":
            return "/embed"
        if self.task == "classification" and self.predictor.regression:
            return "/rerank"
        return "/predict"

    def warm_up(self) -> None:
        """One request of the task's own kind, so the first client does not pay for it."""
        if self.task == "embedding":
            self.embed(["warm up"])
        elif self.task == "squad":
            self.answer([{"question": "warm up?", "context": "warm up"}])
        elif self.task == "token-classification":
            self.entities(["warm up"])
        else:
            self.classify(["warm up"])

    # --- the tasks -------------------------------------------------------------------------

    def check_length(self, texts: Sequence[str], truncate: bool, field: str,
                     pairs: Sequence[str] | None = None) -> None:
        """With `truncate` off, an input longer than the model takes is refused (413)."""
        if truncate:
            return
        firsts = self.tokenizer.encode_batch(list(texts))
        seconds = self.tokenizer.encode_batch(list(pairs)) if pairs is not None else None
        specials = 2 if pairs is None else 3
        for index, ids in enumerate(firsts):
            length = len(ids) + specials + (len(seconds[index]) if seconds else 0)
            if length > self.max_input_tokens:
                raise RequestError(413, f"{field}[{index}] has {length} tokens, more than the "
                                   f"model takes ({self.max_input_tokens}); send it with "
                                   "\"truncate\": true to have it cut", field)

    def embed(self, texts: Sequence[str], prompt_name: str | None = None,
              truncate: bool = True, field: str = "input", truncation_side: str = "right"
              ) -> tuple[np.ndarray, Usage]:
        """[N, H] vectors of `texts`, as `popbert predict embed` makes them; a text too long
        loses its end, or its start (`truncation_side="left"`)."""
        stats = PredictStats()
        texts = self._prompted(texts, prompt_name)
        self.check_length(texts, truncate, field)
        vectors = self.predictor.embed(list(texts), stats=stats,
                                       truncation_side=truncation_side)
        return vectors, Usage.of(stats, _characters(texts))

    def token_states(self, texts: Sequence[str], prompt_name: str | None = None,
                     truncate: bool = True, field: str = "inputs",
                     truncation_side: str = "right", max_tokens: int | None = None
                     ) -> tuple[list[np.ndarray], Usage]:
        """Each text's final hidden state at every token, [CLS] and [SEP] included ([tokens,
        H], not pooled, not normalised: TEI's `/embed_all`); cut as `embed` cuts. The answer
        holds a vector per token, so more than `max_tokens` tokens in all is a 413."""
        stats = PredictStats()
        texts = self._prompted(texts, prompt_name)
        self.check_length(texts, truncate, field)
        if max_tokens is not None:
            tokens = sum(min(len(ids) + 2, self.max_input_tokens)
                         for ids in self.tokenizer.encode_batch(list(texts)))
            if tokens > max_tokens:
                raise RequestError(413, f"{field}: {tokens} tokens in all, more than the "
                                   f"{max_tokens} whose states one answer may carry "
                                   "(max_batch_tokens); send fewer inputs per request", field)
        states = self.predictor.token_states(list(texts), stats=stats,
                                             truncation_side=truncation_side)
        return states, Usage.of(stats, _characters(texts))

    def _prompted(self, texts: Sequence[str], prompt_name: str | None) -> Sequence[str]:
        """`texts` with the model's prompt `prompt_name` put first (a 422 for one it lacks);
        without one, the server's default prompt, if it has one."""
        if prompt_name is None:
            prompt = self.default_prompt
        elif prompt_name in self.prompts:
            prompt = self.prompts[prompt_name]
        else:
            raise RequestError(422, f"prompt_name {prompt_name!r}: the model has "
                               + (f"the prompts {', '.join(sorted(self.prompts))}"
                                  if self.prompts else "no prompts"), "prompt_name")
        return texts if prompt is None else [prompt + text for text in texts]

    def embed_ids(self, rows: Sequence[Sequence[int]], truncate: bool = True,
                  field: str = "input") -> tuple[np.ndarray, Usage]:
        """Vectors of texts given as token ids (no special tokens: [CLS] and [SEP] are added),
        as OpenAI's API takes them."""
        stats = PredictStats()
        length = self.max_input_tokens
        arrays = {name: np.zeros((len(rows), length), np.int64)
                  for name in ("input_ids", "segment_ids", "input_mask")}
        arrays["input_ids"][:] = self.tokenizer.pad_id
        truncated = 0
        self.check_ids(rows, field)
        for row, ids in enumerate(rows):
            if len(ids) > length - 2:
                if not truncate:
                    raise RequestError(413, f"{field}[{row}] has {len(ids) + 2} tokens, more "
                                       f"than the model takes ({length}); send it with "
                                       "\"truncate\": true to have it cut", field)
                truncated += 1
                ids = ids[:length - 2]
            full = [self.tokenizer.cls_id, *ids, self.tokenizer.sep_id]
            arrays["input_ids"][row, :len(full)] = full
            arrays["input_mask"][row, :len(full)] = 1
        vectors = self.predictor.run(arrays, stats=stats)["embedding"].astype(np.float32)
        return vectors, Usage.of(stats, truncated=truncated)

    def check_ids(self, rows: Sequence[Sequence[int]], field: str) -> None:
        """A token id outside the model's vocabulary is a 422 naming its row."""
        vocab = self.tokenizer.vocab_size
        for row, ids in enumerate(rows):
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise RequestError(422, f"{field}[{row}]: token id {bad} is not in the model's "
                                   f"vocabulary of {vocab}", field)

    def shape_vectors(self, vectors: np.ndarray, dimensions: int | None,
                      normalize: bool = False) -> np.ndarray:
        """Vectors cut to `dimensions` (Matryoshka), normalised again when the model's are
        (or when `normalize` asks)."""
        if dimensions is not None:
            if dimensions > vectors.shape[1]:
                raise RequestError(422, f"dimensions {dimensions}: the model's vectors have "
                                   f"{vectors.shape[1]}", "dimensions")
            vectors = vectors[:, :dimensions]
        if normalize or (dimensions is not None and self.predictor.normalize):
            norms = np.linalg.norm(vectors, axis=1, keepdims=True)
            vectors = vectors / np.maximum(norms, 1e-12)
        return vectors

    def classify(self, inputs: Sequence[str | Sequence[str]], raw_scores: bool = False,
                 truncate: bool = True, field: str = "inputs", truncation_side: str = "right"
                 ) -> tuple[list[list[dict[str, Any]]], Usage]:
        """Each input's labels with their scores, best first (a regression model: its one
        score), as `popbert predict classify` computes them; an input too long loses the end
        (the start, `truncation_side="left"`) of its longer text."""
        texts = [item if isinstance(item, str) else item[0] for item in inputs]
        pairs = [item[1] for item in inputs if not isinstance(item, str)]
        if pairs and len(pairs) != len(texts):
            raise RequestError(422, f"{field}: give every input as a text, or every input as "
                               "a pair [text, text], not both in one request", field)
        second = pairs or None
        stats = PredictStats()
        self.check_length(texts, truncate, field, second)
        data = ClassificationData(Path("request"), texts, second, None,
                                  list(range(1, len(texts) + 1)),
                                  truncation_side=truncation_side)
        characters = _characters(texts) + _characters(pairs)
        predictor: ClassifyPredictor = self.predictor
        if predictor.regression:
            scores = (predictor.logits(data, stats=stats)[:, 0] if raw_scores
                      else predictor.scores(data, stats=stats))
            return ([[{"label": "score", "score": float(s)}] for s in scores],
                    Usage.of(stats, characters))
        values = (predictor.logits(data, stats=stats) if raw_scores
                  else predictor.probabilities(data, stats=stats))
        labels = predictor.labels or []
        out = []
        for row in values:
            order = np.argsort(-row, kind="stable")
            out.append([{"label": labels[i], "score": float(row[i])} for i in order])
        return out, Usage.of(stats, characters)

    def pair_scores(self, firsts: Sequence[str], seconds: Sequence[str],
                    raw_scores: bool = False, truncate: bool = True,
                    truncation_side: str = "right", field: str = "texts"
                    ) -> tuple[np.ndarray, Usage]:
        """The cross-encoder's score of each pair (firsts[i], seconds[i]), as `popbert predict
        rerank` scores them (raw: the logit, or a two-label model's logit difference); a
        pair too long loses the end (the start, `truncation_side="left"`) of its longer
        text."""
        if not self.reranker:
            raise RequestError(404, f"{self.name} is a classifier of "
                               f"{len(self.predictor.labels or [])} labels, not a reranker "
                               "(one output, or two labels)")
        stats = PredictStats()
        self.check_length(firsts, truncate, field, seconds)
        if raw_scores:
            data = ClassificationData(Path("request"), list(firsts), list(seconds), None,
                                      list(range(1, len(firsts) + 1)),
                                      truncation_side=truncation_side)
            logits = self.predictor.logits(data, stats=stats)
            scores = logits[:, 0] if self.predictor.regression else logits[:, 1] - logits[:, 0]
        else:
            scores = pair_scores(self.predictor, firsts, seconds, stats=stats,
                                 truncation_side=truncation_side)
        return scores, Usage.of(stats, _characters(firsts) + _characters(seconds))

    def rerank(self, query: str, texts: Sequence[str], raw_scores: bool = False,
               truncate: bool = True, return_text: bool = False,
               truncation_side: str = "right") -> tuple[list[dict[str, Any]], Usage]:
        """`texts` sorted by the cross-encoder's score for `query`, highest first, as `popbert
        predict rerank` sorts them."""
        scores, usage = self.pair_scores([query] * len(texts), texts, raw_scores, truncate,
                                         truncation_side)
        order = np.argsort(-scores, kind="stable")
        out = []
        for index in order:
            item: dict[str, Any] = {"index": int(index), "score": float(scores[index])}
            if return_text:
                item["text"] = texts[index]
            out.append(item)
        return out, usage

    def similarities(self, firsts: Sequence[str], seconds: Sequence[str],
                     prompt_name: str | None = None, truncate: bool = True,
                     truncation_side: str = "right") -> tuple[np.ndarray, Usage]:
        """The cosine similarity of each text of `seconds` to its text of `firsts` (one text
        of `firsts`: to that one), by the model's vectors."""
        vectors, usage = self.embed([*firsts, *seconds], prompt_name, truncate, "inputs",
                                    truncation_side)
        vectors = self.shape_vectors(vectors, None, normalize=True)
        return np.sum(vectors[:len(firsts)] * vectors[len(firsts):], axis=1), usage

    def first_tokens(self, texts: Sequence[str], count: int) -> tuple[list[str], int]:
        """Each text cut after its first `count` tokens (Cohere's `max_tokens_per_doc`), at
        the character where that token ends; and how many texts were cut."""
        encodings = self.tokenizer.backend.encode_batch(list(texts), add_special_tokens=False)
        out, cut = [], 0
        for text, encoding in zip(texts, encodings):
            if len(encoding.ids) > count:
                text = text[:encoding.offsets[count - 1][1]]
                cut += 1
            out.append(text)
        return out, cut

    def entities(self, texts: Sequence[str]) -> tuple[list[list[dict[str, Any]]], Usage]:
        """Each text's entities with character offsets, as `popbert predict ner` finds them in
        plain text."""
        stats = PredictStats()
        found = tag_texts(self.predictor, list(texts), stats=stats)
        return found, Usage.of(stats, _characters(texts))

    def answer(self, inputs: Sequence[dict[str, str]]) -> tuple[list[dict[str, Any]], Usage]:
        """Each (question, context)'s best answer, its probability among the n-best and its
        character span in the context, as `popbert predict squad` chooses it."""
        stats = PredictStats()
        questions = [Question(str(index), item["question"], item["context"], [], index)
                     for index, item in enumerate(inputs)]
        _, nbest = self.predictor.predict(questions, stats=stats)
        out = []
        for question in questions:
            best = nbest[question.id][0]
            out.append({"answer": best.text, "score": float(best.probability),
                        "start": best.start, "end": best.end})
        characters = sum(len(item["question"]) + len(item["context"]) for item in inputs)
        return out, Usage.of(stats, characters)

    def tokenize(self, texts: Sequence[str], add_special_tokens: bool = True,
                 prompt_name: str | None = None) -> list[list[dict[str, Any]]]:
        """Each text's tokens: id, text, whether special, and character span (TEI's form), of
        the text as the model gets it (its prompt first, as the embedding routes put it)."""
        backend = self.tokenizer.backend
        special_ids = self.tokenizer.special_ids
        out = []
        for text in self._prompted(texts, prompt_name):
            encoding = backend.encode(text, add_special_tokens=False)
            tokens = [{"id": int(i), "text": token, "special": False, "start": int(a),
                       "stop": int(b)}
                      for i, token, (a, b) in zip(encoding.ids, encoding.tokens,
                                                  encoding.offsets)]
            if add_special_tokens:
                cls_id, sep_id = self.tokenizer.cls_id, self.tokenizer.sep_id
                tokens = ([{"id": cls_id, "text": backend.id_to_token(cls_id), "special": True,
                            "start": None, "stop": None}] + tokens
                          + [{"id": sep_id, "text": backend.id_to_token(sep_id),
                              "special": True, "start": None, "stop": None}])
            for token in tokens:
                token["special"] = token["special"] or token["id"] in special_ids
            out.append(tokens)
        return out

    def decode(self, rows: Sequence[Sequence[int]], skip_special_tokens: bool = True
               ) -> list[str]:
        """Each row of token ids back to text, by the tokenizer's own decoder (TEI's
        `/decode`): word pieces joined, [CLS], [SEP] and the like left out unless asked."""
        self.check_ids(rows, "ids")
        return self.tokenizer.backend.decode_batch([list(ids) for ids in rows],
                                                   skip_special_tokens=skip_special_tokens)


def _characters(texts: Sequence[str]) -> int:
    return sum(len(text) for text in texts)


def json_or_text(value: str) -> Any:
    """A metadata value: JSON where it is JSON, else the text."""
    try:
        return json.loads(value)
    except ValueError:
        return value


def encode_vectors(vectors: np.ndarray, encoding_format: str) -> list[Any]:
    """OpenAI's `embedding` field: floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return [base64.b64encode(np.ascontiguousarray(v, "<f4").tobytes()).decode("ascii")
                for v in vectors]
    return vectors.tolist()


__all__ = ["RequestError", "Served", "Usage", "encode_vectors", "json_or_text"]
