"""`popbert serve`'s HTTP face: a FastAPI application over one export.

Routes: OpenAI's `POST /v1/embeddings` and `GET /v1/models`; Text Embeddings Inference's `POST
/embed`, `/similarity`, `/predict`, `/rerank`, `/tokenize` and `/decode` (its other names: `POST
/`, `/invocations`, `/embeddings`, `GET /`, `/ping`); Cohere's `POST /v1/rerank` and `/v2/rerank`
(Jina's, vLLM's and Infinity's shape too); `GET /health`, `/info` and `/metrics` (Prometheus); the
OpenAPI schema at `/docs`. What a route computes is `popbert.serve.routes`; rows from all requests
meet in one `RowBatcher`. Around the routes, one ASGI layer (`Guard`) holds what every request goes
through first: the body limit (413), the API key (401, compared in constant time; probes need
none), the bound on requests in flight (503 with `Retry-After`), the client's time to send its body
and take its answer (`client_timeout_s`: 408, or given up), HEAD as GET, and the request metrics;
CORS, when origins are allowed, sits outside it. Errors are OpenAI's error object under `/v1/`
and `/v2/`, TEI's (`{"error", "error_type"}`) elsewhere; nothing a client sends makes a 5xx.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictStr, Tag
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from popbert import __version__
from popbert.config.sections import ServeConfig
from popbert.serve.batcher import BatchRecord, RowBatcher
from popbert.serve.metrics import ServeMetrics
from popbert.serve.routes import RequestError, Served, Usage, encode_vectors
from popbert.textfile import unicode_problem

log = logging.getLogger(__name__)

# Probes' routes (TEI's: /health, GET / and SageMaker's /ping): answered without a key, as
# probes carry none, and not bounded by max_concurrent_requests (nor is /metrics).
PROBES = ("/health", "/ping")
REQUEST_ID = "popbert.request_id"  # the scope's key for the request's X-Request-Id
UNCOUNTED = (*PROBES, "/metrics")


class _ExpectedUvicornErrors(logging.Filter):
    """uvicorn's error lines for what the server did on purpose, each already said in one line
    of ours: the tracebacks of the requests and the lifespan that a second interrupt cancels
    ("requests in flight were not answered"), and its "returned without completing response"
    after the guard gave up on a client that took no answer or had gone (counted in
    `given_up`)."""

    def __init__(self) -> None:
        super().__init__()
        self.given_up = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], asyncio.CancelledError):
            return False
        message = record.getMessage()
        if message.startswith("Traceback") and message.rstrip().endswith("CancelledError"):
            return False  # Starlette's lifespan, cancelled, as text
        if self.given_up and message.startswith("ASGI callable returned without completing"):
            self.given_up -= 1
            return False
        return True


EXPECTED_ERRORS = _ExpectedUvicornErrors()


def _is_probe(path: str, method: str) -> bool:
    return path in PROBES or (path == "/" and method in ("GET", "HEAD"))

Texts = StrictStr | list[StrictStr]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


# TEI's `truncation_direction`: an input too long loses its end ("Right", TEI's default) or its
# start ("Left"); of a pair, the longer text loses it. Tagging and SQuAD cut nothing (their
# windows cover the whole text), so there it has nothing to act on.
Truncation = Literal["Right", "right", "Left", "left"]


class EmbeddingsRequest(_Request):
    model_config = ConfigDict(extra="allow")  # OpenAI clients send fields such as `user`
    input: StrictStr | list[StrictStr] | list[int] | list[list[int]]
    model: StrictStr
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(default=None, ge=1)
    truncate: bool = True


class EmbedRequest(_Request):
    inputs: Texts
    normalize: bool = True
    truncate: bool = True
    prompt_name: StrictStr | None = None
    dimensions: int | None = Field(default=None, ge=1)
    truncation_direction: Truncation = "Right"


class SimilarityInputs(_Request):
    source_sentence: StrictStr
    sentences: list[StrictStr]


class SimilarityParameters(_Request):
    truncate: bool = True
    truncation_direction: Truncation = "Right"
    prompt_name: StrictStr | None = None


class SimilarityRequest(_Request):
    """TEI's `/similarity`, Hugging Face's sentence-similarity task."""

    inputs: SimilarityInputs
    parameters: SimilarityParameters = SimilarityParameters()


class QuestionContext(_Request):
    question: StrictStr
    context: StrictStr


# As TEI reads `inputs`: a list of exactly two texts is one pair, [text, text]; any other list
# is a batch (of texts, pairs or SQuAD questions). Tried in this order.
Pair = tuple[StrictStr, StrictStr]
PredictInput = Annotated[
    Pair | StrictStr | QuestionContext | list[Pair | StrictStr | QuestionContext],
    Field(union_mode="left_to_right")]


class PredictRequest(_Request):
    inputs: PredictInput
    raw_scores: bool = False
    truncate: bool = True
    truncation_direction: Truncation = "Right"


class RerankRequest(_Request):
    query: StrictStr
    texts: list[StrictStr]
    raw_scores: bool = False
    return_text: bool = False
    truncate: bool = True
    truncation_direction: Truncation = "Right"


class InfinityRerankRequest(_Request):
    """Infinity's `/rerank` (what its client sends): `documents` where TEI has `texts`;
    answered in Infinity's shape."""

    query: StrictStr
    documents: list[StrictStr]
    return_documents: bool = False
    raw_scores: bool = False
    model: StrictStr | None = None
    top_n: int | None = Field(default=None, ge=1)


