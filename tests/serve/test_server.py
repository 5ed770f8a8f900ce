"""`popbert serve` as a process on 127.0.0.1 with the clients people use: the official `openai`
package (float and base64), `httpx` with concurrent async clients, Prometheus' text read by
prometheus-client's parser; the real all-MiniLM-L6-v2 exported with `--task embedding`.

Tolerances: 1e-5 on each component against `popbert predict embed` and sentence-transformers on
the same export and weights (float32 in both; measured 1.5e-7 against sentence-transformers), and
between a text served alone and the same text batched with others (the batch's width changes
which padding ONNX Runtime skips; measured 9e-8).
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import ssl
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest
from serve_helpers import Server, SlowClient, requests_of_every_kind

from popbert.cli.main import main
from popbert.errors import UsageError
from popbert.machine import usable_cpus
from popbert.serve.embed import EmbedPredictor

pytestmark = pytest.mark.e2e

FIXTURE = Path(__file__).parent.parent / "fixtures" / "retrieval" / "corpus.jsonl"


def texts() -> list[str]:
    """Real Wikipedia leads of mixed lengths (the retrieval fixture) and two short texts."""
    leads = [" ".join(json.loads(line)["text"].split())
             for line in FIXTURE.read_text().splitlines()]
    return leads[:14] + ["short", "Two words"]


@pytest.fixture(scope="module")
def minilm_export(minilm_imported: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    output = tmp_path_factory.mktemp("serve-minilm") / "minilm.onnx"
    assert main(["export", "--checkpoint", str(minilm_imported), "--task", "embedding",
                 "--output", str(output)]) == 0
    return output


@pytest.fixture(scope="module")
def predicted(minilm_export: Path, tmp_path_factory: pytest.TempPathFactory) -> np.ndarray:
    """`popbert predict embed`'s vectors of `texts()` on the same export."""
    root = tmp_path_factory.mktemp("serve-predicted")
    (root / "texts.txt").write_text("\n".join(texts()) + "\n")
    assert main(["predict", "embed", "--model", str(minilm_export), "--data",
                 str(root / "texts.txt"), "-o", str(root / "out.npy")]) == 0
    return np.load(root / "out.npy")


@pytest.fixture(scope="module")
def sentence_transformer(minilm_dir: Path):
    """sentence-transformers on the same folder: the reference the routes are held to."""
    from sentence_transformers import SentenceTransformer

    return SentenceTransformer(str(minilm_dir), device="cpu")


@pytest.fixture(scope="module")
def server(minilm_export: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("serve-log") / "server.log"
    with Server(minilm_export, "--max-wait-ms", "5", "--max-client-batch-size", "20",
                "--payload-limit", "20000", log_path=log) as running:
        yield running


def test_openai_client_gets_predict_embeds_vectors_as_float_and_base64(
        server: Server, predicted: np.ndarray, minilm_dir: Path, sentence_transformer) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
    listed = client.models.list().data
    assert [model.id for model in listed] == ["minilm"]
    base64 = client.embeddings.create(model="minilm", input=texts())  # the client's default
    floats = client.embeddings.create(model="minilm", input=texts(), encoding_format="float")
    for response in (base64, floats):
        vectors = np.array([item.embedding for item in response.data])
        assert [item.index for item in response.data] == list(range(len(texts())))
        np.testing.assert_allclose(vectors, predicted, atol=1e-5, rtol=0)
    reference = sentence_transformer.encode(texts())
    np.testing.assert_allclose(vectors, reference, atol=1e-5, rtol=0)
    tokens = sum(len(ids) + 2 for ids in
                 _tokenizer(minilm_dir).encode_batch(texts(), add_special_tokens=False))
    assert floats.usage.prompt_tokens == floats.usage.total_tokens == tokens
    one = client.embeddings.create(model="minilm", input=texts()[0], encoding_format="float")
    np.testing.assert_allclose(one.data[0].embedding, predicted[0], atol=1e-5, rtol=0)

    # Matryoshka: cut to 64 and normalised again, as the model's vectors are normalised.
    cut = client.embeddings.create(model="minilm", input=texts()[:2], dimensions=64,
                                   encoding_format="float")
    expected = predicted[:2, :64] / np.linalg.norm(predicted[:2, :64], axis=1, keepdims=True)
    np.testing.assert_allclose([item.embedding for item in cut.data], expected, atol=1e-5)

    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.embeddings.create(model="text-embedding-3-small", input="x")


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    tokenizer.no_truncation()  # the folder's file cuts at 128; the export takes 256
    tokenizer.no_padding()
    return tokenizer


def test_token_ids_and_tei_embed_give_the_same_vectors(server: Server, minilm_dir: Path,
                                                      predicted: np.ndarray) -> None:
    ids = [encoding.ids for encoding in
           _tokenizer(minilm_dir).encode_batch(texts()[:3], add_special_tokens=False)]
    with server.client() as client:
        by_ids = client.post("/v1/embeddings", json={"model": "minilm", "input": ids}).json()
        tei = client.post("/embed", json={"inputs": texts()[:3]})
        assert tei.status_code == 200
        assert int(tei.headers["x-prompt-tokens"]) == sum(len(i) + 2 for i in ids)
        np.testing.assert_allclose(tei.json(), predicted[:3], atol=1e-5, rtol=0)
    np.testing.assert_allclose([item["embedding"] for item in by_ids["data"]], predicted[:3],
                               atol=1e-5, rtol=0)


def test_truncation_direction_left_keeps_the_end_as_sentence_transformers_does(
        server: Server, minilm_dir: Path, sentence_transformer) -> None:
    """TEI's `truncation_direction: Left` against sentence-transformers with its tokenizer's
    `truncation_side` left, on a text of real leads past the export's 256 tokens (1e-5: the
    same weights in ONNX Runtime and torch)."""
    long_text = " ".join(texts()[:6])
    assert len(_tokenizer(minilm_dir).encode(long_text).ids) > 300
    reference = sentence_transformer
    assert reference.max_seq_length == 256
    right_expected = reference.encode([long_text])
    reference.tokenizer.truncation_side = "left"
    try:
        left_expected = reference.encode([long_text])
    finally:
        reference.tokenizer.truncation_side = "right"
    with server.client() as client:
        left = client.post("/embed", json={"inputs": [long_text, "short"],
                                           "truncation_direction": "Left"})
        right = client.post("/embed", json={"inputs": long_text,
                                            "truncation_direction": "right"})
    assert left.status_code == 200 and left.headers["x-truncated-inputs"] == "1"
    np.testing.assert_allclose(left.json()[:1], left_expected, atol=1e-5, rtol=0)
    np.testing.assert_allclose(right.json(), right_expected, atol=1e-5, rtol=0)
    assert np.dot(left.json()[0], right.json()[0]) < 0.99  # the two ends differ


def test_decode_gives_back_what_transformers_decodes(server: Server, minilm_dir: Path) -> None:
    """TEI's `/decode` against transformers' tokenizer of the same folder, on the ids
    `/tokenize` gives (special tokens kept and skipped)."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(str(minilm_dir))
    sample = [*texts()[:3], "Hello, world! It's 3.5 km (2 mi) away; naïve café."]
    with server.client() as client:
        ids = [[token["id"] for token in tokens]
               for tokens in client.post("/tokenize", json={"inputs": sample}).json()]
        skipped = client.post("/decode", json={"ids": ids}).json()
        kept = client.post("/decode", json={"ids": ids, "skip_special_tokens": False}).json()
        one = client.post("/decode", json={"ids": ids[0]}).json()
        outside = client.post("/decode", json={"ids": [ids[0], [5, 10 ** 6]]})
    assert skipped == [reference.decode(row, skip_special_tokens=True) for row in ids]
    assert kept == [reference.decode(row, skip_special_tokens=False) for row in ids]
    assert kept[0].startswith("[CLS] ") and one == skipped[:1]
    assert outside.status_code == 422 and "ids[1]" in outside.json()["error"]


def test_teis_other_route_names_and_huggingface_hubs_client(
        server: Server, monkeypatch: pytest.MonkeyPatch) -> None:
    """TEI answers its model's own route at POST / (and SageMaker's /invocations), OpenAI's at
    /embeddings too, and health at GET / and /ping; huggingface_hub's InferenceClient, given
    the server's URL, posts to / (a 405 before)."""
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient

    # The suite runs with HF_HUB_OFFLINE (never the Hub); this client talks to 127.0.0.1 only.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    text = texts()[3]
    with server.client() as client:
        expected = client.post("/embed", json={"inputs": text}).json()
        for path in ("/", "/invocations"):
            answer = client.post(path, json={"inputs": text})
            assert answer.status_code == 200 and answer.json() == expected, path
        openai = client.post("/embeddings", json={"model": "minilm", "input": text})
        assert openai.json()["data"][0]["embedding"] == expected[0]
        for path in ("/", "/ping"):
            assert client.get(path).json() == {"status": "ok"}, path
    hub = InferenceClient(model=server.url).feature_extraction(text)
    np.testing.assert_allclose(np.asarray(hub).reshape(-1), expected[0], atol=1e-6, rtol=0)


