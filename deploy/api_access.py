"""Who may call the API: the API key (a Bearer token, or Anthropic's `x-api-key` header, on
every route but /health and /version) and CORS, as vLLM's flags set them."""

from __future__ import annotations

import hmac
from dataclasses import dataclass

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse

from deploy.protocol import RequestError


@dataclass(frozen=True)
class ApiOptions:
    """Access to the API: `api_key` (None: open) is required as a Bearer token (or in
    `x-api-key`, as Anthropic's clients send it) on every route but /health and /version
    (load balancers and probes); CORS as in vLLM's flags, every origin allowed by default
    (a browser cannot send the key to another origin unless listed here, or with "*");
    `trust_request_chat_template`: requests may bring their own chat template (vLLM's
    --trust-request-chat-template; the server's only, by default)."""

    api_key: str | None = None
    allowed_origins: tuple[str, ...] = ("*",)
    allowed_methods: tuple[str, ...] = ("*",)
    allowed_headers: tuple[str, ...] = ("*",)
    allow_credentials: bool = False
    trust_request_chat_template: bool = False


OPEN_PATHS = ("/health", "/version")


def key_matches(authorization: str, key: str) -> bool:
    """An Authorization header against the API key: the scheme is case-insensitive (RFC 9110),
    the credentials compared in constant time."""
    scheme, _, credentials = authorization.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(
        credentials.strip().encode(), key.encode())


class RequireKey:
    """ASGI middleware: the API key on every route but OPEN_PATHS and CORS preflights. Plain
    ASGI (not Starlette's BaseHTTPMiddleware), so a stream's disconnects and cancellation
    reach the handler unchanged."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if (scope["type"] == "http" and scope["method"] != "OPTIONS"
                and scope["path"] not in OPEN_PATHS):
            headers = {k.lower(): v for k, v in scope["headers"]}
            got = headers.get(b"authorization", b"").decode("latin-1")
            x_key = headers.get(b"x-api-key", b"").decode("latin-1").strip()
            if not (key_matches(got, self.key) or (x_key and hmac.compare_digest(
                    x_key.encode(), self.key.encode()))):
                err = RequestError("invalid or missing API key: send Authorization: Bearer "
                                   "<key> (or x-api-key: <key>)", None, "invalid_api_key", 401)
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def add_access(app: FastAPI, options: ApiOptions) -> None:
    if options.api_key is not None:
        app.add_middleware(RequireKey, key=options.api_key)
    # Outermost: preflights are answered before the key check, and errors carry the headers.
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=list(options.allowed_methods),
                       allow_headers=list(options.allowed_headers),
                       allow_credentials=options.allow_credentials)
