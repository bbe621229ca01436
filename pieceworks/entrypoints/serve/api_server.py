"""The OpenAI-compatible HTTP app (FastAPI) and how it runs (uvicorn).

``build_app`` wires the routes (``/v1/completions``, ``/v1/chat/completions``, ``/v1/models``
and ``/v1/models/{id}``, ``/tokenize``, ``/detokenize``, ``/health``, ``/metrics``) over a
``ServingContext``; the two generation routes are answered by the guard itself, past FastAPI
(``generation_routes.py``). ``serve`` runs it with uvicorn until
SIGINT or SIGTERM. On a signal uvicorn stops accepting connections and waits for the requests in
flight, streams included, to finish; then the app's shutdown stops the engine loop and frees the
engine. A guard in front of the routes answers before any handler runs: 401 for a missing or
wrong API key on ``/v1/*`` (``/health`` and ``/metrics`` stay open, as in vLLM) and 400 for a
body over ``max_body_bytes``. Every refusal is JSON in OpenAI's error shape, an unknown route
(404) or a route called with the wrong method (405) included.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from pieceworks.entrypoints.serve.chat import create_chat_completion
from pieceworks.entrypoints.serve.completions import create_completion
from pieceworks.entrypoints.serve.errors import (
    APIError,
    error_body,
    error_response,
    internal_error_response,
)
from pieceworks.entrypoints.serve.event_stream import SERVER_SEND
from pieceworks.entrypoints.serve.generation_routes import GenerationRoutes
from pieceworks.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest
from pieceworks.entrypoints.serve.serving import ServingContext
from pieceworks.entrypoints.serve.tokenization import detokenize, tokenize
from pieceworks.entrypoints.serve.tool_calls import TOOL_CALL_PARSERS
from pieceworks.entrypoints.serve.validation import model_field, parse_request

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024  # far above any prompt max_model_len allows
ROUTES = (
    "POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{id}, "
    "POST /tokenize, POST /detokenize, GET /health, GET /metrics"
)


class RequestGuard:
    """ASGI middleware: the API key and the body-size limit, checked before any route runs.
    It also hands the routes the server's own ``send`` (``SERVER_SEND``, for ``EventStream``),
    and a generation request (``routes``) to its handler with the body read."""

    def __init__(
        self,
        app: Any,
        api_key: str | None,
        max_body_bytes: int,
        routes: GenerationRoutes | None = None,
    ) -> None:
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.routes = routes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        scope[SERVER_SEND] = send  # a stream's body bypasses the inner layers' send wrappers
        if (
            self.api_key is not None
            and scope["path"].startswith("/v1")
            and not self._authorized(scope)
        ):
            message = "a missing or wrong API key: send 'Authorization: Bearer <key>'"
            return await self._refuse(send, 401, message)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        body = await self._read_body(receive)
        if body is None:
            message = f"the request body is larger than the {self.max_body_bytes} bytes accepted"
            return await self._refuse(send, 400, message)
        routes = self.routes
        route = routes.get(scope["method"], scope["path"]) if routes is not None else None
        if routes is not None and route is not None:
            await routes.answer(route, body, scope, receive, send)
            return None
        return await self.app(scope, _replay(body, receive), send)

    def _authorized(self, scope: Any) -> bool:
        headers = dict(scope["headers"])
        given = headers.get(b"authorization", b"").decode("latin-1")
        expected = f"Bearer {self.api_key}"
        return hmac.compare_digest(given.encode(), expected.encode())

    async def _read_body(self, receive: Any) -> bytes | None:
        """The whole body, or None as soon as it passes the limit."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"".join(chunks)
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                return b"".join(chunks)

    @staticmethod
    async def _refuse(send: Any, status: int, message: str) -> None:
        response = JSONResponse(error_body(status, message), status_code=status)
        await response({"type": "http"}, _no_receive, send)