def test_similarity_and_score_are_sentence_transformers_cosine(
        server: Server, sentence_transformer, monkeypatch: pytest.MonkeyPatch) -> None:
    """TEI's `/similarity` (Hugging Face's sentence-similarity task) and vLLM's `/score`
    against sentence-transformers' cosine similarity of the same folder's vectors (1e-5),
    through huggingface_hub's client and plain HTTP with TEI's parameters."""
    import huggingface_hub.constants
    from huggingface_hub import InferenceClient
    from sentence_transformers import util

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # 127.0.0.1 only
    source, others = texts()[0], [*texts()[1:5], "short"]
    vectors = sentence_transformer.encode([source, *others], convert_to_tensor=True)
    expected = util.cos_sim(vectors[:1], vectors[1:])[0].numpy()
    hub = InferenceClient(model=f"{server.url}/similarity").sentence_similarity(source, others)
    np.testing.assert_allclose(hub, expected, atol=1e-5, rtol=0)
    with server.client() as client:
        inputs = {"source_sentence": source, "sentences": others}
        cut = client.post("/similarity", json={"inputs": inputs, "parameters": {
            "truncation_direction": "Left"}})
        whole = client.post("/similarity", json={"inputs": inputs, "parameters": {
            "truncate": False}})
        empty = client.post("/similarity", json={"inputs": {"source_sentence": source,
                                                            "sentences": []}})
        # vLLM's /score of an embedding model: the same cosine, one against many or pairwise
        scored = client.post("/v1/score", json={"model": "minilm", "text_1": source,
                                                "text_2": others}).json()
        pairwise = client.post("/score", json={"text_1": others[:2], "text_2": others[2:4]})
        not_ours = client.post("/score", json={"model": "bge", "text_1": "a", "text_2": "b"})
    np.testing.assert_allclose(cut.json(), expected, atol=1e-5, rtol=0)  # none is cut
    np.testing.assert_allclose([d["score"] for d in scored["data"]], expected, atol=1e-5)
    pairs = util.cos_sim(vectors[1:3], vectors[3:5]).diagonal().numpy()
    np.testing.assert_allclose([d["score"] for d in pairwise.json()["data"]], pairs, atol=1e-5)
    assert not_ours.status_code == 404 and not_ours.json()["error_type"] == "model_not_found"
    assert whole.status_code == 200 and empty.status_code == 422
    assert "inputs.sentences" in empty.json()["error"]


