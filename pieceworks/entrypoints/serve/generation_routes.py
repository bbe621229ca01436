"""The generation routes, ``POST /v1/completions`` and ``POST /v1/chat/completions``, served
from the outermost ASGI layer.

Every generation request takes one of these two routes, so what the app does around a handler is
paid once per request. ``RequestGuard`` (``api_server.py``) hands them the body it has already
read, and ``GenerationRoutes`` answers without FastAPI's and Starlette's layers (their
middleware, routing, request objects and dependency solving): the body is parsed and validated
in one pass (``validation.parse_request``, its ``model`` checked first), the handler runs, and
its response goes out. A refusal is the app's: an ``APIError`` answers in OpenAI's shape with its
status; any other exception answers 500 (logged) unless the response had started, and is then
raised to the server, as Starlette's outermost middleware does. Any other method on these paths
(a 405) and every other route still go through the FastAPI app.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from pydantic import BaseModel
from starlette.responses import Response

from pieceworks.entrypoints.serve.chat import create_chat_completion
from pieceworks.entrypoints.serve.completions import create_completion
from pieceworks.entrypoints.serve.errors import APIError, error_response, internal_error_response
from pieceworks.entrypoints.serve.protocol import ChatCompletionRequest, CompletionRequest
from pieceworks.entrypoints.serve.serving import ServingContext
from pieceworks.entrypoints.serve.validation import parse_request

# A route: its request model and its handler (context, parsed body, receive) -> response.
Handler = Callable[[ServingContext, Any, Any], Awaitable[Response]]
Route = tuple[type[BaseModel], Handler]


class GenerationRoutes:
    """``POST /v1/completions`` and ``POST /v1/chat/completions`` over ``ctx``; ``check_model``
    refuses (404) a ``model`` the server does not serve."""

    def __init__(self, ctx: ServingContext, check_model: Callable[[str | None], None]) -> None:
        self.ctx = ctx
        self.check_model = check_model
        self.routes: dict[str, Route] = {
            "/v1/completions": (CompletionRequest, create_completion),
            "/v1/chat/completions": (ChatCompletionRequest, create_chat_completion),
        }

    def get(self, method: str, path: str) -> Route | None:
        """The route of a request, or None for one the FastAPI app answers."""
        return self.routes.get(path) if method == "POST" else None

    async def answer(self, route: Route, body: bytes, scope: Any, receive: Any, send: Any) -> None:
        """Parse ``body``, run the route's handler and send its response (or the refusal)."""
        started = False

        def send_watched(message: Any) -> Awaitable[None]:
            nonlocal started
            started = True
            return send(message)  # type: ignore[no-any-return]

        request_model, handler = route
        try:
            try:
                request = parse_request(body, request_model, self.check_model)
                response = await handler(self.ctx, request, receive)
            except APIError as error:
                response = error_response(error)
            await response(scope, receive, send_watched)
        except Exception as error:
            if not started:
                await internal_error_response(error)(scope, receive, send)
            raise
