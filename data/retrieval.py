"""Retrieval and reranking data: a BEIR-layout directory (`corpus.jsonl`, `queries.jsonl`,
`qrels/<split>.tsv`) and the ranking metrics search is judged by (nDCG@10, MRR@10, Recall@100),
computed as trec_eval computes them (`pytrec_eval` agrees in the tests).

A ranking ("run") is each query's scored documents; documents of equal score are ordered by
their id, descending, as trec_eval orders them, so a metric never depends on dict order.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from popbert.data.errors import DataError
from popbert.data.rows import json_lines
from popbert.textfile import read_text

Run = Mapping[str, Mapping[str, float]]  # query id → document id → score
Qrels = Mapping[str, Mapping[str, int]]  # query id → document id → relevance grade


@dataclass
class RetrievalSet:
    """A BEIR directory read whole: document and query texts by id, and the judged pairs."""

    directory: Path
    corpus: dict[str, str]  # "title. text" (the title, when there is one, first)
    queries: dict[str, str]
    qrels: dict[str, dict[str, int]]  # only queries with a judgement, only judged documents


def _jsonl(path: Path, what: str) -> list[tuple[int, dict]]:
    if not path.is_file():
        raise DataError(f"{path}: not found; a BEIR directory holds corpus.jsonl, queries.jsonl "
                        "and qrels/<split>.tsv")
    rows = json_lines(path, read_text(path, f"{what} JSON lines"))
    for number, row in rows:
        if not isinstance(row.get("_id"), str | int) or not isinstance(row.get("text"), str):
            raise DataError(f"{path}:{number}: expected an object with \"_id\" and \"text\"")
    if not rows:
        raise DataError(f"{path}: no {what}")
    return rows


def read_beir(directory: str | Path, split: str = "test") -> RetrievalSet:
    """Read a BEIR directory; a qrels line naming a query or document the files lack, a grade
    that is not an integer, or a split with no judgement is one DataError naming the line."""
    directory = Path(directory)
    corpus: dict[str, str] = {}
    for _, row in _jsonl(directory / "corpus.jsonl", "documents"):
        title = str(row.get("title") or "").strip()
        corpus[str(row["_id"])] = f"{title}. {row['text']}" if title else row["text"]
    queries = {str(row["_id"]): row["text"]
               for _, row in _jsonl(directory / "queries.jsonl", "queries")}
    path = directory / "qrels" / f"{split}.tsv"
    if not path.is_file():
        found = sorted(p.stem for p in (directory / "qrels").glob("*.tsv"))
        raise DataError(f"{path}: not found (splits here: {', '.join(found) or 'none'})")
    qrels: dict[str, dict[str, int]] = {}
    lines = read_text(path, "qrels (query-id, corpus-id, score)").splitlines()
    for number, fields in enumerate(csv.reader(lines, delimiter="\t"), 1):
        if not fields or number == 1 and fields[0] == "query-id":
            continue
        if len(fields) < 3:
            raise DataError(f"{path}:{number}: expected query-id, corpus-id and score")
        query, document, grade = fields[0], fields[1], fields[2]
        if query not in queries:
            raise DataError(f"{path}:{number}: query {query!r} is not in queries.jsonl")
        if document not in corpus:
            raise DataError(f"{path}:{number}: document {document!r} is not in corpus.jsonl")
        try:
            qrels.setdefault(query, {})[document] = int(grade)
        except ValueError:
            raise DataError(f"{path}:{number}: grade {grade!r} is not an integer") from None
    if not any(grade > 0 for judged in qrels.values() for grade in judged.values()):
        raise DataError(f"{path}: no relevant document (grade > 0) for any query")
    return RetrievalSet(directory, corpus, queries, qrels)


def ranked(scores: Mapping[str, float]) -> list[str]:
    """Document ids by score, highest first; ties by id, descending (trec_eval's order)."""
    by_id = sorted(scores, reverse=True)
    return sorted(by_id, key=lambda document: -scores[document])


def run_of(scores: Any, queries: Sequence[str], documents: Sequence[str]
           ) -> dict[str, dict[str, float]]:
    """A [queries, documents] score matrix as a run (query id → document id → score)."""
    return {query: dict(zip(documents, map(float, scores[row])))
            for row, query in enumerate(queries)}


def unit_rows(vectors: Any) -> np.ndarray:
    """Each row divided by its L2 norm (at least 1e-12), in float64: cosines are dot products."""
    vectors = np.asarray(vectors, np.float64)
    return vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)


def exact_search_metrics(retrieval: RetrievalSet,
                         embed_queries: Callable[[list[str]], Any],
                         embed_documents: Callable[[list[str]], Any]) -> dict[str, float]:
    """Embed the judged queries and the whole corpus, rank every document for each query by
    the cosine of their vectors (exact search, no index) and score the ranking
    (`ranking_metrics`): what `popbert evaluate retrieval` and an embedding fine-tune report."""
    documents, queries = sorted(retrieval.corpus), sorted(retrieval.qrels)
    asked = unit_rows(embed_queries([retrieval.queries[q] for q in queries]))
    corpus = unit_rows(embed_documents([retrieval.corpus[d] for d in documents]))
    return ranking_metrics(run_of(asked @ corpus.T, queries, documents), retrieval.qrels)


def ranking_metrics(run: Run, qrels: Qrels, k: int = 10, recall_k: int = 100
                    ) -> dict[str, float]:
    """nDCG@k (trec_eval's ndcg_cut: gain = grade, log2 discount), MRR@k (the reciprocal rank
    of the first relevant document in the top k) and Recall@recall_k, averaged over the judged
    queries with a relevant document (a query the run lacks scores 0)."""
    ndcg = mrr = recall = 0.0
    judged = [q for q, docs in qrels.items() if any(g > 0 for g in docs.values())]
    if not judged:
        raise DataError("no judged query with a relevant document to evaluate")
    for query in judged:
        grades = qrels[query]
        order = ranked(run.get(query, {}))
        gains = [max(grades.get(document, 0), 0) for document in order[:k]]
        dcg = sum(g / math.log2(rank + 2) for rank, g in enumerate(gains))
        ideal = sorted((g for g in grades.values() if g > 0), reverse=True)[:k]
        ndcg += dcg / sum(g / math.log2(rank + 2) for rank, g in enumerate(ideal))
        first = next((rank for rank, g in enumerate(gains) if g > 0), None)
        mrr += 0.0 if first is None else 1.0 / (first + 1)
        relevant = {d for d, g in grades.items() if g > 0}
        recall += len(relevant & set(order[:recall_k])) / len(relevant)
    n = len(judged)
    return {f"ndcg@{k}": ndcg / n, f"mrr@{k}": mrr / n, f"recall@{recall_k}": recall / n,
            "queries": n}


__all__ = ["Qrels", "RetrievalSet", "Run", "exact_search_metrics", "ranked", "ranking_metrics",
           "read_beir", "run_of", "unit_rows"]
