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

from popbert.atomic import atomic_write_text
from popbert.data.token_classification import (
    TaggedData,
    decode_tags,
    encode_tagged,
    entity_metrics,
    read_tagged,
    write_conll,
)
from popbert.serve.predict import ExportedModel, PredictStats

log = logging.getLogger(__name__)

TASK = "token-classification"


class TagPredictor(ExportedModel):
    """An exported `token-classification` model: words in, IOB2 tags out."""

    def __init__(self, model: Path, threads: int | None = None) -> None:
        super().__init__(model, TASK, threads)
        self.labels = [str(x) for x in json.loads(self.text("labels"))]

    def tags(self, data: TaggedData, batch_size: int = 16,
             stats: PredictStats | None = None) -> list[list[str]]:
        """Each sentence's tags, one per word."""
        arrays, windows = encode_tagged(data, self.text_tokenizer, None, self.sequence_length)
        # padded back to the full length: each word is read at its own piece
        logits = self.run(arrays, batch_size, per_token={"logits": 0.0}, stats=stats)["logits"]
        if stats is not None:
            stats.examples += len(data.sentences)
        return decode_tags(data, windows, logits.argmax(axis=-1), self.labels)


def predict_ner(model: Path, data: Path, output: Path, batch_size: int = 16,
                threads: int | None = None, scheme: str | None = None
                ) -> dict[str, Any] | None:
    """`popbert predict ner`: tag every word of `data` (CoNLL: the word first; or JSON lines of
    "tokens"), write `output` in the same format (CoNLL with the predicted tag as the last
    column, one line per input word; JSON lines with "tags"), and return entity precision,
    recall and F1 when the file has tags (else None)."""
    predictor = TagPredictor(model, threads)
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


__all__ = ["TagPredictor", "predict_ner"]
