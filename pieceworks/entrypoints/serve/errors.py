"""Errors the server answers with, in OpenAI's error shape (``{"error": {...}}``).

``APIError`` carries an HTTP status and a message meant for the client; handlers raise it and the
app turns it into a JSON response. Nothing here decides policy: the handlers and
``validation`` say which request is wrong and why.
"""

from __future__ import annotations

from typing import Any

from starlette.responses import JSONResponse

from pieceworks.logger import init_logger

logger = init_logger(__name__)

_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "BadRequestError",
    503: "ServiceUnavailableError",
    500: "InternalServerError",
}


class APIError(Exception):
    """A request the server refuses, with the status and the reason to send back."""

    def __init__(
        self, status_code: int, message: str, *, param: str | None = None, headers: Any = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def error_body(status_code: int, message: str, param: str | None = None) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _ERROR_TYPES.get(status_code, "APIError"),
            "param": param,
            "code": status_code,
        }
    }


def error_response(error: APIError) -> JSONResponse:
    return JSONResponse(
        error_body(error.status_code, error.message, error.param),
        status_code=error.status_code,
        headers=error.headers,
    )


def internal_error_response(error: Exception) -> JSONResponse:
    """The 500 of a request whose handler failed (logged with its traceback)."""
    logger.exception("request failed")
    return JSONResponse(error_body(500, f"the server failed: {error!r}"), status_code=500)
