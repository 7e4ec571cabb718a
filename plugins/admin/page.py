"""The cache inspector page: static files under static/, served at `GET /admin/`.

No build step and nothing fetched from elsewhere: plain ES modules and CSS that ship in
the package (pyproject `package-data`). The files are public (no key needed to read
them); everything they show comes through the admin websocket, which asks for the key.
Only the files found in static/ at start-up are served, by name: no path is resolved.
"""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

STATIC_PREFIX = "/admin/static/"
PAGE_PATHS = frozenset({"/admin", "/admin/"})  # public, like the files under STATIC_PREFIX
STATIC_DIR = Path(__file__).resolve().parent / "static"
CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Same-origin everything ('self' covers the page's own ws:// origin), no framing.
HEADERS = {
    "Content-Security-Policy": (
        "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; img-src 'self'; "
        "base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    ),
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def is_public(path: str) -> bool:
    """Whether `path` is the page or one of its files, which anyone may read."""
    return path in PAGE_PATHS or path.startswith(STATIC_PREFIX)


def add_page_routes(app: web.Application) -> None:
    """`/admin/` (index.html), `/admin` (redirects there) and `/admin/static/<name>`."""
    files = {p.name: p for p in STATIC_DIR.iterdir() if p.suffix in CONTENT_TYPES}

    async def index(request: web.Request) -> web.StreamResponse:
        return _file(files["index.html"])

    async def static(request: web.Request) -> web.StreamResponse:
        # From the path, not match_info: the server's EngineRoutes resolves this app's
        # routes on its own request, whose match_info is the outer route's.
        path = files.get(request.path.removeprefix(STATIC_PREFIX))
        if path is None:
            raise web.HTTPNotFound(text="no such file")
        return _file(path)

    async def bare(request: web.Request) -> web.StreamResponse:
        raise web.HTTPFound("/admin/")

    app.router.add_get("/admin", bare)
    app.router.add_get("/admin/", index)
    app.router.add_get(STATIC_PREFIX + "{name}", static)


def _file(path: Path) -> web.Response:
    return web.Response(body=path.read_bytes(), headers={"Content-Type": CONTENT_TYPES[path.suffix], **HEADERS})