# Infinity's client names this model when its user names none.
INFINITY_ANY_MODEL = "default/not-specified"


def _rerank_shape(body: Any) -> str:
    """Which `/rerank` a body is: Infinity's (documents, no texts), else TEI's."""
    if isinstance(body, dict) and "documents" in body and "texts" not in body:
        return "InfinityRerank"
    return "TEIRerank"


RerankBody = Annotated[Annotated[RerankRequest, Tag("TEIRerank")]
                       | Annotated[InfinityRerankRequest, Tag("InfinityRerank")],
                       Discriminator(_rerank_shape)]


class RerankDocument(_Request):
    text: StrictStr


class CohereRerankRequest(_Request):
    """Cohere's rerank request, v1 and v2 (Jina's and vLLM's `/v1/rerank` take the same):
    documents as texts or `{"text"}` objects, `top_n`, `return_documents`, and v2's
    `max_tokens_per_doc`. Cohere's other fields (v1's `rank_fields` and `max_chunks_per_doc`,
    v2's `relevant_spans` and `priority`) are refused by name, not ignored."""

    model: StrictStr | None = None
    query: StrictStr
    documents: list[StrictStr | RerankDocument]
    top_n: int | None = Field(default=None, ge=0)  # vLLM's 0: all of them
    return_documents: bool | None = None
    max_tokens_per_doc: int | None = Field(default=None, ge=1)


class ScoreRequest(_Request):
    """vLLM's `/score`: one `text_1` against each `text_2`, or the two lists pair by pair; a
    cross-encoder's score of each pair (`use_activation: false`: its raw logit), an embedding
    model's cosine similarity."""

    model: StrictStr | None = None
    text_1: StrictStr | list[StrictStr]
    text_2: StrictStr | list[StrictStr]
    use_activation: bool | None = None


class ClassifyRequest(_Request):
    """vLLM's `/classify`."""

    model: StrictStr | None = None
    input: StrictStr | list[StrictStr]


class TokenizeRequest(_Request):
    inputs: Texts
    add_special_tokens: bool = True


class DecodeRequest(_Request):
    ids: list[int] | list[list[int]]
    skip_special_tokens: bool = True


@dataclass
class ServerState:
    """What the routes share: the model, its batcher, the limits, the metrics."""

    served: Served
    config: ServeConfig
    metrics: ServeMetrics
    batcher: RowBatcher | None = None
    first_request_logged: bool = False


def error_body(path: str, status: int, message: str, field: str | None = None,
               kind: str | None = None) -> dict[str, Any]:
    """OpenAI's error object under /v1/ and /v2/ (which Cohere's clients read as well),
    TEI's elsewhere."""
    kind = kind or {401: "authentication_error", 404: "not_found", 405: "method_not_allowed",
                    413: "payload_too_large", 503: "overloaded"}.get(status,
                                                                     "invalid_request_error")
    if path.startswith(("/v1/", "/v2/")):
        return {"error": {"message": message, "type": kind, "param": field,
                          "code": None if status in (400, 422) else kind}}
    return {"error": message, "error_type": kind}


