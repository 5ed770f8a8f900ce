"""Reranking with a cross-encoder: a `classification` export that scores (query, passage) pairs
— one output (`finetune classify --regression`, or transformers' `num_labels=1`), or two labels
whose second is "relevant" — ranks candidates by that score (`popbert predict rerank`) and is
judged on a BEIR directory by nDCG@10, MRR@10 and Recall@100 (`popbert evaluate rerank`). An
imported sentence-transformers CrossEncoder's score goes through its activation (sigmoid), so
the scores are `CrossEncoder.predict`'s; the ranking is the logits' either way.

Torch-free, as `popbert.serve.predict` is: ONNX Runtime or OpenVINO run the export.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from popbert.atomic import atomic_write_text
from popbert.data.classification import ClassificationData
from popbert.data.retrieval import ranked, ranking_metrics, read_beir, run_of
from popbert.errors import UsageError
from popbert.serve.predict import ClassifyPredictor, PredictStats
from popbert.textfile import lone_surrogate, read_text

log = logging.getLogger(__name__)


def pair_scores(predictor: ClassifyPredictor, queries: Sequence[str], passages: Sequence[str],
                batch_size: int = 32, stats: PredictStats | None = None,
                truncation_side: str = "right") -> np.ndarray:
    """The cross-encoder's score of each (query, passage) pair: its one output (through the
    activation a CrossEncoder records), or a two-label classifier's probability of its second
    label. A pair too long loses tokens from the end (the start, `truncation_side="left"`)
    of its longer text."""
    if not predictor.regression and len(predictor.labels or []) != 2:
        raise UsageError(f"--model: {predictor.path} is a classifier of "
                         f"{len(predictor.labels or [])} labels; a reranker scores pairs with "
                         "one output (finetune classify --regression) or two labels")
    data = ClassificationData(Path("pairs"), list(queries), list(passages), None,
                              list(range(1, len(queries) + 1)), truncation_side=truncation_side)
    if predictor.regression:
        return predictor.scores(data, batch_size, stats)
    return predictor.probabilities(data, batch_size, stats)[:, 1]


def read_candidates(path: Path) -> list[tuple[int, str, list[tuple[Any, str]]]]:
    """(line, query, [(id, text)]) of each row of a rerank file: JSON lines with "query" and
    "candidates" (texts, or objects with "text" and an optional "id")."""
    rows = []
    for number, line in enumerate(read_text(path, "JSON lines of a query and its candidates",
                                            error=UsageError).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise UsageError(f"--data {path}:{number}: not JSON ({error.msg})") from None
        bad = lone_surrogate(line, row)
        if bad is not None:
            raise UsageError(f"--data {path}:{number}: {bad}")
        query = row.get("query") if isinstance(row, dict) else None
        given = row.get("candidates") if isinstance(row, dict) else None
        if not isinstance(query, str) or not query.strip() or not isinstance(given, list) \
                or not given:
            raise UsageError(f"--data {path}:{number}: expected {{\"query\": text, "
                             "\"candidates\": [text or {\"id\", \"text\"}, ...]}} with a query "
                             "and at least one candidate")
        candidates = []
        for index, item in enumerate(given):
            text = item.get("text") if isinstance(item, dict) else item
            if not isinstance(text, str) or not text.strip():
                raise UsageError(f"--data {path}:{number}: candidate {index} has no text")
            candidates.append((item.get("id", index) if isinstance(item, dict) else index,
                               text))
        rows.append((number, query, candidates))
    if not rows:
        raise UsageError(f"--data {path}: no rows")
    return rows


def predict_rerank(model: Path, data: Path, output: Path, batch_size: int = 32,
                   threads: int | None = None, device: str | None = None) -> int:
    """`popbert predict rerank`: each row's candidates sorted by the model's score, highest
    first, written as JSON lines (`line`, `query`, `ranked`: [{`id`, `text`, `score`}]).
    Returns the rows written."""
    predictor = ClassifyPredictor(model, threads, device=device)
    rows = read_candidates(Path(data))  # read whole before any work: a bad row writes nothing
    stats = PredictStats()
    started = time.perf_counter()
    queries = [query for _, query, candidates in rows for _ in candidates]
    passages = [text for _, _, candidates in rows for _, text in candidates]
    scores = pair_scores(predictor, queries, passages, batch_size, stats)
    stats.seconds += time.perf_counter() - started
    records, first = [], 0
    for number, query, candidates in rows:
        mine = scores[first:first + len(candidates)]
        first += len(candidates)
        order = np.argsort(-mine, kind="stable")
        records.append(json.dumps({"line": number, "query": query, "ranked": [
            {"id": candidates[i][0], "text": candidates[i][1], "score": float(mine[i])}
            for i in order]}) + "\n")
    Path(output).parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(output, "".join(records))
    log.info("reranked %d queries (%d pairs) with %s: %s", len(rows), len(passages), model,
             output)
    log.info("predict: %s", stats.describe("pairs", "pairs"))
    return len(rows)


def evaluate_rerank(model: Path, directory: Path, split: str = "test",
                    run_output: Path | None = None, batch_size: int = 32,
                    threads: int | None = None, device: str | None = None) -> dict[str, float]:
    """`popbert evaluate rerank`: score every (judged query, document) pair of a BEIR
    directory, rank each query's documents by score and return nDCG@10, MRR@10 and
    Recall@100; with `run_output`, write the ranking in TREC's run format (top 1000)."""
    predictor = ClassifyPredictor(model, threads, device=device)
    beir = read_beir(directory, split)
    documents = sorted(beir.corpus)
    queries = sorted(beir.qrels)
    stats = PredictStats()
    started = time.perf_counter()
    scores = pair_scores(predictor, [beir.queries[q] for q in queries for _ in documents],
                         [beir.corpus[d] for _ in queries for d in documents], batch_size,
                         stats).reshape(len(queries), len(documents))
    stats.seconds += time.perf_counter() - started
    run = run_of(scores, queries, documents)
    metrics = ranking_metrics(run, beir.qrels)
    log.info("reranked %d documents for each of %d queries of %s: nDCG@10 %.4f, MRR@10 %.4f",
             len(documents), len(queries), directory, metrics["ndcg@10"], metrics["mrr@10"])
    log.info("predict: %s", stats.describe("pairs", "pairs"))
    if run_output is not None:
        lines = [f"{q} Q0 {d} {rank} {run[q][d]:.6g} popbert"
                 for q in queries for rank, d in enumerate(ranked(run[q])[:1000], 1)]
        Path(run_output).parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(run_output, "\n".join(lines) + "\n")
    return {**metrics, "documents": len(documents), "pairs": len(queries) * len(documents)}


__all__ = ["evaluate_rerank", "pair_scores", "predict_rerank", "read_candidates"]
