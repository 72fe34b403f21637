"""OpenAI-style error bodies, and the handlers that turn every failure into one."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

from kvserve.logger import logger
from kvserve.server.protocol import ErrorInfo, ErrorResponse

_TYPES = {429: "rate_limit_error"}  # others: invalid_request_error below 500, server_error from 500


class APIError(Exception):
    """Raised by the routes; rendered as `{"error": {message, type, param, code}}`."""

    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(
            message=message,
            type=type or _TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error"),
            param=param,
            code=code,
        )
        self.headers = headers


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param=param)


def leading_field(message: str, fields: set[str], rename: dict[str, str] | None = None) -> str | None:
    """The field a message starts with ("temperature must be ..."), if it is one of `fields`."""
    m = re.match(r"[A-Za-z_]+", message)
    word = m.group(0) if m else ""
    word = (rename or {}).get(word, word)
    return word if word in fields else None


def value_error(e: ValueError, fields: set[str], rename: dict[str, str] | None = None) -> APIError:
    """A 400 for the engine's or SamplingParams' ValueError, whose message starts with the field name."""
    return bad_request(str(e), leading_field(str(e), fields, rename))


def error_response(status_code: int, info: ErrorInfo, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(ErrorResponse(error=info).model_dump(), status_code=status_code, headers=headers)


async def _api_error(_: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status_code, exc.info, exc.headers)


async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
    errors = exc.errors()
    if errors[0]["type"] == "json_invalid":
        e = errors[0]
        message = f"the body is not valid JSON: {e.get('ctx', {}).get('error', e['msg'])} at position {e['loc'][-1]}"
        return error_response(400, ErrorInfo(message=message, type="invalid_request_error"))
    # of a union's alternatives, the one that got furthest says best what is wrong
    first = max(errors, key=lambda e: len(e["loc"]))
    path = _field_path(first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    param = ".".join(path) or leading_field(msg, set(_body_fields(exc)))
    message = f"{'.'.join(path)}: {msg}" if path else msg
    return error_response(400, ErrorInfo(message=message, type="invalid_request_error", param=param))


def _body_fields(exc: RequestValidationError) -> list[str]:
    body = exc.body if isinstance(exc.body, dict) else {}
    return [k for k in body if isinstance(k, str)]


def _field_path(loc: tuple[int | str, ...]) -> list[str]:
    """Drop "body" and pydantic's union-branch labels ('str', 'list[constrained-int]', model names)."""
    labels = ("body", "str", "int", "float", "bool", "none")
    return [
        str(p) for p in loc if isinstance(p, int) or not (p in labels or p[:1].isupper() or any(c in p for c in "[]-"))
    ]


async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    info = ErrorInfo(
        message=str(exc.detail),
        type="invalid_request_error" if exc.status_code < 500 else "server_error",
    )
    return error_response(exc.status_code, info, getattr(exc, "headers", None))


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("internal error on %s %s", request.method, request.url.path, exc_info=exc)
    info = ErrorInfo(message="internal server error", type="server_error", code="internal_error")
    return error_response(500, info)


def add_exception_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
