"""Every task's route of `popbert serve` against `popbert predict` on the same export: a
classifier's `/predict`, a cross-encoder's `/rerank`, a tagger's `/predict` (entities with
character offsets) and a SQuAD model's `/predict` (answer, score, character span). Small random
models (the answers are arbitrary, but must be the batch command's); a real server process,
`httpx` as the client.

Tolerance: 1e-5 on probabilities and scores (the same export in the same runtime, batched with
other rows or not).
"""

from __future__ import annotations

import json
from pathlib import Path

import cohere
import numpy as np
import pytest
from checkpoint_helpers import random_task_run
from serve_helpers import Server, requests_of_every_kind

import popbert.tasks  # noqa: F401 (registers the task heads)
from popbert.cli.main import main
from popbert.config import TaskConfig, load_config
from popbert.data.tokenization import bundled_vocab_path

pytestmark = pytest.mark.e2e

SMALL = ["model.num_layers=2", "model.hidden_size=32", "model.num_heads=2",
         "model.intermediate_size=64", "model.sequence_length=40",
         "model.max_position_embeddings=64", "model.max_predictions_per_seq=5"]
SQUAD = Path(__file__).parent.parent / "fixtures" / "squad" / "squad-v1.1-sample.json"
TEXTS = ["a short one", "the film was long and, frankly, far too slow for anyone to enjoy at all",
         "fine", "Paris is in France and Berlin in Germany", "bad", "Ada Lovelace met Babbage"]
TAGS = ["O", "B-LOC", "I-LOC", "B-PER", "I-PER"]


def export_of(root: Path, task: str, config: TaskConfig, seed: int) -> Path:
    """A random `task` model of the small shape, exported as `popbert export` writes it."""
    cfg = load_config("tiny", SMALL)
    cfg.model.task = config
    cfg.data.vocab_file = str(bundled_vocab_path())
    head = ("Classifier", "NSP/Pool", "Squad", "Tagger")
    random_task_run(root / "run", cfg, task, seed=seed,
                    scale=lambda n: 30 if n.startswith(head) else 3)
    output = root / f"{task}.onnx"
    assert main(["export", "--checkpoint", str(root / "run"), "--task", task, "--output",
                 str(output)]) == 0
    return output


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("serve-tasks")


def serving(model: Path, root: Path, name: str) -> Server:
    return Server(model, "--max-wait-ms", "5", log_path=root / f"{name}.log")


def test_classify_route_is_predict_classify(root: Path) -> None:
    model = export_of(root / "classify", "classification",
                      TaskConfig(name="classification", num_labels=3,
                                 labels=["neg", "neutral", "pos"]), seed=5)
    (root / "texts.txt").write_text("\n".join(TEXTS) + "\n")
    assert main(["predict", "classify", "--model", str(model), "--data",
                 str(root / "texts.txt"), "-o", str(root / "classified.jsonl")]) == 0
    expected = [json.loads(line) for line in (root / "classified.jsonl").read_text().splitlines()]
    with serving(model, root, "classify") as server, server.client() as client:
        answers = client.post("/predict", json={"inputs": TEXTS}).json()
        single = client.post("/predict", json={"inputs": TEXTS[1]}).json()
        raw = client.post("/predict", json={"inputs": TEXTS, "raw_scores": True}).json()
        pair = client.post("/predict", json={"inputs": ["a question", "an answer"]})
        fuzzed = requests_of_every_kind(client, 150, seed=51)  # never a 5xx
        info = client.get("/info").json()
        not_reranker = client.post("/rerank", json={"query": "q", "texts": ["a"]})
        squad_shaped = client.post("/predict", json={"inputs": {"question": "q",
                                                                 "context": "c"}})
        empty_pair = client.post("/predict", json={"inputs": [["a text", " "]]})
        at_root = client.post("/", json={"inputs": TEXTS}).json()  # TEI's: a classifier predicts
        vllm = client.post("/classify", json={"model": "classification", "input": TEXTS})
        not_scored = client.post("/score", json={"text_1": "q", "text_2": "a"})
    assert fuzzed.get(200, 0) > 0, fuzzed  # some odd requests reached the model
    # vLLM's /classify: each text's probabilities in the labels' order, its best label
    assert [row["index"] for row in vllm.json()["data"]] == list(range(len(TEXTS)))
    for row, answer in zip(vllm.json()["data"], answers):
        assert row["label"] == answer[0]["label"] and row["num_classes"] == 3
        got = {a["label"]: a["score"] for a in answer}
        assert row["probs"] == [got[label] for label in ("neg", "neutral", "pos")]
    assert vllm.json()["usage"]["prompt_tokens"] == int(vllm.headers["x-compute-tokens"])
    assert not_scored.status_code == 404  # three labels: not a reranker
    assert len(answers) == len(TEXTS) and single == answers[1] and at_root == answers
    for answer, row, logits in zip(answers, expected, raw):
        assert answer[0]["label"] == row["label"]  # best first
        assert [a["score"] for a in answer] == sorted((a["score"] for a in answer), reverse=True)
        got = {a["label"]: a["score"] for a in answer}
        np.testing.assert_allclose([got[k] for k in row["probabilities"]],
                                   list(row["probabilities"].values()), atol=1e-5)
        scores = np.array([a["score"] for a in logits])
        softmax = np.exp(scores - scores.max()) / np.exp(scores - scores.max()).sum()
        by_label = dict(zip([a["label"] for a in logits], softmax))
        np.testing.assert_allclose([by_label[k] for k in row["probabilities"]],
                                   list(row["probabilities"].values()), atol=1e-5)
    assert pair.status_code == 200 and len(pair.json()) == 3  # one pair, its three labels
    assert info["labels"] == ["neg", "neutral", "pos"] and info["reranker"] is False
    assert not_reranker.status_code == 404
    assert squad_shaped.status_code == 422
    assert empty_pair.status_code == 422 and "inputs[0]" in empty_pair.json()["error"]