class _ErrorJSON(JSONResponse):
    """An error body in ASCII JSON: a message may quote what the client sent (a model name,
    a field), and a lone surrogate there must not turn the 4xx into a 500 at encoding."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(path: str, status: int, message: str, field: str | None = None,
                   kind: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return _ErrorJSON(error_body(path, status, message, field, kind), status_code=status,
                      headers=headers)


# Names pydantic puts in an error's location for a union member of these kinds.
MODEL_NAMES = ("QuestionContext", "RerankDocument", "TEIRerank", "InfinityRerank")


def _field_of(location: tuple[Any, ...]) -> str:
    """A pydantic error location as the field a client wrote: ("body", "input", 2) →
    input[2]; the union member names pydantic adds are left out."""
    parts = [part for part in location if part != "body"]
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part.startswith(("list[", "tuple[", "str", "int", "function-", *MODEL_NAMES)) \
                or "[" in part:
            continue
        else:
            text += ("." if text else "") + part
    return text or "body"


def _validation_message(errors: list[dict[str, Any]]) -> tuple[str, str]:
    """(message, field) for a request pydantic refused: the first error, said plainly."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"the body is not valid JSON ({first.get('ctx', {}).get('error', 'bad JSON')})", \
            "body"
    field = _field_of(tuple(first.get("loc", ())))
    if first.get("type") == "missing":
        return f"{field} is required", field
    if first.get("type") == "extra_forbidden":
        return f"{field}: no such field", field
    kinds = {error.get("type") for error in errors}
    if field in ("input", "inputs") and len(kinds) > 1:
        return (f"{field}: expected a text, a list of texts"
                + (", or lists of token ids" if field == "input" else "")), field
    return f"{field}: {first.get('msg', 'invalid')}", field


def _check_inputs(field: str, values: Any) -> None:
    """A request with no inputs, an empty (or blank) text or pair member, or a text that is not
    Unicode (a lone surrogate, which JSON's escapes can write and no tokenizer reads) is a
    422."""
    if isinstance(values, str):
        values = [values]
    if not values:
        raise RequestError(422, f"{field}: expected at least one input, got none", field)
    for index, value in enumerate(values):
        texts = ([value] if isinstance(value, str) else list(value) if isinstance(value, tuple)
                 else [value.question, value.context] if isinstance(value, QuestionContext)
                 else [])
        for text in texts:
            problem = unicode_problem(text)
            if problem is not None:
                raise RequestError(422, f"{field}[{index}]: not Unicode text ({problem})", field)
        if isinstance(value, str) and not value.strip():
            raise RequestError(422, f"{field}[{index}] is an empty text", field)
        if isinstance(value, list) and not value:
            raise RequestError(422, f"{field}[{index}] is empty", field)
        if isinstance(value, tuple) and not all(text.strip() for text in value):
            raise RequestError(422, f"{field}[{index}] has an empty text in its pair", field)