def test_embed_all_is_sentence_transformers_token_embeddings(server: Server,
                                                             sentence_transformer) -> None:
    """TEI's `/embed_all`: each text's final state at every token, [CLS] and [SEP] included,
    against sentence-transformers' `encode(output_value="token_embeddings")` on the same
    folder. The states are not normalised (|x| up to about 6 here), so 2e-5 (measured 2.6e-6).
    Asked for together with `/embed` requests, whose batches then fetch the states too: each
    answer equals the text's answer alone."""
    long_text = " ".join(texts()[:6])  # past the export's 256 tokens: cut as /embed cuts
    chosen = [texts()[0], "short", long_text]
    expected = [rows.numpy() for rows in sentence_transformer.encode(
        chosen, output_value="token_embeddings")]
    assert [len(rows) for rows in expected][1:] == [3, 256]

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            states = client.post("/embed_all", json={"inputs": chosen})
            vectors = [client.post("/embed", json={"inputs": text}) for text in texts()[:8]]
            answers = await asyncio.gather(states, *vectors)
            assert all(answer.status_code == 200 for answer in answers)
            alone = (await client.post("/embed", json={"inputs": texts()[:8]})).json()
            return answers[0].json(), [[answers[1 + i].json()[0], alone[i]] for i in range(8)]

    states, vectors = asyncio.run(run())
    for got, want in zip(states, expected):
        np.testing.assert_allclose(got, want, atol=2e-5, rtol=0)
    for together, alone in vectors:
        np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)
    with server.client() as client:
        whole = client.post("/embed_all", json={"inputs": long_text, "truncate": False})
        left = client.post("/embed_all", json={"inputs": long_text,
                                               "truncation_direction": "Left"})
        no_prompt = client.post("/embed_all", json={"inputs": "a", "prompt_name": "query"})
    assert whole.status_code == 413 and "inputs[0]" in whole.json()["error"]
    assert left.status_code == 200 and left.headers["x-truncated-inputs"] == "1"
    assert np.abs(np.asarray(left.json()[0]) - expected[2]).max() > 0.1  # the other end
    assert no_prompt.status_code == 422 and "prompt_name" in no_prompt.json()["error"]


def test_concurrent_clients_get_what_each_text_gets_alone(server: Server) -> None:
    """32 async clients at once, each text its own request: the answers equal the one-at-a-time
    answers, whatever batches the server made of them."""
    corpus = texts() * 2

    async def run() -> tuple[list, list]:
        async with httpx.AsyncClient(base_url=server.url, timeout=120) as client:
            alone = [(await client.post("/embed", json={"inputs": text})).json()[0]
                     for text in corpus]
            together = await asyncio.gather(*[client.post("/embed", json={"inputs": text})
                                              for text in corpus])
            assert all(response.status_code == 200 for response in together)
            return alone, [response.json()[0] for response in together]

    before = server.metric("popbert_batch_rows_count")
    alone, together = asyncio.run(run())
    np.testing.assert_allclose(together, alone, atol=1e-5, rtol=0)
    runs = server.metric("popbert_batch_rows_count") - before
    assert 0 < runs <= 2 * len(corpus)  # every row ran, in at most one run each
    assert server.metric("popbert_batch_rows_sum") >= 2 * len(corpus)


def test_each_answer_says_where_its_time_went_as_tei_does(minilm_export: Path,
                                                          tmp_path: Path) -> None:
    """TEI's headers: tokens, characters, and the milliseconds spent encoding the inputs,
    waiting in the batcher, in model runs and in all. A request whose batch waits for a body
    still arriving (--max-wait-ms 300) reports at least that wait as queue time; /metrics
    gets it too."""
    with Server(minilm_export, "--max-wait-ms", "300", log_path=tmp_path / "log") as server:
        slow = SlowClient(server, "/embed", {"inputs": "slow"})
        deadline = time.monotonic() + 60
        while server.metric("popbert_requests_in_flight") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        text = texts()[0]
        with server.client() as client:
            answer = client.post("/v1/embeddings", json={"model": "minilm", "input": text})
        assert slow.finish() == 200
        headers = {name: int(answer.headers[name]) for name in (
            "x-compute-time", "x-compute-tokens", "x-compute-characters", "x-total-time",
            "x-tokenization-time", "x-queue-time", "x-inference-time", "x-prompt-tokens")}
        assert headers["x-compute-tokens"] == headers["x-prompt-tokens"] \
            == answer.json()["usage"]["prompt_tokens"]
        assert headers["x-compute-characters"] == len(text)
        assert headers["x-queue-time"] >= 300  # it waited out --max-wait-ms for the slow body
        assert headers["x-inference-time"] >= 0 and headers["x-tokenization-time"] >= 0
        assert headers["x-total-time"] == headers["x-compute-time"]
        parts = headers["x-tokenization-time"] + headers["x-queue-time"] \
            + headers["x-inference-time"]
        assert parts - 3 <= headers["x-total-time"]  # each part rounded to a millisecond
        assert server.metric("popbert_queue_duration_seconds_sum") >= 0.3
        assert server.metric("popbert_queue_duration_seconds_count") >= 2