def test_rerank_route_is_predict_rerank(root: Path) -> None:
    model = export_of(root / "rerank", "classification",
                      TaskConfig(name="classification", num_labels=1), seed=7)
    query, candidates = "where is the film set", TEXTS
    (root / "rerank.jsonl").write_text(json.dumps({"query": query,
                                                   "candidates": candidates}) + "\n")
    assert main(["predict", "rerank", "--model", str(model), "--data",
                 str(root / "rerank.jsonl"), "-o", str(root / "ranked.jsonl")]) == 0
    expected = json.loads((root / "ranked.jsonl").read_text())["ranked"]
    with serving(model, root, "rerank") as server, server.client() as client:
        ranked = client.post("/rerank", json={"query": query, "texts": candidates,
                                              "return_text": True})
        scored = client.post("/predict", json={"inputs": [[query, text]
                                                          for text in candidates]}).json()
        # a model of one output is TEI's reranker: POST / reranks
        at_root = client.post("/", json={"query": query, "texts": candidates,
                                         "return_text": True})
        fuzzed = requests_of_every_kind(client, 150, seed=52)  # never a 5xx
        # Cohere's own clients, v1 and v2 (Jina's and vLLM's /v1/rerank are the same shape)
        v1 = cohere.Client(api_key="unused", base_url=server.url).rerank(
            query=query, documents=[{"text": text} for text in candidates], top_n=3,
            return_documents=True)
        v2 = cohere.ClientV2(api_key="unused", base_url=server.url).rerank(
            model="classification", query=query, documents=candidates)
        cut = client.post("/v2/rerank", json={"query": query, "documents": candidates,
                                               "max_tokens_per_doc": 2})
        film = client.post("/rerank", json={"query": query, "texts": ["the film"]}).json()
        # TEI's Left cuts a pair's longer text from its start: what comes before the tail
        # (past the model's 40 tokens with the query) is never seen
        tail = " ".join(TEXTS * 3)
        left = client.post("/rerank", json={"query": query, "texts": [
            "none of this is kept " * 5 + tail, tail], "truncation_direction": "Left"})
        other_model = client.post("/v1/rerank", json={"model": "another", "query": query,
                                                      "documents": candidates})
        unoffered = client.post("/v1/rerank", json={"query": query, "documents": candidates,
                                                    "max_chunks_per_doc": 4})
        # vLLM's /rerank defaults (top_n 0: all; the documents returned) and its /score
        vllm_ranked = client.post("/v1/rerank", json={"query": query, "documents": candidates,
                                                      "top_n": 0}).json()["results"]
        v2_ranked = client.post("/v2/rerank", json={"query": query,
                                                    "documents": candidates}).json()["results"]
        vllm_scored = client.post("/v1/score", json={"model": "classification", "text_1": query,
                                                     "text_2": candidates}).json()
        zipped = client.post("/score", json={"text_1": [query] * 2, "text_2": candidates[:2],
                                             "use_activation": False}).json()
        raw_ranked = client.post("/rerank", json={"query": query, "texts": candidates[:2],
                                                  "raw_scores": True}).json()
        uneven = client.post("/score", json={"text_1": [query] * 2, "text_2": candidates})
        # Infinity's /rerank, as its client sends it (documents, and a model when none named)
        infinity = client.post("/rerank", json={"query": query, "documents": candidates,
                                                "return_documents": True, "raw_scores": False,
                                                "model": "default/not-specified", "top_n": 2})
        infinity_bad = client.post("/rerank", json={"query": query, "documents": [1]})
    assert fuzzed.get(200, 0) > 0, fuzzed  # some odd requests reached the model
    assert [(r.index, r.relevance_score) for r in v2.results] \
        == [(r["index"], r["score"]) for r in ranked.json()]
    assert [(r.index, r.relevance_score, r.document.text) for r in v1.results] \
        == [(r["index"], r["score"], r["text"]) for r in ranked.json()[:3]]
    assert v2.meta.tokens.input_tokens == int(ranked.headers["x-compute-tokens"])
    # max_tokens_per_doc=2 scores "the film was long and, ..." as "the film", and says so
    assert cut.status_code == 200 and cut.headers["x-truncated-inputs"] == str(
        sum(len(text.split()) > 2 for text in candidates))
    assert next(r["relevance_score"] for r in cut.json()["results"] if r["index"] == 1) \
        == pytest.approx(film[0]["score"], abs=1e-5)
    assert left.status_code == 200 and left.headers["x-truncated-inputs"] == "2"
    assert left.json()[0]["score"] == pytest.approx(left.json()[1]["score"], abs=1e-5)
    assert [r["document"]["text"] for r in vllm_ranked] == [r["text"] for r in ranked.json()]
    assert len(v2_ranked) == len(candidates) and "document" not in v2_ranked[0]
    assert [d["score"] for d in vllm_scored["data"]] == [s[0]["score"] for s in scored]
    assert [d["index"] for d in vllm_scored["data"]] == list(range(len(candidates)))
    assert vllm_scored["usage"]["total_tokens"] > 0 and vllm_scored["object"] == "list"
    np.testing.assert_allclose([d["score"] for d in zipped["data"]],
                               [r["score"] for r in sorted(raw_ranked,
                                                           key=lambda r: r["index"])],
                               atol=1e-6)
    assert uneven.status_code == 422 and "text_1" in uneven.json()["error"]
    assert infinity.json()["object"] == "rerank" and infinity.json()["results"] == [
        {"relevance_score": r["score"], "index": r["index"], "document": r["text"]}
        for r in ranked.json()[:2]]
    assert infinity_bad.status_code == 422 and "documents[0]" in infinity_bad.json()["error"]
    assert other_model.status_code == 404 and other_model.json()["error"]["param"] == "model"
    assert unoffered.status_code == 422 \
        and unoffered.json()["error"]["message"] == "max_chunks_per_doc: no such field"
    assert ranked.status_code == 200 and at_root.json() == ranked.json()
    # TEI's headers: the pairs' tokens and characters (the query counted with each text)
    assert int(ranked.headers["x-compute-characters"]) \
        == sum(len(query) + len(text) for text in candidates)
    assert int(ranked.headers["x-compute-tokens"]) > 0 and "x-queue-time" in ranked.headers
    ranked = ranked.json()
    assert [r["index"] for r in ranked] == [e["id"] for e in expected]
    assert [r["text"] for r in ranked] == [e["text"] for e in expected]
    np.testing.assert_allclose([r["score"] for r in ranked], [e["score"] for e in expected],
                               atol=1e-5)
    np.testing.assert_allclose([s[0]["score"] for s in scored],
                               [ranked[[r["index"] for r in ranked].index(i)]["score"]
                                for i in range(len(candidates))], atol=1e-5)


