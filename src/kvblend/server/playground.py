"""The playground page at ``/``: static files shipped in the package (``server/static``),
no build step and nothing loaded from elsewhere (a ``default-src 'self'`` CSP says so to
the browser). The page needs no key; the API calls it makes do (the key the user enters
stays in the tab's ``sessionStorage``). The page names its files and the API relative to
itself (``playground/playground.js``, ``v1/models``), so that it also works at a reverse
proxy's ``/prefix/``. Those names resolve only from the page's own URL, so its file and
folder (``/playground/index.html``, ``/playground/``) redirect there rather than serve it."""

from __future__ import annotations

import os
from os import PathLike
from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, RedirectResponse
from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.types import Scope

STATIC = Path(__file__).parent / "static"
CSP = "default-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff", "Cache-Control": "no-cache"}


class PageFiles(StaticFiles):
    """The page's files with the page's headers; ``no-cache`` keeps an upgrade's script and
    style from mixing with a cached old one."""

    def file_response(self, full_path: PathLike, stat_result: os.stat_result, scope: Scope,
                      status_code: int = 200) -> Response:
        response = super().file_response(full_path, stat_result, scope, status_code)
        response.headers.update(HEADERS)
        return response


# where else a user may open the page, and the page relative to each (a relative Location
# keeps a reverse proxy's path prefix): there its relative URLs would name nothing
ELSEWHERE = {"/playground/index.html": "../", "/playground/": "../", "/playground": "./"}


def redirect(location: str):  # noqa: ANN201 - a route handler
    async def to_page() -> RedirectResponse:
        return RedirectResponse(location, status_code=308, headers=HEADERS)

    return to_page


def add_playground(app: FastAPI) -> None:
    """``GET /`` (the page), ``/playground/*`` (its script and style), and the page's other
    addresses redirected to it."""

    @app.get("/", include_in_schema=False)
    async def page() -> FileResponse:
        return FileResponse(STATIC / "index.html", media_type="text/html", headers=HEADERS)

    for path, location in ELSEWHERE.items():  # before the mount, which would serve index.html
        app.add_api_route(path, redirect(location), methods=["GET"], include_in_schema=False)
    app.mount("/playground", PageFiles(directory=STATIC), name="playground")
