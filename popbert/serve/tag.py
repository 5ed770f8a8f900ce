"""Tagging with a `token-classification` export (`popbert predict ner`): each word of a CoNLL or
JSON-lines file gets the model's IOB2 tag — the prediction at its first sub-token, long sentences
in the same overlapping windows fine-tuning used — written back in the file's own format, and
scored by entity precision, recall and F1 (seqeval's) when the file has tags.

Torch-free, as `popbert.serve.predict` is: ONNX Runtime or OpenVINO run the export.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np

from popbert.atomic import atomic_write_text
from popbert.data.token_classification import (
    TaggedData,
    TaggedSentence,
    decode_tags,
    encode_tagged,
    entity_metrics,
    read_tagged,
    write_conll,
)
from popbert.errors import UsageError
from popbert.serve.predict import ExportedModel, PredictStats
from popbert.textfile import read_text

log = logging.getLogger(__name__)

TASK = "token-classification"


class TagPredictor(ExportedModel):
    """An exported `token-classification` model: words in, IOB2 tags out."""

    def __init__(self, model: Path, threads: int | None = None, spinning: bool = True,
                 device: str | None = None) -> None:
        super().__init__(model, TASK, threads, spinning, device)
        self.labels = [str(x) for x in json.loads(self.text("labels"))]

    def calibration_arrays(self, data: Path) -> dict[str, np.ndarray]:
        """The windows of the sentences of `data` (CoNLL or JSON lines; tags not needed)."""
        arrays, _ = encode_tagged(read_tagged(data, require_tags=False), self.text_tokenizer,
                                  None, self.sequence_length)
        return arrays

    def tags(self, data: TaggedData, batch_size: int = 16,
             stats: PredictStats | None = None) -> list[list[str]]:
        """Each sentence's tags, one per word."""
        arrays, windows = encode_tagged(data, self.text_tokenizer, None, self.sequence_length)
        # padded back to the full length: each word is read at its own piece
        logits = self.run(arrays, batch_size, stats=stats)["logits"]
        if stats is not None:
            stats.examples += len(data.sentences)
        return decode_tags(data, windows, logits.argmax(axis=-1), self.labels)


def _words(tokenizer: Any, text: str) -> list[tuple[int, int]]:
    """The (start, end) character spans of `text`'s words, as the tokenizer's pre-tokenizer
    splits them (BERT's: whitespace and each punctuation mark), from its offsets."""
    encoding = tokenizer.backend.encode(text, add_special_tokens=False)
    spans: dict[int, list[int]] = {}
    for word, (start, end) in zip(encoding.word_ids, encoding.offsets):
        if word is not None:
            span = spans.setdefault(word, [start, end])
            span[1] = max(span[1], end)
    return [(start, end) for start, end in spans.values() if end > start]


def _entities(text: str, spans: list[tuple[int, int]], tags: list[str], scores: list[float],
              pieces: list[list[int]], tokenizer: Any) -> list[dict[str, Any]]:
    """Words grouped into entities as transformers' token-classification pipeline does with
    `aggregation_strategy="first"`: a word takes its first piece's label and score; a B- tag or
    a change of type starts a group, an I- of the same type continues it; groups of O are left
    out. Each: `entity_group`, `score` (the mean of its words'), `word` (its pieces decoded),
    `start`, `end` (character offsets into the text)."""
    groups: list[list[int]] = []
    for index, tag in enumerate(tags):
        prefix, _, kind = tag.partition("-")
        previous = tags[groups[-1][-1]].partition("-")[2] if groups else None
        if groups and kind == previous and prefix != "B" and tag != "O" \
                and tags[groups[-1][-1]] != "O":
            groups[-1].append(index)
        else:
            groups.append([index])
    entities = []
    for group in groups:
        if tags[group[0]] == "O":
            continue
        ids = [piece for index in group for piece in pieces[index]]
        entities.append({"entity_group": tags[group[0]].partition("-")[2],
                         "score": float(np.mean([scores[i] for i in group])),
                         "word": tokenizer.backend.decode(ids),
                         "start": spans[group[0]][0], "end": spans[group[-1]][1]})
    return entities