def create_app(served: Served, config: ServeConfig, api_key: str | None = None,
               multiprocess: bool = False) -> Guard | CORSMiddleware:
    """The ASGI application over a loaded export (`popbert.serve.server` loads it and runs
    uvicorn); its rows batched and the model warmed when it starts."""
    metrics = ServeMetrics(multiprocess)
    state = ServerState(served, config, metrics)
    logging.getLogger("uvicorn.error").addFilter(EXPECTED_ERRORS)  # once: filters are a set

    def on_batch(record: BatchRecord) -> None:
        metrics.batch(record.rows, record.tokens, record.computed, record.seconds,
                      record.queued)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        import anyio.to_thread

        # One worker thread per request in flight: each waits on its rows' batch.
        anyio.to_thread.current_default_thread_limiter().total_tokens = max(
            40, config.max_concurrent_requests)
        max_rows = config.max_batch_rows or (1 if served.batch_dependent else None)
        state.batcher = RowBatcher(served.predictor, config.max_batch_tokens,
                                   config.max_wait_ms, config.max_padding, on_batch,
                                   lambda: guard.in_flight, max_rows)
        served.predictor.batcher = state.batcher
        started = time.perf_counter()
        await run_in_threadpool(served.warm_up)
        log.info("serving %s (%s, %s, %s) as %r: routes %s; warmed up in %.0f ms; limits: "
                 "%d tokens per batch, %.1f ms wait, %d input tokens, %d inputs per request, "
                 "%d requests in flight, %d-byte bodies; pid %d", served.path, served.task,
                 served.predictor.runtime, served.info()["model_dtype"], served.name,
                 ", ".join(served.routes()), 1000 * (time.perf_counter() - started),
                 config.max_batch_tokens, config.max_wait_ms, served.max_input_tokens,
                 config.max_client_batch_size, config.max_concurrent_requests,
                 config.payload_limit, os.getpid())
        try:
            yield
        finally:
            served.predictor.batcher = None
            await run_in_threadpool(state.batcher.close)

    app = FastAPI(title="popbert serve", version=__version__, lifespan=lifespan,
                  description=f"popbert's {served.task} export {served.name} over HTTP: "
                              "OpenAI- and Text Embeddings Inference-compatible routes.")
    app.state.popbert = state

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, error: RequestError) -> JSONResponse:
        return error_response(request.url.path, error.status, str(error), error.field,
                              error.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, field = _validation_message(list(error.errors()))
        return error_response(request.url.path, 422, message, field)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.url.path}",
                   405: f"{request.method} is not allowed on {request.url.path}"}.get(
            error.status_code, str(error.detail))
        return error_response(request.url.path, error.status_code, message,
                              headers=getattr(error, "headers", None))

    def known_model(name: str | None) -> None:
        if name is not None and name != served.name:
            raise RequestError(404, f"The model `{name}` does not exist; this server serves "
                               f"`{served.name}`", "model", "model_not_found")

    def needs(route: str) -> None:
        if route not in served.routes():
            raise RequestError(404, f"{route} is not served: {served.name} is for the "
                               f"{served.task} task (its routes: {', '.join(served.routes())})")

    async def work(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        if not state.first_request_logged:
            state.first_request_logged = True
            log.info("first request")
        return await run_in_threadpool(function, *args, **kwargs)

    def counted(usage: Usage) -> None:
        metrics.tokens(usage.tokens)
        metrics.queued(usage.queue_seconds)

    def too_many(field: str, count: int) -> None:
        if count > config.max_client_batch_size:
            raise RequestError(413, f"{field}: {count} inputs, more than the "
                               f"{config.max_client_batch_size} one request may carry "
                               "(max_client_batch_size)", field)

    @app.post("/v1/embeddings", summary="OpenAI-compatible embeddings")
    async def embeddings(body: EmbeddingsRequest) -> Response:
        needs("/v1/embeddings")
        known_model(body.model)
        given = body.input
        if isinstance(given, str):
            given = [given]
        if given and isinstance(given[0], int):
            given = [given]  # one input as token ids
        _check_inputs("input", given)
        too_many("input", len(given))
        if isinstance(given[0], str):
            vectors, usage = await work(served.embed, given, None, body.truncate)
        else:
            vectors, usage = await work(served.embed_ids, given, body.truncate)
        vectors = served.shape_vectors(vectors, body.dimensions)
        counted(usage)
        data = [{"object": "embedding", "index": index, "embedding": vector}
                for index, vector in enumerate(encode_vectors(vectors, body.encoding_format))]
        return _json({"object": "list", "data": data, "model": served.name,
                      "usage": {"prompt_tokens": usage.tokens, "total_tokens": usage.tokens,
                                "truncated_inputs": usage.truncated}}, usage)

    @app.get("/v1/models", summary="the served model, as OpenAI lists models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.name, "object": "model",
                                            "created": int(started_at), "owned_by": "popbert"}]}

    @app.post("/embed", summary="TEI-compatible embeddings")
    async def embed(body: EmbedRequest) -> Response:
        needs("/embed")
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        _check_inputs("inputs", texts)
        too_many("inputs", len(texts))
        vectors, usage = await work(served.embed, texts, body.prompt_name, body.truncate,
                                    "inputs", body.truncation_direction.lower())
        counted(usage)
        vectors = served.shape_vectors(vectors, body.dimensions, body.normalize)
        return _json(vectors.tolist(), usage)

    @app.post("/similarity", summary="TEI-compatible sentence similarity")
    async def similarity(body: SimilarityRequest) -> Response:
        needs("/similarity")
        texts = [body.inputs.source_sentence, *body.inputs.sentences]
        _check_inputs("inputs.source_sentence", texts[:1])
        _check_inputs("inputs.sentences", texts[1:])
        too_many("inputs.sentences", len(texts) - 1)
        settings = body.parameters
        similar, usage = await work(served.similarities, texts[:1], texts[1:],
                                    settings.prompt_name, settings.truncate,
                                    settings.truncation_direction.lower())
        counted(usage)
        return _json(similar.tolist(), usage)

    @app.post("/score", summary="vLLM-compatible scores of text pairs")
    @app.post("/v1/score", summary="vLLM-compatible scores of text pairs")
    async def score(body: ScoreRequest, request: Request) -> Response:
        needs(request.url.path)
        known_model(body.model)
        firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
        seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
        _check_inputs("text_1", firsts)
        _check_inputs("text_2", seconds)
        if len(firsts) not in (1, len(seconds)):
            raise RequestError(422, f"text_1: {len(firsts)} texts for the {len(seconds)} of "
                               "text_2; give one text, or as many as text_2 has", "text_1")
        too_many("text_2", len(seconds))
        if served.task == "embedding":
            scores, usage = await work(served.similarities, firsts, seconds)
        else:
            pairs = firsts * len(seconds) if len(firsts) == 1 else firsts
            scores, usage = await work(served.pair_scores, pairs, seconds,
                                       body.use_activation is False, True, "right", "text_2")
        counted(usage)
        data = [{"index": i, "object": "score", "score": float(value)}
                for i, value in enumerate(scores)]
        return _json({"id": f"score-{request.scope.get(REQUEST_ID, '')}", "object": "list",
                      "created": int(time.time()), "model": served.name, "data": data,
                      "usage": _vllm_usage(usage)}, usage)

    @app.post("/classify", summary="vLLM-compatible classification")
    async def classify(body: ClassifyRequest, request: Request) -> Response:
        needs("/classify")
        known_model(body.model)
        texts = [body.input] if isinstance(body.input, str) else body.input
        _check_inputs("input", texts)
        too_many("input", len(texts))
        found, usage = await work(served.classify, texts, False, True, "input")
        counted(usage)
        labels = served.predictor.labels or ["score"]
        data = []
        for index, ranked in enumerate(found):
            scores = {item["label"]: item["score"] for item in ranked}
            data.append({"index": index, "label": ranked[0]["label"],
                         "probs": [scores[label] for label in labels],
                         "num_classes": len(labels)})
        return _json({"id": f"classify-{request.scope.get(REQUEST_ID, '')}",
                      "object": "list", "created": int(time.time()), "model": served.name,
                      "data": data, "usage": _vllm_usage(usage)}, usage)

    @app.post("/predict", summary="classification, token classification or SQuAD")
    async def predict(body: PredictRequest) -> Response:
        needs("/predict")
        given = body.inputs
        single = not isinstance(given, list)
        items = [given] if single else given
        _check_inputs("inputs", items)
        too_many("inputs", len(items))
        questions = [isinstance(item, QuestionContext) for item in items]
        if served.task == "squad":
            if not all(questions):
                raise RequestError(422, "inputs: a SQuAD model takes {\"question\", "
                                   "\"context\"} objects", "inputs")
            for index, item in enumerate(items):
                for key in ("question", "context"):
                    if not getattr(item, key).strip():
                        raise RequestError(422, f"inputs[{index}].{key} is empty", "inputs")
            found, usage = await work(served.answer, [item.model_dump() for item in items])
        elif any(questions):
            raise RequestError(422, f"inputs: {{\"question\", \"context\"}} is for a SQuAD "
                               f"model; {served.name} is a {served.task} model", "inputs")
        elif served.task == "token-classification":
            if not all(isinstance(item, str) for item in items):
                raise RequestError(422, "inputs: a token-classification model takes texts, "
                                   "not pairs", "inputs")
            found, usage = await work(served.entities, items)
        else:
            found, usage = await work(served.classify, items, body.raw_scores, body.truncate,
                                      "inputs", body.truncation_direction.lower())
        counted(usage)
        return _json(found[0] if single else found, usage)

    @app.post("/rerank", summary="TEI-compatible reranking with a cross-encoder (or "
                                  "Infinity's, given documents)")
    async def rerank(body: RerankBody, request: Request) -> Response:
        needs("/rerank")
        if isinstance(body, InfinityRerankRequest):
            return await infinity_rerank(body, request)
        _check_inputs("query", [body.query])
        _check_inputs("texts", body.texts)
        too_many("texts", len(body.texts))
        ranked, usage = await work(served.rerank, body.query, body.texts, body.raw_scores,
                                   body.truncate, body.return_text,
                                   body.truncation_direction.lower())
        counted(usage)
        return _json(ranked, usage)

    async def infinity_rerank(body: InfinityRerankRequest, request: Request) -> Response:
        if body.model != INFINITY_ANY_MODEL:
            known_model(body.model)
        _check_inputs("query", [body.query])
        _check_inputs("documents", body.documents)
        too_many("documents", len(body.documents))
        ranked, usage = await work(served.rerank, body.query, body.documents, body.raw_scores)
        counted(usage)
        results = [{"relevance_score": item["score"], "index": item["index"],
                    "document": body.documents[item["index"]] if body.return_documents
                    else None} for item in ranked[:body.top_n]]
        return _json({"object": "rerank", "results": results, "model": served.name,
                      "usage": {"prompt_tokens": usage.tokens, "total_tokens": usage.tokens},
                      "id": request.scope.get(REQUEST_ID, ""), "created": int(time.time())},
                     usage)

    @app.post("/v1/rerank", summary="Cohere-compatible reranking (also Jina's and vLLM's)")
    @app.post("/v2/rerank", summary="Cohere-compatible reranking, v2")
    async def cohere_rerank(body: CohereRerankRequest, request: Request) -> Response:
        path = request.url.path
        needs(path)
        known_model(body.model)
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        _check_inputs("query", [body.query])
        _check_inputs("documents", documents)
        too_many("documents", len(documents))
        texts, cut = documents, 0
        if body.max_tokens_per_doc is not None:
            texts, cut = await work(served.first_tokens, documents, body.max_tokens_per_doc)
        ranked, usage = await work(served.rerank, body.query, texts)
        usage.truncated += cut
        counted(usage)
        results = []
        returned = body.return_documents
        if returned is None:  # v1's default is Jina's and vLLM's (Cohere's v2 returns none)
            returned = path.startswith("/v1/")
        for item in ranked[:body.top_n or None]:
            result: dict[str, Any] = {"index": item["index"], "relevance_score": item["score"]}
            if returned:
                result["document"] = {"text": documents[item["index"]]}
            results.append(result)
        return _json({"id": request.scope.get(REQUEST_ID, ""), "results": results,
                      "model": served.name, "usage": {"total_tokens": usage.tokens},
                      "meta": {"api_version": {"version": path[2]},
                               "tokens": {"input_tokens": usage.tokens, "output_tokens": 0}}},
                     usage)

    @app.post("/tokenize", summary="TEI-compatible tokenization")
    async def tokenize(body: TokenizeRequest) -> Response:
        texts = [body.inputs] if isinstance(body.inputs, str) else body.inputs
        _check_inputs("inputs", texts)
        too_many("inputs", len(texts))
        return _json(await work(served.tokenize, texts, body.add_special_tokens))

    @app.post("/decode", summary="TEI-compatible decoding of token ids")
    async def decode(body: DecodeRequest) -> Response:
        rows = body.ids if body.ids and isinstance(body.ids[0], list) else [body.ids]
        _check_inputs("ids", rows)
        too_many("ids", len(rows))
        return _json(await work(served.decode, rows, body.skip_special_tokens))

    @app.get("/health", summary="200 once the model is loaded and warmed")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/info", summary="the model and the server's limits")
    async def info() -> dict[str, Any]:
        return {**served.info(), "routes": list(served.routes()), "version": __version__,
                "max_batch_tokens": config.max_batch_tokens, "max_wait_ms": config.max_wait_ms,
                "max_padding": config.max_padding,
                "max_batch_rows": config.max_batch_rows or (1 if served.batch_dependent
                                                            else None),
                "max_client_batch_size": config.max_client_batch_size,
                "max_concurrent_requests": config.max_concurrent_requests,
                "payload_limit": config.payload_limit, "workers": config.workers,
                "threads": config.threads, "auth": api_key is not None,
                "cors_allow_origin": config.cors_allow_origin, "pid": os.getpid()}

    @app.get("/metrics", summary="Prometheus metrics")
    async def prometheus() -> Response:
        body, content_type = metrics.exposition()
        return Response(body, media_type=content_type)

    # TEI's other names for these routes, so its clients and hosts find them: POST / (and
    # SageMaker's /invocations) for the model's own route, /embeddings without /v1, and the
    # health routes of Inference Endpoints (GET /) and SageMaker (GET /ping).
    own = {"/embed": embed, "/predict": predict, "/rerank": rerank}[served.own_route()]
    for path in ("/", "/invocations"):
        app.add_api_route(path, own, methods=["POST"],
                          summary=f"the model's own route, {served.own_route()} (as TEI)")
    app.add_api_route("/embeddings", embeddings, methods=["POST"],
                      summary="/v1/embeddings, as TEI also names it")
    for path in ("/", "/ping"):
        app.add_api_route(path, health, methods=["GET"], summary="/health, as TEI also names it")

    started_at = time.time()
    guard = Guard(app, config, api_key, metrics)
    if not config.cors_allow_origin:
        return guard
    # Outside the guard: a browser's preflight (OPTIONS) carries no key and gets no body.
    return CORSMiddleware(guard, allow_origins=config.cors_allow_origin,
                          allow_methods=["GET", "POST", "HEAD"],
                          allow_headers=["Authorization", "Content-Type"],
                          expose_headers=[*TIMING_HEADERS, "Retry-After", "x-request-id"])