def test_bad_requests_are_4xx_naming_the_field_and_the_server_lives_on(server: Server) -> None:
    long_text = " ".join(["word"] * 400)  # past the export's 256 tokens
    cases = [  # (method, route, body, status, words in the message)
        ("post", "/v1/embeddings", b"not json", 422, "not valid JSON"),
        ("post", "/v1/embeddings", {"input": "x"}, 422, "model is required"),
        ("post", "/v1/embeddings", {"model": "minilm", "input": []}, 422, "input"),
        ("post", "/v1/embeddings", {"model": "minilm", "input": [""]}, 422, "input[0]"),
        ("post", "/v1/embeddings", {"model": "minilm", "input": {"a": 1}}, 422, "input"),
        ("post", "/v1/embeddings", {"model": "minilm", "input": [[1, 10 ** 9]]}, 422,
         "vocabulary"),
        ("post", "/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 0}, 422,
         "dimensions"),
        ("post", "/v1/embeddings", {"model": "minilm", "input": "x", "dimensions": 999}, 422,
         "dimensions"),
        ("post", "/v1/embeddings", {"model": "minilm", "input": "x",
                                    "encoding_format": "hex"}, 422, "encoding_format"),
        ("post", "/embed", {"inputs": 5}, 422, "inputs"),
        ("post", "/embed", {"inputs": "x", "normalise": True}, 422, "normalise"),
        ("post", "/embed", {"inputs": "x", "prompt_name": "query"}, 422, "prompt_name"),
        ("post", "/embed", {"inputs": "x", "truncation_direction": "Up"}, 422,
         "truncation_direction"),
        ("post", "/embed", {"inputs": ["x"] * 21}, 413, "max_client_batch_size"),
        ("post", "/embed", {"inputs": long_text, "truncate": False}, 413, "truncate"),
        ("post", "/embed", {"inputs": "y" * 30000}, 413, "payload_limit"),
        ("post", "/predict", {"inputs": "x"}, 404, "embedding"),
        ("post", "/rerank", {"query": "x", "texts": ["y"]}, 404, "embedding"),
        ("get", "/embed", None, 405, "GET"),
        ("get", "/nowhere", None, 404, "/nowhere"),
        ("post", "/tokenize", {"inputs": []}, 422, "inputs"),
        # JSON's escapes can write half a surrogate pair: no text, and no 500 when quoted back
        ("post", "/v1/embeddings", b'{"model": "minilm", "input": ["ok", "a \\ud800"]}', 422,
         "input[1]: not Unicode text (a lone surrogate \\ud800 at character 2)"),
        ("post", "/embed", b'{"inputs": "\\udfff"}', 422, "inputs[0]: not Unicode text"),
        ("post", "/v1/embeddings", b'{"model": "mini\\ud800", "input": "a"}', 404,
         "does not exist"),
    ]
    with server.client() as client:
        for method, route, body, status, words in cases:
            if method == "get":
                response = client.get(route)
            elif isinstance(body, bytes):
                response = client.post(route, content=body)
            else:
                response = client.post(route, json=body)
            assert response.status_code == status, (route, body, response.text)
            error = response.json()["error"]
            message = error["message"] if route.startswith("/v1/") else error
            assert words in message, (route, body, message)
        # a long input is cut by default, as TEI does, and the usage says so
        cut = client.post("/v1/embeddings", json={"model": "minilm", "input": long_text})
        assert cut.status_code == 200 and cut.json()["usage"]["truncated_inputs"] == 1
        right = client.post("/embed", json={"inputs": long_text,
                                            "truncation_direction": "Right"})
        assert right.status_code == 200 and right.headers["x-truncated-inputs"] == "1"
        np.testing.assert_allclose(right.json()[0], cut.json()["data"][0]["embedding"],
                                   atol=1e-6, rtol=0)  # /embed normalises once more
        assert client.get("/health").status_code == 200
    assert server.metric("popbert_requests_total", status="500") == 0
    assert "Traceback" not in server.output()


def test_every_get_route_answers_head_as_health_checks_send_it(server: Server) -> None:
    """HEAD is GET without the body (RFC 9110: every general-purpose server answers it), and
    load balancers' and uptime checkers' probes send it; it was a 405 on every route."""
    with server.client() as client:
        for route in ("/health", "/info", "/v1/models", "/openapi.json", "/docs"):
            head, get = client.head(route), client.get(route)
            assert head.status_code == get.status_code == 200, (route, head.text)
            assert head.content == b"" and head.headers["content-length"] \
                == get.headers["content-length"], route
        assert client.head("/metrics").status_code == 200
        assert client.head("/embed").status_code == 405  # a POST route stays POST only
        # X-Request-Id: a proxy's or client's is answered back, else the server makes one;
        # one that could forge a log line (spaces, newlines, too long) is replaced
        given = client.post("/embed", json={"inputs": "x"}, headers={"X-Request-Id": "ab-12"})
        assert given.headers["x-request-id"] == "ab-12"
        made = client.get("/health").headers["x-request-id"]
        assert len(made) == 32 and int(made, 16) >= 0
        for odd in ("two words", "x" * 129):
            answer = client.get("/info", headers={"X-Request-Id": odd})
            assert answer.headers["x-request-id"] != odd
        # without --cors-allow-origin no origin is allowed: a browser keeps the answer
        plain = client.post("/embed", json={"inputs": "x"}, headers={"Origin": "https://a.b"})
        assert plain.status_code == 200 and "access-control-allow-origin" not in plain.headers


def test_metrics_count_requests_by_route_and_status(server: Server) -> None:
    with server.client() as client:
        before = server.metric("popbert_requests_total", route="/tokenize", status="200")
        for _ in range(3):
            tokens = client.post("/tokenize", json={"inputs": "Hello world!"}).json()[0]
        assert [t["text"] for t in tokens] == ["[CLS]", "hello", "world", "!", "[SEP]"]
        assert tokens[1]["start"] == 0 and tokens[1]["stop"] == 5 and tokens[0]["special"]
        info = client.get("/info").json()
        schema = client.get("/openapi.json").json()
        assert {"/v1/embeddings", "/embed", "/predict", "/rerank"} <= set(schema["paths"])
        assert client.get("/docs").status_code == 200
    assert server.metric("popbert_requests_total", route="/tokenize", status="200") \
        == before + 3
    assert server.metric("popbert_request_duration_seconds_count", route="/tokenize") >= 3
    assert info["task"] == "embedding" and info["max_input_length"] == 256
    assert info["pooling"] == "mean" and info["normalize"] is True


