"""Reranking: the ranking metrics against trec_eval's (pytrec_eval), a BEIR directory's bad
lines, and a cross-encoder export through `popbert predict rerank` and `popbert evaluate rerank`.

Tolerance for the metrics: 1e-12 (the same sums in float64; ties ordered as trec_eval orders
them, by document id descending)."""

from __future__ import annotations

import json
import shutil
import statistics
from pathlib import Path

import numpy as np
import pytest
import pytrec_eval

from popbert.cli.main import main
from popbert.data.errors import DataError
from popbert.data.retrieval import ranking_metrics, read_beir

FIXTURES = Path(__file__).parent.parent / "fixtures"
BEIR = FIXTURES / "retrieval"  # 30 inverse-cloze queries over 60 Wikipedia leads (README)
RELATEDNESS = FIXTURES / "classification" / "relatedness.tsv"


def trec_eval(run: dict, qrels: dict) -> dict[str, float]:
    """nDCG@10, MRR@10 (recip_rank of the top 10) and Recall@100 by pytrec_eval."""
    top10 = {q: dict(sorted(sorted(docs.items(), reverse=True), key=lambda kv: -kv[1])[:10])
             for q, docs in run.items()}  # trec_eval's order: score, then id descending
    full = pytrec_eval.RelevanceEvaluator(qrels, {"ndcg_cut_10", "recall_100"}).evaluate(run)
    cut = pytrec_eval.RelevanceEvaluator(qrels, {"recip_rank"}).evaluate(top10)
    return {"ndcg@10": statistics.mean(r["ndcg_cut_10"] for r in full.values()),
            "recall@100": statistics.mean(r["recall_100"] for r in full.values()),
            "mrr@10": statistics.mean(r["recip_rank"] for r in cut.values())}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ranking_metrics_are_trec_evals(seed: int) -> None:
    rng = np.random.default_rng(seed)
    documents = [f"d{i}" for i in range(150)]
    qrels = {f"q{q}": {d: int(rng.integers(0, 4)) for d in rng.choice(documents, 12,
                                                                       replace=False)}
             for q in range(20)}
    # graded judgements, unjudged documents, and tied scores (rounded to 1 decimal)
    run = {q: {d: float(np.round(rng.normal(), 1)) for d in documents} for q in qrels}
    qrels = {q: judged for q, judged in qrels.items() if any(g > 0 for g in judged.values())}
    ours = ranking_metrics(run, qrels)
    theirs = trec_eval(run, qrels)
    for key, value in theirs.items():
        assert ours[key] == pytest.approx(value, abs=1e-12), key


def test_a_beir_directory_is_read_and_its_bad_lines_named(tmp_path: Path) -> None:
    beir = read_beir(BEIR)
    assert len(beir.corpus) == 60 and len(beir.queries) == 30 and len(beir.qrels) == 30
    bad = tmp_path / "beir"
    shutil.copytree(BEIR, bad)
    qrels = bad / "qrels" / "test.tsv"
    qrels.write_text(qrels.read_text() + "q1\td999\t1\n")
    with pytest.raises(DataError, match=r"test.tsv:32: document 'd999' is not in corpus.jsonl"):
        read_beir(bad)
    qrels.write_text("query-id\tcorpus-id\tscore\nq1\td1\tvery\n")
    with pytest.raises(DataError, match=r"test.tsv:2: grade 'very' is not an integer"):
        read_beir(bad)
    with pytest.raises(DataError, match=r"dev.tsv: not found \(splits here: test\)"):
        read_beir(bad, "dev")


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny pair scorer: pre-trained two steps, fine-tuned with --regression, exported."""
    root = tmp_path_factory.mktemp("rerank")
    assert main(["pretrain", "--config", "tiny", "--set", "training.steps=2", "--set",
                 "model.num_layers=1", "--set", "model.hidden_size=64", "--set",
                 "model.intermediate_size=128", "--set", "model.num_heads=2", "-o",
                 str(root / "pretrained")]) == 0
    assert main(["finetune", "classify", "--checkpoint", str(root / "pretrained"), "--train",
                 str(RELATEDNESS), "--regression", "--epochs", "1", "--max-seq-length", "64",
                 "--device", "cpu", "-o", str(root / "scorer")]) == 0
    assert main(["export", "--checkpoint", str(root / "scorer"), "--task", "classification",
                 "--output", str(root / "scorer.onnx")]) == 0
    return root / "scorer.onnx"


@pytest.mark.e2e
def test_evaluate_rerank_is_trec_eval_on_its_own_run(cross_encoder: Path, tmp_path: Path,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    run_file = tmp_path / "run.trec"
    capsys.readouterr()
    assert main(["evaluate", "rerank", "--model", str(cross_encoder), "--beir", str(BEIR),
                 "--run", str(run_file)]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["queries"] == 30 and metrics["pairs"] == 30 * 60
    run: dict[str, dict[str, float]] = {}
    for line in run_file.read_text().splitlines():
        query, _, document, _, score, _ = line.split()
        run.setdefault(query, {})[document] = float(score)
    qrels = read_beir(BEIR).qrels
    theirs = trec_eval(run, {q: dict(v) for q, v in qrels.items()})
    for key, value in theirs.items():  # the run file's scores are rounded to 6 digits
        assert metrics[key] == pytest.approx(value, abs=2e-3), key


@pytest.mark.e2e
def test_predict_rerank_sorts_each_querys_candidates(cross_encoder: Path,
                                                     tmp_path: Path) -> None:
    from popbert.serve.predict import ClassifyPredictor
    from popbert.serve.rerank import pair_scores

    beir = read_beir(BEIR)
    rows = [{"query": beir.queries[q], "candidates": [
        {"id": d, "text": beir.corpus[d]} for d in ("d0", "d1", "d2", "d3")]} for q in
        ("q0", "q1")]
    rows[1]["candidates"] = [c["text"] for c in rows[1]["candidates"]]  # plain texts too
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    output = tmp_path / "ranked.jsonl"
    assert main(["predict", "rerank", "--model", str(cross_encoder), "--data", str(data),
                 "-o", str(output)]) == 0
    written = [json.loads(line) for line in output.read_text().splitlines()]
    predictor = ClassifyPredictor(cross_encoder)
    for row, result in zip(rows, written):
        texts = [c["text"] if isinstance(c, dict) else c for c in row["candidates"]]
        scores = pair_scores(predictor, [row["query"]] * len(texts), texts)
        assert [c["text"] for c in result["ranked"]] == [texts[i] for i in np.argsort(-scores)]
        np.testing.assert_allclose([c["score"] for c in result["ranked"]],
                                   np.sort(scores)[::-1], atol=1e-6)
    assert [c["id"] for c in written[1]["ranked"]] != [] and written[0]["line"] == 1


@pytest.mark.e2e
def test_rerank_bad_inputs_are_one_line(cross_encoder: Path, tmp_path: Path,
                                        capsys: pytest.CaptureFixture[str]) -> None:
    no_candidates = tmp_path / "rows.jsonl"
    no_candidates.write_text('{"query": "x", "candidates": ["a"]}\n'
                             '{"query": "y", "candidates": []}\n')
    output = tmp_path / "ranked.jsonl"
    capsys.readouterr()
    assert main(["predict", "rerank", "--model", str(cross_encoder), "--data",
                 str(no_candidates), "-o", str(output)]) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if "error" in line]
    assert len(errors) == 1 and f"{no_candidates}:2: expected" in errors[0], errors
    assert not output.exists()
