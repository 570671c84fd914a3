"""The playground: a chat page at `/` (static HTML, CSS and JS shipped in banyan/server/static, nothing from a
CDN), served without a key; every API call it makes carries the key the user types into it (app.Guard)."""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from starlette.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
PAGE_PATHS = {"/"}
ASSET_PREFIX = "/static/"


def install(app: FastAPI) -> None:
    app.mount(ASSET_PREFIX.rstrip("/"), StaticFiles(directory=STATIC_DIR), name="static")

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html", headers={"Cache-Control": "no-cache"})


def is_page_path(path: str) -> bool:
    """The playground's own files: open to anyone (they hold no data; the API behind them is guarded)."""
    return path in PAGE_PATHS or (path.startswith(ASSET_PREFIX) and "/" not in path[len(ASSET_PREFIX):])
