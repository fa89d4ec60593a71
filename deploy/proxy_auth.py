"""The API key at Ray Serve's HTTP proxy. The proxy answers `/-/routes` (the route table) and
`/-/healthz` itself, before any application sees the request; with an API key those need it
too (the server's own `/health` stays open for load balancers).

Serve calls `middlewares()` in each proxy when Ray runs with
RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deploy.proxy_auth:middlewares; the key's SHA-256
comes in DFLASH_SERVE_PROXY_KEY_SHA256 (the key itself stays out of the processes'
environment). `dflash-serve serve` sets both for the Ray it starts; a cluster started with
`ray start` sets them there (docs/DEPLOYMENT.md)."""

from __future__ import annotations

import hashlib
import hmac
import json
import os

CALLBACK = "deploy.proxy_auth:middlewares"
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
KEY_HASH_ENV = "DFLASH_SERVE_PROXY_KEY_SHA256"
PROXY_PATHS = "/-/"


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def proxy_env(api_key: str | None) -> dict[str, str]:
    """The environment a Ray needs for its proxies to ask for `api_key` (none: nothing)."""
    return {} if api_key is None else {CALLBACK_ENV: CALLBACK, KEY_HASH_ENV: key_digest(api_key)}


def middlewares() -> list:
    from starlette.middleware import Middleware

    digest = os.environ.get(KEY_HASH_ENV)
    return [Middleware(GuardProxyRoutes, digest=digest)] if digest else []


class GuardProxyRoutes:
    """ASGI middleware: a request for the proxy's own routes needs `Authorization: Bearer
    <key>` (the scheme in any case), compared by digest in constant time."""

    def __init__(self, app, digest: str):
        self.app, self.digest = app, digest.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(PROXY_PATHS):
            headers = {k.lower(): v for k, v in scope["headers"]}
            scheme, _, credentials = headers.get(b"authorization", b"").decode(
                "latin-1").strip().partition(" ")
            given = key_digest(credentials.strip()).encode()
            if scheme.lower() != "bearer" or not hmac.compare_digest(given, self.digest):
                body = json.dumps({"error": {
                    "message": "invalid or missing API key: send Authorization: Bearer <key>",
                    "type": "invalid_request_error", "param": None,
                    "code": "invalid_api_key"}}).encode()
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json"),
                                        (b"content-length", str(len(body)).encode())]})
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)
