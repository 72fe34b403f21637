"""The live dashboard: `GET /dashboard` (a page shipped in `static/`, no CDN, no build step) and the JSON
it polls, `GET /debug/kv_state`. Shared by `kvserve serve` and `kvserve router` (no torch here).

Both routes take the API's keys. A browser cannot send a bearer token when it opens a page, so they
also take HTTP Basic credentials with the key as the password (any user name): a 401 asks the browser
for them, and it sends them again with the page's own requests. Keys never appear in a URL, so no
access log can hold one.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.responses import FileResponse

from kvserve.server.auth import ApiKeys
from kvserve.server.errors import APIError

STATIC_DIR = Path(__file__).parent / "static"
ASSETS = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}  # the only files served
StateSource = Callable[[Request], Awaitable[dict[str, Any]]]


def credential_key(authorization: str | None) -> str | None:
    """The API key in `Authorization: Bearer <key>` or `Basic base64(<user>:<key>)`."""
    scheme, _, value = (authorization or "").strip().partition(" ")
    scheme, value = scheme.lower(), value.strip()
    if scheme == "bearer":
        return value or None
    if scheme == "basic":
        try:
            decoded = base64.b64decode(value, validate=True).decode()
        except (binascii.Error, UnicodeDecodeError):
            return None
        return decoded.partition(":")[2] or None
    return None


def dashboard_tenant(api_keys: ApiKeys, request: Request) -> str:
    """The caller's tenant; a 401 that makes a browser ask for the key otherwise."""
    tenant = api_keys.tenant(credential_key(request.headers.get("authorization")))
    if tenant is None:
        raise APIError(
            401,
            "Incorrect or missing API key: send `Authorization: Bearer <key>`, or give the key as the password.",
            code="invalid_api_key",
            headers={"WWW-Authenticate": 'Basic realm="kvserve dashboard", charset="UTF-8"'},
        )
    return tenant


def add_dashboard_routes(app: FastAPI, api_keys: Callable[[Request], ApiKeys], state: StateSource) -> None:
    """/dashboard, its two assets, and /debug/kv_state (`state` builds its JSON)."""

    @app.get("/dashboard", include_in_schema=False)
    async def dashboard(request: Request) -> Response:
        dashboard_tenant(api_keys(request), request)
        return FileResponse(STATIC_DIR / "dashboard.html", media_type="text/html", headers=_NO_STORE)

    @app.get("/dashboard/{name}", include_in_schema=False)
    async def dashboard_asset(name: str, request: Request) -> Response:
        dashboard_tenant(api_keys(request), request)
        if name not in ASSETS:
            raise APIError(404, f"no dashboard file {name!r}")
        return FileResponse(STATIC_DIR / name, media_type=ASSETS[name], headers=_NO_STORE)

    @app.get("/debug/kv_state")
    async def kv_state(request: Request) -> dict[str, Any]:
        """The KV pool, prefix cache, tiers and queues now (with their last minutes), as the dashboard shows them."""
        dashboard_tenant(api_keys(request), request)
        return await state(request)


_NO_STORE = {"Cache-Control": "no-store"}  # a new kvserve's page, never an old one from the cache