def _replay(body: bytes, receive: Any) -> Any:
    """A receive that hands the app the body already read, then the connection's own events."""
    sent = False

    async def replay() -> Any:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _no_receive() -> Any:
    return {"type": "http.disconnect"}


def build_app(
    ctx: ServingContext,
    served_model_names: list[str],
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    drain_timeout_s: float = 30.0,
    tool_call_parser: str | None = None,
    enable_auto_tool_choice: bool = False,
) -> Any:
    """The ASGI app serving ``ctx``: FastAPI routes behind the ``RequestGuard``. The tool
    options are ``--tool-call-parser`` and ``--enable-auto-tool-choice`` (vLLM's)."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"tool call parser {tool_call_parser!r} is unknown; use one of "
            f"{', '.join(TOOL_CALL_PARSERS)}"
        )
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (hermes, llama3_json)")
    ctx.tool_call_parser = tool_call_parser
    ctx.enable_auto_tool_choice = enable_auto_tool_choice

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx.engine.start()
        yield
        await _drain(ctx, drain_timeout_s)
        ctx.engine.shutdown()

    app = FastAPI(title="pieceworks", lifespan=lifespan)
    created = int(time.time())

    def check_model(name: str | None) -> None:
        if name is not None and name not in served_model_names:
            raise APIError(
                404, f"the model {name!r} does not exist; this server serves {served_model_names}"
            )

    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> Response:
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> Response:
        """Starlette's own refusals (no such route, wrong method) in OpenAI's shape."""
        route = f"{request.method} {request.url.path}"
        if error.status_code == 404:
            message = f"there is no route {route}; this server serves {ROUTES}"
        elif error.status_code == 405:
            headers = {key.lower(): value for key, value in (error.headers or {}).items()}
            allowed = headers.get("allow", "another method")
            message = f"{route} is not allowed: this route takes {allowed}"
        else:
            message = f"{route}: {error.detail}"
        return JSONResponse(
            error_body(error.status_code, message), error.status_code, headers=error.headers
        )

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> Response:
        return internal_error_response(error)

    routes = GenerationRoutes(ctx, check_model)

    # The guard answers POST on these two paths itself; the app's routes answer the same way
    # (an app used without the guard) and name the method in a 405.
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = parse_request(await request.body(), CompletionRequest, check_model)
        return await create_completion(ctx, body, request.receive)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = parse_request(await request.body(), ChatCompletionRequest, check_model)
        return await create_chat_completion(ctx, body, request.receive)

    def model_card(name: str) -> dict[str, Any]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "pieceworks",
            "root": ctx.model_name,
            "max_model_len": ctx.limits.max_model_len,
        }

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [model_card(name) for name in served_model_names]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        check_model(model_id)
        return model_card(model_id)

    @app.post("/tokenize")
    async def tokenize_route(request: Request) -> dict[str, Any]:
        check_model(model_field(await request.body()))
        return await tokenize(ctx, request)

    @app.post("/detokenize")
    async def detokenize_route(request: Request) -> dict[str, Any]:
        check_model(model_field(await request.body()))
        return await detokenize(ctx, request)

    @app.get("/health")
    async def health() -> Response:
        if ctx.engine.is_running:
            return Response(status_code=200)
        return JSONResponse(error_body(503, "the engine loop is not running"), status_code=503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(
            ctx.metrics.render(ctx.engine.stats), media_type="text/plain; version=0.0.4"
        )

    return RequestGuard(app, api_key, max_body_bytes, routes)


async def _drain(ctx: ServingContext, timeout_s: float) -> None:
    """Wait (up to ``timeout_s``) for requests still live in the engine to finish."""
    deadline = time.monotonic() + timeout_s
    while ctx.engine.num_live_requests and time.monotonic() < deadline:
        await asyncio.sleep(0.05)


def serve(app: Any, host: str, port: int, log_level: str = "info") -> None:
    """Run ``app`` with uvicorn until SIGINT/SIGTERM; in-flight requests finish first."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_keep_alive=5)
