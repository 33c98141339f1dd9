"""The playground (``/``), the dashboard (``/dashboard``) and their files (``/static/{name}``):
plain HTML, JavaScript and CSS from ``static/``, no build step, read once at start."""

from __future__ import annotations

from pathlib import Path

from aiohttp import web

from services.gateway import errors

STATIC_DIR = Path(__file__).parent / "static"
CONTENT_TYPES = {".html": "text/html", ".js": "text/javascript", ".css": "text/css"}
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}
# Pages and scripts talk only to this gateway; nothing inline, nothing from elsewhere.
SECURITY_HEADERS = {
    # media-src blob: the playground's <video> plays a MediaSource through an object URL.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' blob: data:; "
    "media-src 'self' blob:; connect-src 'self'; "
    "frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


def load_static() -> dict[str, tuple[bytes, str]]:
    files = {}
    for path in sorted(STATIC_DIR.iterdir()):
        content_type = CONTENT_TYPES.get(path.suffix)
        if content_type is not None and path.is_file():
            files[path.name] = (path.read_bytes(), content_type)
    return files


class Pages:
    def __init__(self) -> None:
        self.files = load_static()

    def _serve(self, name: str) -> web.Response:
        found = self.files.get(name)
        if found is None:
            raise errors.RouteNotFound(f"no static file {name!r}")
        body, content_type = found
        return web.Response(
            body=body, content_type=content_type, charset="utf-8", headers=SECURITY_HEADERS
        )

    async def page(self, request: web.Request) -> web.Response:
        return self._serve(PAGES[request.path])

    async def static(self, request: web.Request) -> web.Response:
        return self._serve(request.match_info["name"])
