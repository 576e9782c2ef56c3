"""What every request passes before a route runs: API key -> tenant, body size, draining.

A plain ASGI middleware (not ``BaseHTTPMiddleware``, which breaks ``receive`` and with it
the disconnect detection of streams). With keys configured, a missing or unknown key
gets a 401 in the OpenAI error shape on every ``/v1`` path, known route or not; the
tenant is put in ``scope["state"]["tenant"]``. ``/metrics`` needs the admin key when one
is set. A declared body over the limit is refused with 413 before it is read (a body
without Content-Length is bounded while reading, see ``read_json``).
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Callable

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from kvblend.server.errors import APIError

DEFAULT_TENANT = "default"


def bearer(headers: dict[bytes, bytes] | list[tuple[bytes, bytes]]) -> str | None:
    for name, value in headers:
        if name.lower() == b"authorization":
            scheme, _, token = value.decode("latin-1").partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


def tenant_for(token: str | None, api_keys: dict[str, str]) -> str | None:
    """The tenant of ``token`` (constant-time over every key), or None when unknown."""
    found = None
    for key, tenant in api_keys.items():
        if token is not None and hmac.compare_digest(key.encode(), token.encode()):
            found = tenant
    return found


class ApiKeyAuth:
    """ASGI middleware; ``draining()`` says whether new /v1 work must be refused (503)."""

    def __init__(self, app: ASGIApp, api_keys: dict[str, str], admin_key: str | None, max_body_bytes: int,
                 draining: Callable[[], bool]) -> None:
        self.app = app
        self.api_keys = dict(api_keys)
        self.admin_key = admin_key
        self.max_body_bytes = max_body_bytes
        self.draining = draining

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        try:
            self._check(scope, path)
        except APIError as err:
            await _send_error(send, err)
            return
        await self.app(scope, receive, send)

    def _check(self, scope: Scope, path: str) -> None:
        token = bearer(scope["headers"])
        if path == "/metrics" and self.admin_key is not None:
            if token is None or not hmac.compare_digest(self.admin_key.encode(), token.encode()):
                raise APIError(401, "the metrics endpoint needs the admin key (Authorization: Bearer ...)")
        if not (path == "/v1" or path.startswith("/v1/")):
            return
        tenant = DEFAULT_TENANT
        if self.api_keys:
            tenant = tenant_for(token, self.api_keys)
            if tenant is None:
                message = "missing API key" if token is None else "invalid API key"
                raise APIError(401, f"{message}: send Authorization: Bearer <key>", type_="AuthenticationError")
        scope.setdefault("state", {})["tenant"] = tenant
        if self.draining():
            raise APIError(503, "the server is shutting down and takes no new requests")
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            raise APIError(413, f"the request body has {int(length)} bytes; the limit is {self.max_body_bytes}",
                           "body")


async def _send_error(send: Send, err: APIError) -> None:
    body = err.json().encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode(), v.encode()) for k, v in err.headers.items()]
    await send({"type": "http.response.start", "status": err.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def tenant_of(request: Request) -> str:
    return request.scope.get("state", {}).get("tenant", DEFAULT_TENANT)


async def read_json(request: Request, limit: int) -> dict:
    """The body as a JSON object, read with a byte bound: 413 past ``limit``, 400 for
    invalid UTF-8, malformed JSON or a body that is not an object."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(413, f"the request body is larger than the limit of {limit} bytes", "body")
        chunks.append(chunk)
    raw = b"".join(chunks)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(400, f"the request body is not valid UTF-8 (byte {exc.start})", "body") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(400, f"malformed JSON: {exc.msg} at line {exc.lineno} column {exc.colno}", "body") from None
    except RecursionError:
        raise APIError(400, "malformed JSON: nested too deeply", "body") from None
    except ValueError:  # not a syntax error: an integer past Python's limit on digits
        raise APIError(400, "malformed JSON: a number has too many digits", "body") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object", "body")
    return data


__all__ = ["ApiKeyAuth", "DEFAULT_TENANT", "read_json", "tenant_for", "tenant_of"]