def tag_texts(predictor: TagPredictor, texts: list[str], batch_size: int = 16,
              stats: PredictStats | None = None) -> list[list[dict[str, Any]]]:
    """The entities of each text (`_entities`), its words tagged in windows as fine-tuning
    tagged them."""
    spans = [_words(predictor.text_tokenizer, text) for text in texts]
    data = TaggedData(Path("texts"), [TaggedSentence([text[a:b] for a, b in words], None, n)
                                      for n, (text, words) in enumerate(zip(texts, spans), 1)
                                      if words], "IOB2", "IOB2")
    if not data.sentences:  # no text has a word (empty, or only characters that tokenize away)
        if stats is not None:
            stats.examples += len(texts)
        return [[] for _ in texts]
    arrays, windows = encode_tagged(data, predictor.text_tokenizer, None,
                                    predictor.sequence_length)
    logits = predictor.run(arrays, batch_size, stats=stats)["logits"]
    if stats is not None:
        stats.examples += len(texts)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    probabilities = shifted / shifted.sum(axis=-1, keepdims=True)
    firsts: dict[tuple[int, int], np.ndarray] = {}
    for row, window in enumerate(windows):  # each word's first piece, in the window it has
        for position in np.flatnonzero(window.scored):
            firsts[(window.sentence, int(window.word_ids[position]))] = probabilities[row,
                                                                                      position]
    results, sentence = [], 0
    for text, words in zip(texts, spans):
        if not words:
            results.append([])
            continue
        chosen = [firsts[(sentence, w)] for w in range(len(words))]
        tags = [predictor.labels[int(p.argmax())] for p in chosen]
        pieces = [predictor.text_tokenizer.backend.encode(text[a:b], add_special_tokens=False)
                  .ids for a, b in words]
        results.append(_entities(text, words, tags, [float(p.max()) for p in chosen], pieces,
                                 predictor.text_tokenizer))
        sentence += 1
    return results


def predict_ner(model: Path, data: Path, output: Path, batch_size: int = 16,
                threads: int | None = None, scheme: str | None = None,
                device: str | None = None) -> dict[str, Any] | None:
    """`popbert predict ner`: tag every word of `data` (CoNLL: the word first; or JSON lines of
    "tokens"), write `output` in the same format (CoNLL with the predicted tag as the last
    column, one line per input word; JSON lines with "tags"), and return entity precision,
    recall and F1 when the file has tags (else None)."""
    predictor = TagPredictor(model, threads, device=device)
    if Path(data).suffix.lower() == ".txt" and not _looks_tagged(Path(data)):
        return _predict_texts(predictor, Path(data), Path(output), batch_size)
    tagged = read_tagged(Path(data), scheme, require_tags=False)
    stats = PredictStats()
    started = time.perf_counter()
    predicted = predictor.tags(tagged, batch_size, stats)
    stats.seconds += time.perf_counter() - started
    if Path(data).suffix.lower() in (".jsonl", ".json"):
        Path(output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(output, "".join(
            json.dumps({"tokens": sentence.words, "tags": tags}) + "\n"
            for sentence, tags in zip(tagged.sentences, predicted)))
    else:
        write_conll(Path(output), tagged, predicted)
    log.info("tagged %d sentences of %s with %s: %s", len(predicted), data, model, output)
    log.info("predict: %s", stats.describe("sentences"))
    if any(sentence.tags is None for sentence in tagged.sentences):
        return None
    metrics = entity_metrics([s.tags or [] for s in tagged.sentences], predicted)
    metrics.pop("per_type", None)
    return {**metrics, "sentences": len(predicted), **stats.summary()}


def _looks_tagged(path: Path) -> bool:
    """Whether a .txt file is CoNLL (a word and its tag a line) rather than plain text: its
    first line has two or more columns, the last of them a tag (O, or B-/I-/E-/S-...)."""
    first = next((line for line in read_text(path, "CoNLL or plain text").splitlines()
                  if line.strip() and not line.startswith("-DOCSTART-")), "")
    cells = first.split()
    return len(cells) >= 2 and (cells[-1] == "O" or cells[-1][:2] in ("B-", "I-", "E-", "S-"))


def _predict_texts(predictor: TagPredictor, data: Path, output: Path,
                   batch_size: int) -> None:
    """Plain text, a text a line: one JSON line per text with its `entities`."""
    lines = [(n, line) for n, line in enumerate(read_text(data, "plain text, a text a line")
                                                .splitlines(), 1) if line.strip()]
    if not lines:
        raise UsageError(f"--data {data}: no text lines")
    stats = PredictStats()
    started = time.perf_counter()
    found = tag_texts(predictor, [line for _, line in lines], batch_size, stats)
    stats.seconds += time.perf_counter() - started
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, "".join(
        json.dumps({"line": n, "text": text, "entities": entities}) + "\n"
        for (n, text), entities in zip(lines, found)))
    log.info("found %d entities in %d texts of %s: %s", sum(map(len, found)), len(lines),
             data, output)
    log.info("predict: %s", stats.describe("texts"))
    return None


__all__ = ["TagPredictor", "predict_ner", "tag_texts"]