def test_token_classification_route_is_predict_ner_on_text(root: Path) -> None:
    model = export_of(root / "ner", "token-classification",
                      TaskConfig(name="token-classification", num_labels=len(TAGS),
                                 labels=TAGS), seed=11)
    (root / "plain.txt").write_text("\n".join(TEXTS) + "\n")
    assert main(["predict", "ner", "--model", str(model), "--data", str(root / "plain.txt"),
                 "-o", str(root / "entities.jsonl")]) == 0
    expected = [json.loads(line)["entities"]
                for line in (root / "entities.jsonl").read_text().splitlines()]
    with serving(model, root, "ner") as server, server.client() as client:
        found = client.post("/predict", json={"inputs": TEXTS}).json()
        pair = client.post("/predict", json={"inputs": [["a", "b"], ["c", "d"]]})
        fuzzed = requests_of_every_kind(client, 150, seed=53)  # never a 5xx
        wordless = client.post("/predict",
                               json={"inputs": ["\u200b", "\u200b \u200b", "\u200b\u200b"]})
    assert fuzzed.get(200, 0) > 0, fuzzed  # some odd requests reached the model
    # texts whose every character tokenizes away have no words, so no entities (once a 500)
    assert wordless.status_code == 200 and wordless.json() == [[], [], []], wordless.text
    assert sum(map(len, expected)) > 0  # the random tagger finds something to compare
    for text, ours, theirs in zip(TEXTS, found, expected):
        assert [(e["entity_group"], e["start"], e["end"], e["word"]) for e in ours] == \
            [(e["entity_group"], e["start"], e["end"], e["word"]) for e in theirs]
        np.testing.assert_allclose([e["score"] for e in ours], [e["score"] for e in theirs],
                                   atol=1e-5)
        for entity in ours:
            assert text[entity["start"]:entity["end"]].lower().startswith(
                entity["word"].split()[0].lower().lstrip("#"))
    assert pair.status_code == 422


