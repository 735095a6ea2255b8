"""Errors in each API's own shape, on every failure.

`APIError` is what handlers raise; the handlers installed by `install_error_handlers`
turn it, FastAPI's validation errors (422 by default, 400 here), unknown routes and
unexpected exceptions into the error object of the API the request's path belongs to:

    OpenAI (/v1/*, the rest)   {"error": {"message", "type", "param", "code"}}
    Anthropic (/v1/messages*)  {"type": "error", "error": {"type": "invalid_request_error",
                                                           "message"}}
    Ollama (/api/*)            {"error": "<message>"}
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.frontend.async_engine import EngineRequestError, EngineUnresponsiveError
from engine.frontend.core_client import EngineDeadError
from engine.frontend.processor import PromptError
from engine.sampling_params import SamplingParamsError
from server.common.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    431: "invalid_request_error",
    500: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    def __init__(self, status_code: int, message: str, param: str | None = None,
                 code: str | None = None, type: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status_code, "invalid_request_error")
        self.headers = dict(headers or {})

    def to_body(self, path: str | None = None) -> dict:
        """The error object of the API that serves `path` (OpenAI's when None)."""
        style = error_style(path)
        if style == "anthropic":
            return {"type": "error", "error": {"type": self.anthropic_type, "message": self.message}}
        if style == "ollama":
            return {"error": self.message}
        return self.to_response_model().model_dump()

    @property
    def anthropic_type(self) -> str:
        """Anthropic's error type for this status (its API's documented table)."""
        return _ANTHROPIC_TYPES.get(self.status_code, "api_error" if self.status_code >= 500
                                    else "invalid_request_error")

    def to_response_model(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type,
                                             param=self.param, code=self.code))

    def to_json(self) -> str:
        return self.to_response_model().model_dump_json()

    def to_response(self, path: str | None = None) -> JSONResponse:
        """The error as a JSON response in the shape of the API that serves `path`."""
        headers = dict(self.headers)
        if self.status_code == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse(self.to_body(path), self.status_code, headers=headers or None)


_ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
    500: "api_error", 503: "overloaded_error", 504: "timeout_error",
}


def error_style(path: str | None) -> str:
    """Whose error shape a request to `path` gets: "anthropic", "ollama" or "openai"."""
    if path is None:
        return "openai"
    if path == "/v1/messages" or path.startswith("/v1/messages/"):
        return "anthropic"
    if path.startswith("/api/"):
        return "ollama"
    return "openai"


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param, code)


def from_exception(exc: BaseException) -> APIError:
    """Map engine-side exceptions to API errors (anything unknown is a 500)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, SamplingParamsError):
        return APIError(400, str(exc), exc.param, "invalid_value")
    if isinstance(exc, PromptError):
        return APIError(400, str(exc), exc.param, exc.code or "invalid_value")
    if isinstance(exc, EngineRequestError):
        if exc.engine_dead:  # the engine died under this request
            return APIError(503, f"The engine is not running: {exc}", code="engine_dead")
        return APIError(500, f"The engine failed the request: {exc}", code="engine_error")
    if isinstance(exc, EngineDeadError):
        return APIError(503, f"The engine is not running: {exc}", code="engine_dead")
    if isinstance(exc, EngineUnresponsiveError):
        return APIError(503, f"The engine is not responding: {exc}", code="engine_unresponsive")
    logger.exception("unexpected error", exc_info=exc)
    return APIError(500, f"Internal server error: {type(exc).__name__}: {exc}",
                    code="internal_error")


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "none", "dict", "list"})


def _param_from_loc(loc: tuple) -> str | None:
    parts = [str(p) for p in loc if p != "body"]
    # Drop pydantic's union-branch markers (e.g. "list[int]", "function-after[...]",
    # "constrained-int", "str").
    parts = [p for p in parts if "[" not in p and "-" not in p and p not in _UNION_TAGS]
    if not parts:
        return None
    param = parts[0]
    for part in parts[1:]:
        param += f"[{part}]" if part.isdigit() else f".{part}"
    return param


def validation_error(exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    if not errors:
        return bad_request("Invalid request.")
    first = errors[0]
    kind = first.get("type", "")
    param = _param_from_loc(tuple(first.get("loc", ())))
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", first.get("msg", ""))
        return bad_request(f"Malformed JSON in the request body: {detail}", None, "invalid_json")
    if kind == "extra_forbidden":
        return bad_request(f"Unrecognized request argument supplied: {param}", param,
                           "unsupported_parameter")
    if kind == "missing":
        if param is None:
            return bad_request("The request body is missing or not a JSON object.", None,
                               "invalid_json")
        return bad_request(f"Missing required parameter: '{param}'.", param, "missing_required_parameter")
    if kind in ("model_attributes_type", "dict_type") and param is None:
        return bad_request("The request body must be a JSON object.", None, "invalid_json")
    message = first.get("msg", "invalid value")
    if len(errors) > 1 and any(_param_from_loc(tuple(e.get("loc", ()))) == param for e in errors[1:]):
        message = "; ".join(e.get("msg", "") for e in errors[:3])
    where = f"'{param}'" if param else "the request"
    return bad_request(f"Invalid value for {where}: {message}", param, "invalid_value")


def _count_failure(request: Request, error: APIError) -> None:
    """Count an inference request answered with an error (request_failure_total)."""
    state = getattr(request.app.state, "server", None)
    if state is not None:
        state.metrics.record_error(error, request.url.path)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        _count_failure(request, exc)
        return exc.to_response(request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        error = validation_error(exc)
        _count_failure(request, error)
        return error.to_response(request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "Error"
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        message = detail if detail and detail != phrase else phrase
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, message, code=code).to_response(request.url.path)

    app.add_middleware(CatchAllMiddleware)


class CatchAllMiddleware:
    """Answer an unexpected exception with a 500 error object and keep the connection.

    (Starlette's own last-resort handler re-raises, which makes the server drop the
    connection.) A response already under way cannot be changed; it is left as is.
    """

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def send_tracking(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, send_tracking)
        except Exception as exc:  # noqa: BLE001
            if started:
                raise
            await from_exception(exc).to_response(scope.get("path"))(scope, receive, send)


# Documented on every inference route (FastAPI `responses=`).
ERROR_RESPONSES = {
    400: {"model": ErrorResponse, "description": "Invalid request (bad field, too long, ...)"},
    401: {"model": ErrorResponse, "description": "Missing or wrong API key"},
    404: {"model": ErrorResponse, "description": "Unknown model"},
    413: {"model": ErrorResponse, "description": "Request body over --max-request-body-bytes"},
    431: {"model": ErrorResponse, "description": "Request headers over --max-header-bytes"},
    500: {"model": ErrorResponse, "description": "The engine failed the request"},
    503: {"model": ErrorResponse, "description": (
        "Overloaded (the queue is full; see Retry-After), shutting down, or the engine "
        "is not running")},
    504: {"model": ErrorResponse, "description": "The request exceeded --request-timeout"},
}


def error_docs(model: type) -> dict:
    """ERROR_RESPONSES with another API's error object (`model`) as the body."""
    return {status: {**doc, "model": model} for status, doc in ERROR_RESPONSES.items()}