def test_an_api_key_guards_every_route_but_health(minilm_export: Path, tmp_path: Path) -> None:
    """With a key, every route but the probes needs it. --cors-allow-origin (TEI's flag): a
    page of that origin may call the server from a browser, its preflight answered without a
    key (browsers send none there); other origins get no CORS headers, so the browser keeps
    the answer from them."""
    key, page = "s3cret-key-for-the-test", "https://app.example.com"
    with Server(minilm_export, "--cors-allow-origin", page, log_path=tmp_path / "log",
                env={"POPBERT_API_KEY": key}) as server:
        with server.client() as client:
            body = {"model": "minilm", "input": "x"}
            assert client.post("/v1/embeddings", json=body).status_code == 401
            wrong = client.post("/v1/embeddings", json=body,
                                headers={"Authorization": "Bearer wrong"})
            assert wrong.status_code == 401 and key not in wrong.text
            assert wrong.json()["error"]["type"] == "authentication_error"
            assert client.get("/metrics").status_code == 401
            assert client.get("/health").status_code == 200  # probes carry no key
            assert client.get("/").status_code == client.get("/ping").status_code == 200
            assert client.post("/", json={"inputs": "x"}).status_code == 401  # not a probe
            right = client.post("/v1/embeddings", json=body,
                                headers={"Authorization": f"Bearer {key}"})
            assert right.status_code == 200
            preflight = {"Origin": page, "Access-Control-Request-Method": "POST",
                         "Access-Control-Request-Headers": "authorization,content-type"}
            answer = client.options("/v1/embeddings", headers=preflight)
            assert answer.status_code == 200
            assert answer.headers["access-control-allow-origin"] == page
            assert "authorization" in answer.headers["access-control-allow-headers"].lower()
            other = client.options("/v1/embeddings",
                                   headers={**preflight, "Origin": "https://evil.example"})
            assert "access-control-allow-origin" not in other.headers
            called = client.post("/embed", json={"inputs": "from a page"},
                                 headers={"Origin": page, "Authorization": f"Bearer {key}"})
            assert called.status_code == 200
            assert called.headers["access-control-allow-origin"] == page
            assert "x-prompt-tokens" in called.headers["access-control-expose-headers"]
            assert client.post("/embed", json={"inputs": "x"},
                               headers={"Origin": page}).status_code == 401
            assert client.get("/info", headers={"Authorization": f"Bearer {key}"}).json()[
                "cors_allow_origin"] == [page]
        assert server.stop() == 0
    assert key not in (tmp_path / "log").read_text()


def test_sigterm_under_load_answers_every_accepted_request(minilm_export: Path,
                                                           tmp_path: Path) -> None:
    """Requests waiting inside the server when SIGTERM comes (held in the batcher by a request
    whose body is still arriving) are all answered, the late body too, then the process exits
    0; a new connection afterwards is refused."""
    with Server(minilm_export, "--max-wait-ms", "60000", log_path=tmp_path / "log") as server:
        slow = SlowClient(server, "/embed", {"inputs": "the last one"})
        results: list[int] = []

        def ask(text: str) -> None:
            with server.client() as client:
                results.append(client.post("/embed", json={"inputs": text}).status_code)

        threads = [threading.Thread(target=ask, args=(text,)) for text in texts()[:8]]
        for thread in threads:
            thread.start()
        deadline = time.monotonic() + 60
        while server.metric("popbert_requests_in_flight") < 9:
            assert time.monotonic() < deadline, "the requests never arrived"
            time.sleep(0.05)
        assert results == []  # all eight wait in the server
        server.process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert slow.finish() == 200
        for thread in threads:
            thread.join(60)
        assert results == [200] * 8
        assert server.stop() == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{server.url}/health", timeout=5)
    assert "every accepted request was answered" in (tmp_path / "log").read_text()


def test_a_client_that_disconnects_does_not_disturb_its_batch(minilm_export: Path,
                                                               predicted: np.ndarray,
                                                               tmp_path: Path) -> None:
    with Server(minilm_export, "--max-wait-ms", "60000", log_path=tmp_path / "log") as server:
        slow = SlowClient(server, "/embed", {"inputs": texts()[2]})
        gone = SlowClient(server, "/embed", {"inputs": texts()[1]})
        answers: list = []
        thread = threading.Thread(target=lambda: answers.append(httpx.post(
            f"{server.url}/embed", json={"inputs": texts()[0]}, timeout=60)))
        thread.start()
        deadline = time.monotonic() + 60
        while server.metric("popbert_requests_in_flight") < 3:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        gone.sock.close()  # mid-body: the batch it would have joined goes on without it
        assert slow.finish() == 200
        thread.join(60)
        assert answers[0].status_code == 200
        np.testing.assert_allclose(answers[0].json()[0], predicted[0], atol=1e-5, rtol=0)
        assert server.metric("popbert_requests_total", status="500") == 0


def test_a_full_server_answers_503_with_retry_after(minilm_export: Path, tmp_path: Path) -> None:
    with Server(minilm_export, "--max-wait-ms", "60000", "--max-concurrent-requests", "2",
                log_path=tmp_path / "log") as server:
        slow = SlowClient(server, "/embed", {"inputs": "slow"})
        held: list[int] = []
        thread = threading.Thread(target=lambda: held.append(
            httpx.post(f"{server.url}/embed", json={"inputs": "held"}, timeout=60).status_code))
        thread.start()
        deadline = time.monotonic() + 60
        while server.metric("popbert_requests_in_flight") < 2:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = httpx.post(f"{server.url}/embed", json={"inputs": "more"}, timeout=60)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert "max_concurrent_requests" in refused.json()["error"]
        assert httpx.get(f"{server.url}/health").status_code == 200  # probes still answered
        assert slow.finish() == 200
        thread.join(60)
        assert held == [200]


