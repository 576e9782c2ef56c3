"""The playground page at ``/``: static files shipped in the package (``server/static``),
no build step and nothing loaded from elsewhere (a ``default-src 'self'`` CSP says so to
the browser). The page needs no key; the API calls it makes do (the key the user enters
stays in the tab's ``sessionStorage``). The page names its files and the API relative to
itself (``playground/playground.js``, ``v1/models``), so that it also works at a reverse
proxy's ``/prefix/``."""

from __future__ import annotations

import os
from os import PathLike
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC = Path(__file__).parent / "static"
CSP = "default-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


class PageFiles(StaticFiles):
    """The page's files with the page's headers: ``index.html`` is reachable here too, and
    must not be framed from there either; ``no-cache`` keeps an upgrade's script and style
    from mixing with a cached old one."""

    def file_response(self, full_path: PathLike, stat_result: os.stat_result, scope: Scope,
                      status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(HEADERS)
        return response


def add_playground(app: FastAPI) -> None:
    """``GET /`` (the page) and ``/playground/*`` (its script and style)."""

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=HEADERS)

    app.mount("/playground", PageFiles(directory=STATIC), name="playground")