def test_squad_route_is_predict_squad(root: Path) -> None:
    model = export_of(root / "squad", "squad",
                      TaskConfig(name="squad", lowercase=True, doc_stride=8,
                                 max_query_length=12), seed=3)
    assert main(["predict", "squad", "--model", str(model), "--data", str(SQUAD), "-o",
                 str(root / "answers.json")]) == 0
    expected = json.loads((root / "answers.json").read_text())
    questions = [(q["id"], q["question"], paragraph["context"])
                 for article in json.loads(SQUAD.read_text())["data"]
                 for paragraph in article["paragraphs"] for q in paragraph["qas"]][:6]
    with serving(model, root, "squad") as server, server.client() as client:
        answers = client.post("/predict", json={"inputs": [
            {"question": question, "context": context} for _, question, context in questions]})
        one = client.post("/predict", json={"inputs": {"question": questions[0][1],
                                                        "context": questions[0][2]}}).json()
        fuzzed = requests_of_every_kind(client, 150, seed=54)  # never a 5xx
        texts = client.post("/predict", json={"inputs": "not a question"})
        odd = [client.post("/predict", json={"inputs": {"question": question,
                                                         "context": context}})
               for question, context in (("", "a context"), ("a question?", ""),
                                         ("?", "\u200b"), ("why " * 300, "short"),
                                         ("who", "word " * 2000))]
    assert fuzzed.get(200, 0) > 0, fuzzed  # some odd requests reached the model
    assert answers.status_code == 200
    for (qid, _, context), answer in zip(questions, answers.json()):
        assert answer["answer"] == expected[qid]
        assert context[answer["start"]:answer["end"]] == answer["answer"]
        assert 0 < answer["score"] <= 1
    assert one == answers.json()[0]
    assert texts.status_code == 422
    # empty or odd fields are a 422 naming them, or an answer: never a 5xx
    assert [r.status_code for r in odd] == [422, 422, 200, 200, 200], [r.text for r in odd]
    assert "question" in odd[0].json()["error"] and "context" in odd[1].json()["error"]


def test_a_modernbert_export_is_served_as_sentence_transformers_encodes(root: Path) -> None:
    """A family without segment ids (ModernBERT) through the same server: its vectors are
    sentence-transformers' on the same weights (a small random model, 1e-5)."""
    from sentence_transformers import SentenceTransformer
    from test_embed import small_modernbert_sentence_transformer

    folder = root / "modernbert-st"
    small_modernbert_sentence_transformer(folder)
    assert main(["import-hf", "--model", str(folder), "--output-dir",
                 str(root / "modernbert-ckpt")]) == 0
    model = root / "modernbert.onnx"
    assert main(["export", "--checkpoint", str(root / "modernbert-ckpt"), "--task",
                 "embedding", "--output", str(model)]) == 0
    lines = ["the cat is in a hat", "of and the", "a w12 w13 was to", "the dog barked",
             " ".join(["the"] * 80)]  # over the 64-token length: cut, as sentence-transformers
    with serving(model, root, "modernbert") as server, server.client() as client:
        answer = client.post("/v1/embeddings", json={"model": "modernbert", "input": lines})
    assert answer.status_code == 200
    assert answer.json()["usage"]["truncated_inputs"] == 1
    np.testing.assert_allclose([item["embedding"] for item in answer.json()["data"]],
                               SentenceTransformer(str(folder), device="cpu").encode(lines),
                               atol=1e-5, rtol=0)