# TEI's per-request headers (milliseconds, whole numbers as TEI writes them), and ours.
TIMING_HEADERS = ("x-compute-time", "x-compute-tokens", "x-compute-characters", "x-total-time",
                  "x-tokenization-time", "x-queue-time", "x-inference-time", "x-prompt-tokens",
                  "x-truncated-inputs")


def _json(value: Any, usage: Usage | None = None) -> Response:
    """A JSON response built by `json.dumps` (far quicker than FastAPI's encoder on vectors),
    with the request's tokens, characters and times in headers as TEI sends them: the time
    encoding its inputs, waiting in the batcher and in model runs, and all of it (from the
    encoding to the answer written here)."""
    body = json.dumps(value, allow_nan=False)
    headers = {}
    if usage is not None:
        total = _ms(time.monotonic() - usage.began)
        headers = {"x-compute-time": total, "x-compute-tokens": str(usage.tokens),
                   "x-compute-characters": str(usage.characters), "x-total-time": total,
                   "x-tokenization-time": _ms(usage.encode_seconds),
                   "x-queue-time": _ms(usage.queue_seconds),
                   "x-inference-time": _ms(usage.inference_seconds),
                   "x-prompt-tokens": str(usage.tokens),
                   "x-truncated-inputs": str(usage.truncated)}
    return Response(body, media_type="application/json", headers=headers)


