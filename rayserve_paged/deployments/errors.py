"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}, and the mapping of
every failure (validation, engine ValueErrors, Serve back-pressure, anything else) to one."""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from typing import Any

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from ray.serve.exceptions import BackPressureError
from starlette.exceptions import HTTPException as StarletteHTTPException

from rayserve_paged.core.lora import UnknownLoRAError
from rayserve_paged.core.sequence import SamplingParamsError
from rayserve_paged.engine.frontend import EngineUnavailable
from rayserve_paged.deployments.protocol import ErrorInfo, ErrorResponse, param_of
from rayserve_paged.deployments.sse import json_response

logger = logging.getLogger(__name__)

RETRY_AFTER_S = 1  # the Retry-After of an overloaded answer, unless Serve gives its own
# the Retry-After when this replica's engine died: Serve replaces the replica (its health
# check fails) in about 20 s on a small model; other replicas of a fleet serve meanwhile
ENGINE_RETRY_AFTER_S = 5
# the Retry-After while the fleet's first replica loads its model (routing: prefix's ingress)
STARTING_RETRY_AFTER_S = 5

class OpenAIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status_code: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        self.headers = dict(headers or {})
        if status_code == 401:
            self.headers["WWW-Authenticate"] = "Bearer"

    def response(self) -> Response:
        return json_response(ErrorResponse(error=self.info), self.status_code, self.headers or None)


def retry_later(message: str, code: str, retry_after_s: int) -> OpenAIError:
    """A 503 the client should retry after `retry_after_s` (the Retry-After header)."""
    return OpenAIError(503, message, type="server_error", code=code, headers={"Retry-After": str(retry_after_s)})


def engine_unavailable(message: str) -> OpenAIError:
    """503 + Retry-After: this replica's engine is gone until Serve replaces the replica."""
    return retry_later(message, "engine_unavailable", ENGINE_RETRY_AFTER_S)


def engine_starting(message: str) -> OpenAIError:
    """503 + Retry-After: no engine can take the request yet, and one is starting."""
    return retry_later(message, "engine_starting", STARTING_RETRY_AFTER_S)


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param if param is not None else param_of(message))


def overloaded(message: str, retry_after_s: float | None = None) -> OpenAIError:
    """503 with a Retry-After (whole seconds, rounded up, at least 1): the openai client
    retries it."""
    seconds = RETRY_AFTER_S if retry_after_s is None else max(1, math.ceil(retry_after_s))
    return retry_later(message, "overloaded", seconds)


def forbidden(message: str, param: str | None = None) -> OpenAIError:
    """403: the caller's API key may not ask for this (a priority past its limit)."""
    return OpenAIError(403, message, type="permission_error", param=param, code="permission_denied")


class RequestBodyRefused(StarletteHTTPException):
    """Raised while the body is read. An HTTPException, so FastAPI's body parsing lets it
    through instead of turning it into "There was an error parsing the body"."""

    def __init__(self, error: OpenAIError) -> None:
        super().__init__(error.status_code)
        self.error = error


class RequestBodyTooLarge(RequestBodyRefused):
    def __init__(self, max_bytes: int) -> None:
        super().__init__(
            OpenAIError(
                413,
                f"the request body is larger than this server's limit of {max_bytes} bytes",
                code="request_too_large",
            )
        )


class RequestBodyTimeout(RequestBodyRefused):
    def __init__(self, timeout_s: float) -> None:
        super().__init__(
            OpenAIError(
                408,
                f"the request body was not received within {timeout_s:g} s (request_body_timeout_s); "
                "send the whole body at once",
                code="request_timeout",
            )
        )


def internal_error() -> OpenAIError:
    return OpenAIError(500, "internal server error (see the server log)", type="server_error")


def to_openai_error(exc: Exception, renames: dict[str, str] | None = None) -> OpenAIError:
    """OpenAIError as is; a dead engine -> 503 + Retry-After; Serve's back-pressure -> 503
    overloaded; engine ValueErrors
    (RequestError, SamplingParamsError, possibly wrapped in a RayTaskError that is still a
    ValueError) -> 400; anything else -> 500."""
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineUnavailable):  # also through a RayTaskError, which subclasses it
        return engine_unavailable(f"the engine of this replica is unavailable; retry later ({exc})")
    if isinstance(exc, BackPressureError):
        return overloaded(
            "the server is overloaded: the engine's request queue is full; retry later",
            getattr(exc, "retry_after_s", None),
        )
    if isinstance(exc, UnknownLoRAError):  # an adapter unloaded after the request was checked
        cause = getattr(exc, "cause", None)
        return OpenAIError(404, str(cause if isinstance(cause, UnknownLoRAError) else exc), param="model",
                           code="model_not_found")  # fmt: skip
    if isinstance(exc, ValueError):
        cause = getattr(exc, "cause", None)  # RayTaskError: the engine's own exception
        message = str(cause if isinstance(cause, ValueError) else exc)
        field = param_of(message)
        if renames and field in renames:
            message = renames[field] + message[len(field) :]
            field = renames[field]
        return OpenAIError(400, message, param=field)
    logger.error("request failed", exc_info=exc)
    return internal_error()


def validation_error(exc: RequestValidationError) -> OpenAIError:
    """FastAPI's 422 as an OpenAI 400 naming the field(s)."""
    problems: dict[str, list[str]] = {}
    for error in exc.errors():
        kind = error.get("type", "")
        if kind == "json_invalid":
            detail = (error.get("ctx") or {}).get("error", "")
            return OpenAIError(400, f"invalid JSON body: {detail}".rstrip(": "))
        field = _field_path(error.get("loc", ()))
        if kind == "extra_forbidden":
            message = "unknown field (not supported by this server)"
        elif kind == "missing":
            message = "field required"
        else:
            message = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if message not in problems.setdefault(field, []):
            problems[field].append(message)
    if not problems:
        return OpenAIError(400, "invalid request body")
    text = "; ".join(f"{field or 'body'}: {', '.join(messages)}" for field, messages in list(problems.items())[:3])
    first = next(iter(problems))
    return OpenAIError(400, text, param=first or None)


def _field_path(loc: Iterable[Any]) -> str:
    """("body", "messages", 0, "content", "str") -> "messages[0].content" (union member tags dropped)."""
    path = ""
    for part in loc:
        if part == "body" and not path:
            continue
        if isinstance(part, int):
            path += f"[{part}]"
        elif part.isidentifier() and part not in _UNION_TAGS:
            path += f".{part}" if path else part
    return path


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "literal"})


def body_parse_error(cause: BaseException | None) -> OpenAIError:
    """FastAPI's "There was an error parsing the body" (a body json.loads raised on, other
    than a JSONDecodeError) as a 400 that says what is wrong with the body."""
    if isinstance(cause, UnicodeDecodeError):
        why = f"not UTF-8 (byte 0x{cause.object[cause.start]:02x} at offset {cause.start})"
    elif isinstance(cause, RecursionError):
        why = "nested too deeply"
    else:
        why = "not parsable"
    return OpenAIError(400, f"invalid JSON body: {why}")
