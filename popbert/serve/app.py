"""`popbert serve`'s HTTP face: a FastAPI application over one export.

Routes: OpenAI's `POST /v1/embeddings` and `GET /v1/models`; Text Embeddings Inference's `POST
/embed`, `/embed_all`, `/similarity`, `/predict`, `/rerank`, `/tokenize` and `/decode` (its other
names: `POST /`, `/invocations`, `/embeddings`, `GET /`, `/ping`); Cohere's `POST /v1/rerank` and
`/v2/rerank` (Jina's and vLLM's shape too) and Infinity's body on `/rerank`; vLLM's `/score`,
`/v1/score` and `/classify`; `GET /health`, `/info` and `/metrics` (Prometheus); the OpenAPI
schema at `/docs`.

The bodies each route takes are `popbert.serve.bodies`; what a route computes is
`popbert.serve.routes`; rows from all requests meet in one `RowBatcher`. In front of the routes,
`popbert.serve.guard.Guard` holds what every request goes through first (limits, key, timeouts,
metrics); CORS, when origins are allowed, sits outside it. Errors are OpenAI's error object under
`/v1/` and `/v2/`, TEI's (`{"error", "error_type"}`) elsewhere; nothing a client sends makes a
5xx.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from popbert import __version__
from popbert.config.sections import ServeConfig
from popbert.serve.batcher import BatchRecord, RowBatcher
from popbert.serve.bodies import (
    INFINITY_ANY_MODEL,
    ClassifyRequest,
    CohereRerankRequest,
    DecodeRequest,
    EmbedAllRequest,
    EmbeddingsRequest,
    EmbedRequest,
    InfinityRerankRequest,
    PredictRequest,
    QuestionContext,
    RerankBody,
    ScoreRequest,
    SimilarityRequest,
    TokenizeRequest,
    check_inputs,
    validation_message,
)
from popbert.serve.guard import EXPECTED_ERRORS, REQUEST_ID, Guard, error_response
from popbert.serve.metrics import ServeMetrics
from popbert.serve.routes import RequestError, Served, Usage, encode_vectors

log = logging.getLogger(__name__)


@dataclass
class ServerState:
    """What the routes share: the model, its batcher, the limits, the metrics."""

    served: Served
    config: ServeConfig
    metrics: ServeMetrics
    batcher: RowBatcher | None = None
    first_request_logged: bool = False


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
        if served.default_prompt is not None:
            log.info("texts whose request names no prompt_name get the prompt %r first",
                     served.default_prompt)
        try:
            yield
        finally:
            served.predictor.batcher = None
            await run_in_threadpool(state.batcher.close)

    app = FastAPI(title="popbert serve", version=__version__, lifespan=lifespan,
                  description=f"popbert's {served.task} export {served.name} over HTTP: "
                              "OpenAI-, Text Embeddings Inference-, Cohere-, vLLM- and "
                              "Infinity-compatible routes.")
    app.state.popbert = state

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, error: RequestError) -> JSONResponse:
        return error_response(request.url.path, error.status, str(error), error.field,
                              error.kind)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, error: RequestValidationError) -> JSONResponse:
        message, field = validation_message(list(error.errors()))
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
        given = _listed(body.input)
        if given and isinstance(given[0], int):
            given = [given]  # one input as token ids
        check_inputs("input", given)
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
        texts = _listed(body.inputs)
        check_inputs("inputs", texts)
        too_many("inputs", len(texts))
        vectors, usage = await work(served.embed, texts, body.prompt_name, body.truncate,
                                    "inputs", body.truncation_direction.lower())
        counted(usage)
        vectors = served.shape_vectors(vectors, body.dimensions, body.normalize)
        return _json(vectors.tolist(), usage)

    @app.post("/embed_all", summary="TEI-compatible token embeddings: every token's state, "
                                    "not pooled")
    async def embed_all(body: EmbedAllRequest) -> Response:
        needs("/embed_all")
        texts = _listed(body.inputs)
        check_inputs("inputs", texts)
        too_many("inputs", len(texts))

        def states_as_json() -> tuple[str, Usage]:
            # off the event loop (an answer of megabytes), and text by text: Python floats
            # for one text's states at a time, not for all of them
            states, usage = served.token_states(texts, body.prompt_name, body.truncate,
                                                "inputs", body.truncation_direction.lower(),
                                                config.max_batch_tokens)
            return "[" + ",".join(json.dumps(rows.tolist(), allow_nan=False)
                                  for rows in states) + "]", usage

        text, usage = await work(states_as_json)
        counted(usage)
        return _json_text(text, usage)

    @app.post("/similarity", summary="TEI-compatible sentence similarity")
    async def similarity(body: SimilarityRequest) -> Response:
        needs("/similarity")
        texts = [body.inputs.source_sentence, *body.inputs.sentences]
        check_inputs("inputs.source_sentence", texts[:1])
        check_inputs("inputs.sentences", texts[1:])
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
        firsts = _listed(body.text_1)
        seconds = _listed(body.text_2)
        check_inputs("text_1", firsts)
        check_inputs("text_2", seconds)
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
        return _json({"id": f"score-{_id_of(request)}", "object": "list",
                      "created": int(time.time()), "model": served.name, "data": data,
                      "usage": _vllm_usage(usage)}, usage)

    @app.post("/classify", summary="vLLM-compatible classification")
    async def classify(body: ClassifyRequest, request: Request) -> Response:
        needs("/classify")
        known_model(body.model)
        texts = _listed(body.input)
        check_inputs("input", texts)
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
        return _json({"id": f"classify-{_id_of(request)}",
                      "object": "list", "created": int(time.time()), "model": served.name,
                      "data": data, "usage": _vllm_usage(usage)}, usage)

    @app.post("/predict", summary="classification, token classification or SQuAD")
    async def predict(body: PredictRequest) -> Response:
        needs("/predict")
        given = body.inputs
        single = not isinstance(given, list)
        items = [given] if single else given
        check_inputs("inputs", items)
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
        check_inputs("query", [body.query])
        check_inputs("texts", body.texts)
        too_many("texts", len(body.texts))
        ranked, usage = await work(served.rerank, body.query, body.texts, body.raw_scores,
                                   body.truncate, body.return_text,
                                   body.truncation_direction.lower())
        counted(usage)
        return _json(ranked, usage)

    async def infinity_rerank(body: InfinityRerankRequest, request: Request) -> Response:
        if body.model != INFINITY_ANY_MODEL:
            known_model(body.model)
        check_inputs("query", [body.query])
        check_inputs("documents", body.documents)
        too_many("documents", len(body.documents))
        ranked, usage = await work(served.rerank, body.query, body.documents, body.raw_scores)
        counted(usage)
        results = [{"relevance_score": item["score"], "index": item["index"],
                    "document": body.documents[item["index"]] if body.return_documents
                    else None} for item in ranked[:body.top_n]]
        return _json({"object": "rerank", "results": results, "model": served.name,
                      "usage": {"prompt_tokens": usage.tokens, "total_tokens": usage.tokens},
                      "id": _id_of(request), "created": int(time.time())},
                     usage)

    @app.post("/v1/rerank", summary="Cohere-compatible reranking (also Jina's and vLLM's)")
    @app.post("/v2/rerank", summary="Cohere-compatible reranking, v2")
    async def cohere_rerank(body: CohereRerankRequest, request: Request) -> Response:
        path = request.url.path
        needs(path)
        known_model(body.model)
        documents = [d if isinstance(d, str) else d.text for d in body.documents]
        check_inputs("query", [body.query])
        check_inputs("documents", documents)
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
        return _json({"id": _id_of(request), "results": results,
                      "model": served.name, "usage": {"total_tokens": usage.tokens},
                      "meta": {"api_version": {"version": path[2]},
                               "tokens": {"input_tokens": usage.tokens, "output_tokens": 0}}},
                     usage)

    @app.post("/tokenize", summary="TEI-compatible tokenization")
    async def tokenize(body: TokenizeRequest) -> Response:
        texts = _listed(body.inputs)
        check_inputs("inputs", texts)
        too_many("inputs", len(texts))
        return _json(await work(served.tokenize, texts, body.add_special_tokens,
                                body.prompt_name))

    @app.post("/decode", summary="TEI-compatible decoding of token ids")
    async def decode(body: DecodeRequest) -> Response:
        rows = body.ids if body.ids and isinstance(body.ids[0], list) else [body.ids]
        check_inputs("ids", rows)
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
    return _json_text(json.dumps(value, allow_nan=False), usage)


def _json_text(body: str, usage: Usage | None = None) -> Response:
    """`_json` of a body already written as JSON."""
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


def _listed(value: str | list[Any]) -> list[Any]:
    """A field that takes one input or a list of them, as a list."""
    return [value] if isinstance(value, str) else value


def _id_of(request: Request) -> str:
    """The request's X-Request-Id (set by the guard), for the answers that carry an `id`."""
    return request.scope.get(REQUEST_ID, "")


def _vllm_usage(usage: Usage) -> dict[str, int]:
    return {"prompt_tokens": usage.tokens, "total_tokens": usage.tokens, "completion_tokens": 0}


def _ms(seconds: float) -> str:
    return str(max(0, round(1000 * seconds)))


__all__ = ["create_app"]
