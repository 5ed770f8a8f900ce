"""The ASGI layer in front of every route of `popbert serve` (`Guard`): what each request goes
through before the framework sees it (the body limit, the API key, the bound on requests in
flight, the client's time to send its body and take its answer, HEAD as GET, the request
metrics, its X-Request-Id); and the error bodies, OpenAI's or TEI's by the route."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from popbert.config.sections import ServeConfig
from popbert.serve.metrics import ServeMetrics

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


__all__ = ["EXPECTED_ERRORS", "REQUEST_ID", "Guard", "error_body", "error_response"]
