"""Sentence embeddings from an `embedding` export (`popbert predict embed`): one vector per
text, pooled and (when the export says so) normalised inside the graph, as
sentence-transformers' `encode` computes it from the same folder.

Torch-free, as `popbert.serve.predict` is: ONNX Runtime or OpenVINO run the export.
"""

from __future__ import annotations

import io
import json
import logging
import time
from pathlib import Path

import numpy as np

from popbert.atomic import atomic_write_bytes, atomic_write_text
from popbert.data.classification import ClassificationData, encode_classification_counted
from popbert.errors import UsageError
from popbert.graph.annotations import METADATA_PREFIX
from popbert.serve.predict import ExportedModel, PredictStats, read_texts
from popbert.tasks.embedding import TOKEN_STATES

log = logging.getLogger(__name__)

FORMATS = ("jsonl", "npy")


class EmbedPredictor(ExportedModel):
    """An exported `embedding` model: texts in, vectors out (its pooling, normalisation and
    prompts from its metadata)."""

    def __init__(self, model: Path, threads: int | None = None, spinning: bool = True,
                 device: str | None = None) -> None:
        super().__init__(model, "embedding", threads, spinning, device)
        self.pooling = json.loads(self.meta.get(f"{METADATA_PREFIX}pooling", '"mean"'))
        self.normalize = bool(json.loads(self.meta.get(f"{METADATA_PREFIX}normalize", "false")))
        self.prompts: dict[str, str] = json.loads(self.meta.get(f"{METADATA_PREFIX}prompts",
                                                                "{}"))

    def calibration_arrays(self, data: Path) -> dict[str, np.ndarray]:
        """Every text of the pairs file `data` (anchors, positives, negatives)."""
        from popbert.data.embedding_pairs import encode_texts, read_pairs

        texts = [text for row in read_pairs(data).texts for text in row]
        arrays, _ = encode_texts(texts, self.text_tokenizer, self.sequence_length)
        return arrays

    def embed(self, texts: list[str], batch_size: int = 32, prompt: str | None = None,
              stats: PredictStats | None = None, truncation_side: str = "right"
              ) -> np.ndarray:
        """[N, H] float32 vectors of `texts`, each with the model's `prompt` put first; a text
        too long loses its end (its start, `truncation_side="left"`)."""
        vectors, _ = self._run_texts(texts, "embedding", batch_size, prompt, stats,
                                     truncation_side)
        return vectors.astype(np.float32)

    def token_states(self, texts: list[str], batch_size: int = 32, prompt: str | None = None,
                     stats: PredictStats | None = None, truncation_side: str = "right"
                     ) -> list[np.ndarray]:
        """Each text's final hidden state at every token it fed the model, [CLS] and [SEP]
        included ([tokens, H] float32, before pooling): what sentence-transformers' `encode(
        output_value="token_embeddings")` gives. Cut as `embed` cuts."""
        states, lengths = self._run_texts(texts, TOKEN_STATES, batch_size, prompt, stats,
                                          truncation_side)
        return [row[:length].astype(np.float32) for row, length in zip(states, lengths)]

    def _run_texts(self, texts: list[str], output: str, batch_size: int, prompt: str | None,
                   stats: PredictStats | None, truncation_side: str
                   ) -> tuple[np.ndarray, np.ndarray]:
        """The export's `output` for `texts` (the prompt put first), and each text's tokens."""
        if prompt is not None:
            if prompt not in self.prompts:
                raise UsageError(f"--prompt {prompt}: {self.path} has "
                                 + (f"the prompts {', '.join(self.prompts)}" if self.prompts
                                    else "no prompts"))
            texts = [self.prompts[prompt] + text for text in texts]
        data = ClassificationData(Path("texts"), list(texts), None, None,
                                  list(range(1, len(texts) + 1)),
                                  truncation_side=truncation_side)
        arrays, truncated = encode_classification_counted(data, self.text_tokenizer,
                                                          self.sequence_length)
        value = self.run(arrays, batch_size, stats=stats, outputs=[output])[output]
        if stats is not None:
            stats.examples += len(texts)
            stats.truncated = (stats.truncated or 0) + truncated
        return value, arrays["input_mask"].sum(axis=1)


def predict_embed(model: Path, data: Path, output: Path, batch_size: int = 32,
                  threads: int | None = None, fmt: str | None = None,
                  prompt: str | None = None, text_column: str | None = None,
                  device: str | None = None) -> int:
    """`popbert predict embed`: the vector of every text of `data` (a .txt file, a text a line,
    or rows as `predict classify` reads them), written as JSON lines (`line`, `embedding`) or,
    `fmt="npy"` (default for a .npy output), one [N, H] float32 array. Returns the texts."""
    fmt = fmt or ("npy" if Path(output).suffix.lower() == ".npy" else "jsonl")
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt}: expected one of {', '.join(FORMATS)}")
    predictor = EmbedPredictor(model, threads, device=device)
    rows = read_texts(data, text_column)
    stats = PredictStats()
    started = time.perf_counter()
    vectors = predictor.embed(rows.texts, batch_size, prompt, stats)
    stats.seconds += time.perf_counter() - started
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    if fmt == "npy":
        buffer = io.BytesIO()
        np.save(buffer, vectors)
        atomic_write_bytes(output, buffer.getvalue())
    else:
        atomic_write_text(output, "".join(
            json.dumps({"line": line, "embedding": [float(x) for x in vector]}) + "\n"
            for line, vector in zip(rows.lines, vectors)))
    log.info("embedded %d texts of %s with %s (%s pooling%s): %s", len(vectors), data, model,
             predictor.pooling, ", normalised" if predictor.normalize else "", output)
    log.info("predict: %s", stats.describe("texts"))
    return len(vectors)


def evaluate_retrieval(model: Path, directory: Path, split: str = "test",
                       batch_size: int = 32, threads: int | None = None,
                       query_prompt: str | None = None,
                       document_prompt: str | None = None,
                       device: str | None = None) -> dict[str, float]:
    """`popbert evaluate retrieval`: embed a BEIR directory's judged queries and its whole
    corpus, rank every document for each query by cosine similarity (exact search) and return
    nDCG@10, MRR@10 and Recall@100 (`popbert.data.retrieval.ranking_metrics`)."""
    from popbert.data.retrieval import exact_search_metrics, read_beir

    predictor = EmbedPredictor(model, threads, device=device)
    beir = read_beir(directory, split)
    stats = PredictStats()
    started = time.perf_counter()
    metrics = exact_search_metrics(
        beir, lambda texts: predictor.embed(texts, batch_size, query_prompt, stats),
        lambda texts: predictor.embed(texts, batch_size, document_prompt, stats))
    stats.seconds += time.perf_counter() - started
    log.info("retrieved from %d documents for %d queries of %s: nDCG@10 %.4f, MRR@10 %.4f",
             len(beir.corpus), len(beir.qrels), directory, metrics["ndcg@10"],
             metrics["mrr@10"])
    log.info("predict: %s", stats.describe("texts"))
    return {**metrics, "documents": len(beir.corpus)}


__all__ = ["FORMATS", "EmbedPredictor", "evaluate_retrieval", "predict_embed"]