def _vllm_usage(usage: Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.tokens, "total_tokens": usage.tokens, "completion_tokens": 0}


def _ms(seconds: float) -> str:
    return str(max(0, round(1000 * seconds)))


class Guard:
    """The ASGI layer in front of every route: metrics, body limit, API key, bound on requests
    in flight. Plain ASGI, so a refused request never reaches the framework."""

    def __init__(self, app: FastAPI, config: ServeConfig, api_key: str | None,
                 metrics: ServeMetrics) -> None:
        self.app = app
        self.config = config
        self.key = api_key.encode() if api_key else None
        self.metrics = metrics
        self.in_flight = 0
        self.known = {route.path for route in app.routes}

    async def __call__(self, scope: dict[str, Any], receive: Callable[[], Awaitable[Any]],
                       send: Callable[[Any], Awaitable[None]]) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = path if path in self.known else "other"
        started = time.perf_counter()
        status = [500]
        request_id = _request_id(scope)
        client_gone = False

        async def counting_send(message: dict[str, Any]) -> None:
            nonlocal client_gone
            if client_gone:
                return
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", []),
                                                  (b"x-request-id", request_id.encode())]}
            try:
                await _within(self.config.client_timeout_s, send(message))
            except asyncio.TimeoutError:
                client_gone = True
                EXPECTED_ERRORS.given_up += 1
                self._stalled(path, request_id, "answer", "did not take its answer")
            except RuntimeError as error:
                # The client reset the connection (or the kernel dropped it: TCP_USER_TIMEOUT)
                # and uvloop refuses the write before uvicorn hears of it: the client has gone,
                # as uvicorn answers a disconnect, in silence.
                if "closed" not in str(error):
                    raise
                client_gone = True
                EXPECTED_ERRORS.given_up += 1

        probe = _is_probe(path, scope["method"])
        counts = path not in UNCOUNTED and not probe  # bounded by max_concurrent_requests
        if counts:
            self.in_flight += 1
            self.metrics.in_flight(1)
        try:
            refusal = self._refusal(scope, path, probe, counts)
            if refusal is not None:
                await refusal(scope, receive, counting_send)
                return
            body = await self._body(receive, path, request_id)
            if isinstance(body, Response):
                await body(scope, receive, counting_send)
                return
            if scope["method"] == "POST":  # the body is JSON whatever it says (curl -d)
                scope = {**scope, "headers": [
                    (name, value) for name, value in scope.get("headers") or []
                    if name != b"content-type"] + [(b"content-type", b"application/json")]}
            elif scope["method"] == "HEAD":
                # HEAD is GET without the body (RFC 9110), which HTTP servers must answer and
                # health checks send; uvicorn leaves the body out by its own scope's method.
                scope = {**scope, "method": "GET"}
            scope = {**scope, REQUEST_ID: request_id}
            await self.app(scope, _replay(body, receive), counting_send)
        finally:
            if counts:
                self.in_flight -= 1
                self.metrics.in_flight(-1)
            self.metrics.request(route, status[0], time.perf_counter() - started)

    def _refusal(self, scope: dict[str, Any], path: str, probe: bool,
                 counts: bool) -> Response | None:
        headers = dict(scope.get("headers") or [])
        if self.key is not None and not probe:
            given = headers.get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                return error_response(path, 401, "missing or wrong API key: send "
                                      "`Authorization: Bearer KEY`",
                                      headers={"WWW-Authenticate": "Bearer"})
        if counts and self.in_flight > self.config.max_concurrent_requests:
            return error_response(path, 503, f"the server has "
                                  f"{self.config.max_concurrent_requests} requests in flight "
                                  "(max_concurrent_requests); retry shortly",
                                  headers={"Retry-After": "1"})
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.config.payload_limit:
            return self._too_large(path)
        return None

    def _stalled(self, path: str, request_id: str, phase: str, what: str) -> None:
        self.metrics.stalled(phase)
        log.warning("%s (request %s): the client %s within %g s (client_timeout_s); gave up "
                    "on it", path, request_id, what, self.config.client_timeout_s)

    def _too_large(self, path: str) -> Response:
        return error_response(path, 413, f"the body is larger than "
                              f"{self.config.payload_limit} bytes (payload_limit)",
                              field="body")

    async def _body(self, receive: Callable[[], Awaitable[Any]], path: str, request_id: str
                    ) -> bytes | Response:
        """The whole body, read here so its size is bounded whatever the headers say, and
        its time: a body still arriving after `client_timeout_s` is a 408, so a client that
        stalls or vanishes mid-upload frees its place among `max_concurrent_requests` (and
        does not hold up a graceful stop) instead of keeping it for ever."""
        chunks: list[bytes] = []

        async def read() -> bytes | Response:
            size = 0
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    return b"".join(chunks)
                chunk = message.get("body", b"")
                size += len(chunk)
                if size > self.config.payload_limit:
                    return self._too_large(path)
                chunks.append(chunk)
                if not message.get("more_body", False):
                    return b"".join(chunks)

        try:
            return await _within(self.config.client_timeout_s, read())
        except asyncio.TimeoutError:
            self._stalled(path, request_id, "body", "did not finish sending its body")
            return error_response(path, 408, f"the body did not arrive within "
                                  f"{self.config.client_timeout_s:g} s (client_timeout_s)",
                                  field="body", headers={"Connection": "close"})


def _request_id(scope: dict[str, Any]) -> str:
    """The request's `X-Request-Id` as a proxy or client set it (up to 128 printable ASCII
    characters, so a header cannot forge log lines), else a new one: answered in the same
    header and named in the server's log lines about the request."""
    for name, value in scope.get("headers") or []:
        if name == b"x-request-id" and 0 < len(value) <= 128 \
                and all(33 <= byte <= 126 for byte in value):
            return value.decode("ascii")
    return uuid.uuid4().hex


async def _within(seconds: float, awaitable: Awaitable[Any]) -> Any:
    """`awaitable`'s result, or asyncio.TimeoutError once `seconds` pass (a timer on this
    task where Python has one, 3.11 on; `wait_for`'s extra task before)."""
    if hasattr(asyncio, "timeout"):
        async with asyncio.timeout(seconds):
            return await awaitable
    return await asyncio.wait_for(awaitable, seconds)


def _replay(body: bytes, receive: Callable[[], Awaitable[Any]]
            ) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A `receive` that gives the body read already, then waits on the real one (for a
    disconnect)."""
    sent = False

    async def replay() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


__all__ = ["Guard", "create_app", "error_body"]