def test_bodies_that_stop_arriving_free_their_places_and_let_a_stop_end(
        minilm_export: Path, tmp_path: Path) -> None:
    """A client that stalls or vanishes mid-upload is answered 408 after --client-timeout-s:
    its place among --max-concurrent-requests comes back (before, two such clients made every
    later request a 503 for ever), and SIGTERM ends the server instead of waiting on it."""
    with Server(minilm_export, "--max-concurrent-requests", "2", "--client-timeout-s", "1",
                log_path=tmp_path / "log") as server:
        stalled = [SlowClient(server, "/v1/embeddings", {"input": "never sent"}),
                   SlowClient(server, "/embed", {"inputs": "never sent"})]
        for client in stalled:
            status, body = client.unfinished()
            assert status == 408, body
            error = body["error"]  # OpenAI's error object, or TEI's message
            assert "client_timeout_s" in (error["message"] if isinstance(error, dict) else error)
        assert server.metric("popbert_stalled_clients_total", phase="body") == 2
        assert server.output().count(": the client did not finish sending its body within "
                                     "1 s (client_timeout_s)") == 2
        with server.client() as client:
            assert client.post("/embed", json={"inputs": "now"}).status_code == 200
        last = SlowClient(server, "/embed", {"inputs": "never sent"})
        deadline = time.monotonic() + 60
        while server.metric("popbert_requests_in_flight") < 1:
            assert time.monotonic() < deadline, "the stalled request never arrived"
            time.sleep(0.05)
        assert server.stop() == 0  # -9 had it been killed for hanging
        assert last.unfinished()[0] == 408
    assert "Traceback" not in (tmp_path / "log").read_text()


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_second_interrupt_stops_at_once_and_says_so(minilm_export: Path, tmp_path: Path,
                                                      workers: str) -> None:
    """Ctrl-C waits for the requests in flight; a second Ctrl-C stops at once, exits 130 and
    says those requests were not answered (it used to exit 0 saying every one was)."""
    with Server(minilm_export, "--workers", workers, "--client-timeout-s", "600",
                log_path=tmp_path / "log") as server:
        stalled = SlowClient(server, "/embed", {"inputs": "never sent"})
        deadline = time.monotonic() + 60
        while server.metric("popbert_requests_in_flight") < 1:
            assert time.monotonic() < deadline, "the stalled request never arrived"
            time.sleep(0.05)
        server.process.send_signal(signal.SIGINT)
        time.sleep(1)
        assert server.process.poll() is None  # still waiting on the stalled request
        assert server.stop(signal.SIGINT) == 130
        stalled.sock.close()
    log = (tmp_path / "log").read_text()
    assert "stopped at once by a second interrupt" in log
    # no traceback of the cancelled request and lifespan: the line above says what was lost
    assert "Traceback" not in log and "Exception in ASGI" not in log
    assert "every accepted request was answered" not in log
    assert "answered its accepted requests" not in log


def test_clients_that_take_no_answers_free_their_places(minilm_export: Path,
                                                        tmp_path: Path) -> None:
    """Clients that send requests and stop reading the answers (a tiny receive window, never
    read) hold their places only until --client-timeout-s; then the server gives up on them,
    the kernel drops their connections (TCP_USER_TIMEOUT), and others are served again."""
    with Server(minilm_export, "--max-concurrent-requests", "2", "--client-timeout-s", "1",
                log_path=tmp_path / "log") as server:
        body = json.dumps({"inputs": ["a b c d e f g h"] * 256}).encode()
        request = (b"POST /embed HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: "
                   b"application/json\r\nContent-Length: %d\r\n\r\n" % len(body)) + body
        readers = []
        for _ in range(2):
            reader = socket.create_connection(("127.0.0.1", server.port))
            reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            reader.setblocking(False)
            for _ in range(20):  # pipelined until the kernel takes no more
                try:
                    reader.send(request)
                except BlockingIOError:
                    break
            readers.append(reader)
        deadline = time.monotonic() + 60
        while server.metric("popbert_requests_in_flight") < 2:  # both places taken
            assert time.monotonic() < deadline, "the readers' requests never arrived"
            time.sleep(0.05)
        deadline = time.monotonic() + 60
        with server.client() as client:
            while client.post("/embed", json={"inputs": "now"}).status_code != 200:
                assert time.monotonic() < deadline, "the places never came back"
                time.sleep(0.1)
        assert server.stop() == 0
        for reader in readers:
            reader.close()
    log = (tmp_path / "log").read_text()
    # uvicorn's error line for each answer given up on (or whose connection the kernel
    # dropped) is left out: the server meant it
    assert "Traceback" not in log and " E " not in log and "without completing" not in log


