"""The playground page at ``/``: static files shipped in the package (``server/static``),
no build step and nothing loaded from elsewhere (a ``default-src 'self'`` CSP says so to
the browser). The page needs no key; the API calls it makes do (the key the user enters
stays in the tab's ``sessionStorage``)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC = Path(__file__).parent / "static"
CSP = "default-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


def add_playground(app: FastAPI) -> None:
    """``GET /`` (the page) and ``/playground/*`` (its script and style)."""

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=HEADERS)

    app.mount("/playground", StaticFiles(directory=STATIC), name="playground")
