"""Errors in the OpenAI/vLLM shape: ``{"error": {"message", "type", "param", "code"}}``.

``APIError`` carries the HTTP status, the error type and the offending field (``param``,
a dotted path such as ``documents.2.text``). ``from_exception`` maps the engine's and the
scheduler's errors; non-finite logits are a 500 that names the failure; anything
unexpected becomes a 500 whose message says nothing of the cause (the cause is logged
on the server).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pydantic import ValidationError

from kvblend.errors import ContextLengthError, InvalidRequestError, KvblendError, NonFiniteLogitsError

log = logging.getLogger("kvblend.server")
TYPES = {400: "BadRequestError", 401: "AuthenticationError", 403: "PermissionDeniedError",
         404: "NotFoundError", 405: "MethodNotAllowedError", 409: "ConflictError", 413: "RequestTooLargeError",
         429: "RateLimitError", 500: "InternalServerError", 501: "NotImplementedError",
         503: "ServiceUnavailableError", 504: "TimeoutError"}


class APIError(Exception):
    """An error answered to the client with ``status`` and the OpenAI error body."""

    def __init__(self, status: int, message: str, param: str | None = None, type_: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = type_ or TYPES.get(status, "BadRequestError")
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}

    def json(self) -> str:
        return json.dumps(self.body())


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


_TYPE_TAGS = {"str", "int", "float", "bool", "dict", "list", "none", "body"}


def _is_field(part: Any) -> bool:
    """Loc parts that name fields or indexes, not pydantic's union/validator tags."""
    if isinstance(part, int):
        return True
    text = str(part)
    return (text not in _TYPE_TAGS and "[" not in text and not text[:1].isupper()
            and not text.startswith("constrained-"))


def _loc(loc: tuple[Any, ...]) -> str:
    return ".".join(str(p) for p in loc if _is_field(p)) or "body"


def from_validation(exc: ValidationError | Any, prefix: tuple[Any, ...] = ()) -> APIError:
    """A pydantic/FastAPI validation failure as a 400 naming the first offending field
    (at most ten problems listed in the message)."""
    errors = exc.errors()
    parts = [f"{_loc(prefix + tuple(e['loc']))}: {e['msg'].removeprefix('Value error, ')}" for e in errors[:10]]
    param = _loc(prefix + tuple(errors[0]["loc"])) if errors else None
    return APIError(400, "; ".join(parts) or "invalid request", param)


def from_exception(exc: BaseException) -> APIError:
    """Map an engine/scheduler error to its status; unknown errors become a bare 500."""
    if isinstance(exc, APIError):
        return exc
    name = type(exc).__name__
    if isinstance(exc, ContextLengthError):
        return APIError(400, str(exc), "input_tokens", "BadRequestError")
    if name == "QueueFullError":
        retry = getattr(exc, "retry_after_s", None) or 1
        return APIError(429, str(exc) or "the server is busy; retry later", None,
                        headers={"Retry-After": str(max(1, int(round(retry))))})
    if name in ("DrainingError", "WorkerDeadError"):
        return APIError(503, str(exc) or "the server is shutting down")
    if "Deadline" in name or "Timeout" in name:
        return APIError(504, str(exc) or "the request ran past its deadline")
    if isinstance(exc, NonFiniteLogitsError):  # the model failed, not the request: a 500 that says how
        log.error("internal error: %s", exc)
        return APIError(500, f"internal server error: {exc}", type_="InternalServerError")
    if isinstance(exc, (InvalidRequestError, KvblendError)):
        return APIError(400, str(exc), getattr(exc, "field", None))
    log.error("internal error: %s", type(exc).__name__, exc_info=exc)
    return APIError(500, "internal server error (logged on the server)", type_="InternalServerError")