def test_two_workers_share_the_port_and_sum_their_metrics(minilm_export: Path,
                                                          tmp_path: Path) -> None:
    """Two workers on one port; without --threads each runs its share of the CPUs (left to
    itself each runtime would take every core, oversubscribing them twice)."""
    server = Server(minilm_export, "--workers", "2", log_path=tmp_path / "log")
    server.command.remove("--threads")  # the helper's default of 1
    server.command.remove("1")
    with server:
        with server.client() as client:
            info = client.get("/info").json()
        assert info["threads"] == max(1, usable_cpus() // 2) and info["workers"] == 2
        # `/health` answered once the first worker listens; the second joins the port when its
        # own model is warmed. Each new connection goes to a worker by the kernel's hash, so
        # keep connecting (bounded) until an /embed has been answered by each worker.
        sample = texts()[:6]
        embedded: dict[int, int] = {}
        deadline = time.monotonic() + 120
        while len(embedded) < 2 or sum(embedded.values()) < 6:
            assert time.monotonic() < deadline, f"only workers {sorted(embedded)} answered"
            with server.client() as client:  # one connection: /info and /embed on it
                pid = client.get("/info").json()["pid"]
                text = sample[sum(embedded.values()) % len(sample)]
                assert client.post("/embed", json={"inputs": text}).status_code == 200
                embedded[pid] = embedded.get(pid, 0) + 1
        # each worker counted its own; /metrics, answered by either, gives the sum
        for _ in range(4):
            assert server.metric("popbert_requests_total", route="/embed",
                                 status="200") == sum(embedded.values())
        # another server on the port is refused, not let in to share its connections
        # (the workers' SO_REUSEPORT would have let a second one's workers join)
        for workers in ("1", "2"):
            done = subprocess.run([sys.executable, "-m", "popbert", "serve", "--model",
                                   str(minilm_export), "--port", str(server.port), "--workers",
                                   workers], capture_output=True, text=True, timeout=120)
            assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr
            assert f"--port {server.port}: cannot listen" in done.stderr.strip().splitlines()[-1]
        assert server.stop() == 0
    log = (tmp_path / "log").read_text()
    assert log.count("warmed up") == 2  # each worker loaded and warmed its own model
    assert f"{max(1, usable_cpus() // 2)} thread" in log


def test_tls_from_the_certificate_options(minilm_export: Path, tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    made = subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days",
                           "1", "-subj", "/CN=127.0.0.1", "-addext",
                           "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out",
                           str(cert)], capture_output=True)
    if made.returncode != 0:
        pytest.fail(f"openssl could not make a certificate: {made.stderr.decode()}")
    with Server(minilm_export, "--ssl-certfile", str(cert), "--ssl-keyfile", str(key),
                log_path=tmp_path / "log", scheme="https",
                verify=ssl.create_default_context(cafile=str(cert))) as server:
        with server.client() as client:
            assert client.post("/embed", json={"inputs": "secure"}).status_code == 200
        with pytest.raises(httpx.HTTPError):
            httpx.get(server.url.replace("https", "http") + "/health", timeout=5)


def test_bad_settings_are_one_line_and_exit_2(minilm_export: Path, tmp_path: Path) -> None:
    not_popbert = tmp_path / "plain.onnx"
    not_popbert.write_bytes(b"not a model")
    pem = tmp_path / "cert.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\nMIIB\n-----END CERTIFICATE-----\n")
    taken = Server(minilm_export, log_path=tmp_path / "log")
    cases = [
        (["--model", str(tmp_path / "missing.onnx")], "--model"),
        (["--model", str(not_popbert)], "--model"),
        (["--model", str(minilm_export), "--port", "70000"], "--port 70000"),
        (["--model", str(minilm_export), "--workers", "0"], "--workers 0"),
        (["--model", str(minilm_export), "--ssl-certfile", str(tmp_path / "none.pem"),
          "--ssl-keyfile", str(tmp_path / "none.pem")], "--ssl-certfile"),
        (["--model", str(minilm_export), "--ssl-certfile", str(pem)], "ssl_keyfile"),
        (["--model", str(minilm_export), "--ssl-certfile", str(not_popbert), "--ssl-keyfile",
          str(pem)], "--ssl-certfile"),
        (["--model", str(minilm_export), "--max-batch-tokens", "100"], "--max-batch-tokens"),
        (["--model", str(minilm_export), "--set", "serve.max_wait_ms=-1"], "max_wait_ms"),
        # accepted, they would do nothing (the export takes 256) or serve what no client names
        (["--model", str(minilm_export), "--max-input-tokens", "100000"],
         "--max-input-tokens 100000: " + str(minilm_export) + " takes at most 256 tokens"),
        (["--model", str(minilm_export), "--served-model-name", " "], "--served-model-name"),
        (["--model", str(minilm_export), "--host", "999.1.1.1"], "--host 999.1.1.1: not an"),
        # an origin with a trailing slash never matches a browser's Origin: allows nothing
        (["--model", str(minilm_export), "--cors-allow-origin", "https://a.b/"],
         "--cors-allow-origin"),
        (["--model", str(minilm_export), "--client-timeout-s", "0"], "--client-timeout-s 0"),
        (["--model", str(minilm_export), "--device", "gpu"], "device must be cpu, cuda or"),
        (["--model", str(minilm_export), "--device", "cuda:7"],
         "--device cuda:7: not a device of this machine"),
        (["--model", str(minilm_export), "--default-prompt-name", "query"],
         "--default-prompt-name query: " + str(minilm_export) + " has no prompts"),
        (["--model", str(minilm_export), "--default-prompt-name", "query", "--default-prompt",
          "query: "], "default_prompt_name and serve.default_prompt: give one"),
    ]
    with taken:
        cases.append((["--model", str(minilm_export), "--port", str(taken.port)],
                      f"--port {taken.port}"))
        cases.append((["--model", str(minilm_export), "--port", str(taken.port), "--workers",
                       "2"], f"--port {taken.port}"))
        cases.append((["--model", str(minilm_export), "--port", "0", "--workers", "2"],
                      "--port 0"))
        def attempt(args: list[str]) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", "popbert", "serve", *args],
                                  capture_output=True, text=True, timeout=120)

        with ThreadPoolExecutor(4) as pool:  # each is a process, mostly Python's imports
            attempts = list(pool.map(attempt, [args for args, _ in cases]))
    for (args, words), done in zip(cases, attempts):
        assert done.returncode == 2, (args, done.stderr)
        lines = done.stderr.strip().splitlines()
        assert words in lines[-1] and "Traceback" not in done.stderr, (args, done.stderr)


def test_settings_come_from_the_config_files_serve_section(minilm_export: Path,
                                                           tmp_path: Path,
                                                           sentence_transformer) -> None:
    """A `serve:` section sets what the flags set; --set overrides a key; a flag wins over
    both. Its default prompt goes before the texts of requests that name none, as
    sentence-transformers' `encode(prompt=...)` puts it (1e-5)."""
    config = tmp_path / "serve.yaml"
    config.write_text("serve:\n  served_model_name: from-config\n  max_client_batch_size: 3\n"
                      "  max_padding: 0.2\n  port: 1\n  default_prompt: 'query: '\n")
    with Server(minilm_export, "--config", str(config), "--set",
                "serve.max_client_batch_size=4", log_path=tmp_path / "log") as server:
        with server.client() as client:
            info = client.get("/info").json()
            models = client.get("/v1/models").json()
            too_many = client.post("/embed", json={"inputs": ["x"] * 5})
            # the default prompt, where a request names none: OpenAI's clients cannot
            openai = client.post("/v1/embeddings", json={"model": "from-config",
                                                         "input": ["a cat", "a dog"]})
            tokens = client.post("/tokenize", json={"inputs": "a cat"}).json()[0]
    assert models["data"][0]["id"] == info["model_id"] == "from-config"
    assert info["max_client_batch_size"] == 4 and info["max_padding"] == 0.2
    assert too_many.status_code == 413
    assert info["default_prompt"] == "query: "
    assert [token["text"] for token in tokens] == ["[CLS]", "query", ":", "a", "cat", "[SEP]"]
    np.testing.assert_allclose([item["embedding"] for item in openai.json()["data"]],
                               sentence_transformer.encode(["a cat", "a dog"], prompt="query: "),
                               atol=1e-5, rtol=0)
    assert openai.json()["usage"]["prompt_tokens"] == 2 * 6


def test_the_server_never_imports_torch() -> None:
    """A serving image needs ONNX Runtime (or OpenVINO), not torch."""
    code = ("import sys, popbert.serve.server, popbert.serve.app, popbert.serve.routes; "
            "print('torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "False"


@pytest.mark.parametrize("form", ["int8", "openvino"])
def test_int8_and_openvino_exports_are_served_as_predict_runs_them(
        form: str, minilm_imported: Path, tmp_path: Path) -> None:
    """The other export forms `popbert export` writes: the server's vectors are `popbert
    predict embed`'s on the same file, row for row (the same runtime, precision and shapes:
    1e-5). ONNX Runtime's dynamic INT8 takes each batch's activation scale from the whole
    batch, so the server runs its rows one at a time (`max_batch_rows` 1): a text's vector is
    the same whatever else was asked at once. OpenVINO's BF16 kernels block by shape, so there a
    row's vector moves with its batch (measured 5e-4), in `predict` as in the server: compared
    one request at a time."""
    model = tmp_path / ("minilm-int8.onnx" if form == "int8" else "minilm-ir")
    flags = ["--quantize", "int8"] if form == "int8" else ["--runtime", "openvino"]
    assert main(["export", "--checkpoint", str(minilm_imported), "--task", "embedding",
                 "--output", str(model), *flags]) == 0
    (tmp_path / "texts.txt").write_text("\n".join(texts()[:6]) + "\n")
    assert main(["predict", "embed", "--model", str(model), "--data", str(tmp_path / "texts.txt"),
                 "-o", str(tmp_path / "out.npy"), "--batch-size", "1"]) == 0
    with Server(model, log_path=tmp_path / "log") as server, server.client() as client:
        info = client.get("/info").json()
        if form == "int8":  # all six at once, and from concurrent clients
            served = client.post("/embed", json={"inputs": texts()[:6]}).json()

            async def concurrently() -> list:
                async with httpx.AsyncClient(base_url=server.url, timeout=60) as many:
                    answers = await asyncio.gather(*[many.post("/embed", json={"inputs": text})
                                                     for text in texts()[:6]])
                    return [answer.json()[0] for answer in answers]

            np.testing.assert_allclose(asyncio.run(concurrently()), np.load(tmp_path / "out.npy"),
                                       atol=1e-5, rtol=0)
        else:
            served = [client.post("/embed", json={"inputs": text}).json()[0]
                      for text in texts()[:6]]
    assert info["runtime"] == ("ONNX Runtime" if form == "int8" else "OpenVINO")
    assert info["quantized"] is (form == "int8")
    assert info["max_batch_rows"] == (1 if form == "int8" else None)
    np.testing.assert_allclose(served, np.load(tmp_path / "out.npy"), atol=1e-5, rtol=0)
    # neither form runs on a GPU (`--device cuda`: popbert's torch backend on the ONNX graph)
    words = "ONNX Runtime's own CPU operators" if form == "int8" else "is an OpenVINO IR"
    with pytest.raises(UsageError, match=f"--device cuda: .*{words}"):
        EmbedPredictor(model, device="cuda")


def test_the_torch_backend_serves_an_export_as_onnx_runtime_does(minilm_export: Path) -> None:
    """`--device cuda` runs the export's ONNX graph in popbert's torch backend: here on the
    CPU, against ONNX Runtime on the same file (1e-5; measured 1.4e-7 on the vectors, 2.7e-6
    on the token states, whose scale is about 6)."""
    from popbert.serve.routes import Served

    on_torch = EmbedPredictor(minilm_export, device="cpu")
    on_ort = Served(minilm_export)
    assert on_torch.runtime == "torch (cpu)" and on_ort.predictor.runtime == "ONNX Runtime"
    assert on_torch.output_names == on_ort.predictor.output_names
    assert on_torch.dynamic_sequence and on_torch.sequence_length == 256
    np.testing.assert_allclose(on_torch.embed(texts()), on_ort.embed(texts())[0], atol=1e-5,
                               rtol=0)
    for ours, theirs in zip(on_torch.token_states(texts()[:4]),
                            on_ort.token_states(texts()[:4])[0]):
        np.testing.assert_allclose(ours, theirs, atol=2e-5, rtol=0)


def test_no_request_a_client_can_send_makes_a_5xx(server: Server) -> None:
    """600 seeded requests of every kind (`requests_of_every_kind`): every answer is a 2xx or a
    4xx, and the server lives on."""
    with server.client() as client:
        statuses = requests_of_every_kind(client, 600, seed=41)
        assert client.get("/health").status_code == 200
    assert statuses.get(200, 0) >= 10, statuses  # some were answered, not only refused
    assert server.metric("popbert_requests_total", status="500") == 0
    assert "Traceback" not in server.output()
