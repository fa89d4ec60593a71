"""The OpenAI-compatible HTTP API over any `EngineClient`: /v1/models[/{id}],
/v1/completions, /v1/chat/completions (JSON or SSE), OpenAI's /v1/responses
(deploy/responses_api.py) and Anthropic's /v1/messages (deploy/messages_api.py) over the chat,
/tokenize, /detokenize, /tokenizer_info (vLLM's), /version, /health, /metrics. With an API
key, every route but /health and /version needs `Authorization: Bearer <key>` (or
`x-api-key: <key>`); CORS as configured (ApiOptions, deploy/api_access.py).

Text lives here, token ids in the engine: prompts are tokenised (chat through the target's
template), outputs detokenised incrementally, and stop strings cut here (the engine request is
aborted as soon as one appears). The routes are here; what they do is in
deploy/openai_server.py (handlers) and deploy/request_body.py, deploy/generation.py (a
request's choices while they run), deploy/responses.py and deploy/logprobs.py (what the client
reads), deploy/api_errors.py.
"""

from __future__ import annotations

import time
from contextlib import asynccontextmanager, suppress

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException

from deploy import __version__, messages_api, responses_api
from deploy.api_access import ApiOptions, add_access
from deploy.api_errors import as_request_error, public_message
from deploy.engine_client import EngineClient
from deploy.metrics import ServingMetrics
from deploy.openai_server import OpenAIServer
from deploy.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    OPENAI_DEFAULTS,
    ModelCard,
    ModelList,
    RequestError,
    SamplingDefaults,
)
from deploy.tool_calls import NO_PARSERS, ChatParsing

_OPEN = ApiOptions()  # no API key, every origin


def build_app(client: EngineClient, tokenizer, shutdown_client: bool = False,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              options: ApiOptions = _OPEN,
              defaults: SamplingDefaults = OPENAI_DEFAULTS,
              parsing: ChatParsing = NO_PARSERS) -> FastAPI:
    """The API over `client`; `tokenizer` is the target's (None: token-id prompts only).
    `shutdown_client`: the app owns the client and shuts it down when the app stops.
    `defaults`: the sampling values of requests that leave them out (generation_config).
    `parsing`: the reasoning and tool-call parsers of chat responses."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_client:
            await client.shutdown()

    app = FastAPI(title="dflash-serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = ServingMetrics(client.snapshot, client.model_name)
    server = OpenAIServer(client, tokenizer, metrics, max_request_bytes, defaults,
                          options.trust_request_chat_template, parsing)
    app.state.metrics, app.state.server = metrics, server
    _add_error_handlers(app)
    add_access(app, options)
    # Registered in this order (it is the order of /openapi.json's paths).
    _add_model_routes(app, client, server)
    _add_tokenizer_routes(app, client, server, tokenizer)
    _add_version_route(app)
    _add_completion_routes(app, server)
    messages_api.add_routes(app, server)
    responses_api.add_routes(app, server)
    _add_health_route(app, client)
    _add_metrics_route(app, client, metrics)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = RequestError(str(exc.detail), None, None, exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """What no handler caught: OpenAI's error JSON, never a plain-text 500."""
        err = as_request_error(exc)
        return JSONResponse(err.body(), status_code=err.status)


def _add_model_routes(app: FastAPI, client: EngineClient, server: OpenAIServer) -> None:
    created = int(time.time())  # the model's, as /v1/models shows it: when this server started

    def card() -> ModelCard:
        return ModelCard(id=client.model_name, max_model_len=client.max_model_len,
                         created=created)

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models() -> dict:
        return ModelList(data=[card()]).model_dump(mode="json")

    @app.api_route("/v1/models/{model_id:path}", methods=["GET", "HEAD"])
    async def model(model_id: str) -> Response:
        try:
            server.check_model(model_id)
        except RequestError as err:
            return JSONResponse(err.body(), status_code=err.status)
        return JSONResponse(card().model_dump(mode="json"))


def _add_tokenizer_routes(app: FastAPI, client: EngineClient, server: OpenAIServer,
                          tokenizer) -> None:
    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await server.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await server.detokenize(request)

    @app.api_route("/tokenizer_info", methods=["GET", "HEAD"])
    async def tokenizer_info() -> Response:
        """vLLM's: what a client needs to tokenize as the server does through /tokenize and
        /detokenize (lm-eval's remote tokenizer): special tokens and the chat template."""
        if tokenizer is None:
            err = RequestError("this model has no tokenizer", None, "no_tokenizer", 404)
            return JSONResponse(err.body(), status_code=404)
        return JSONResponse({
            "tokenizer_class": type(tokenizer).__name__,
            "bos_token": tokenizer.bos_token, "eos_token": tokenizer.eos_token,
            "pad_token": tokenizer.pad_token, "unk_token": tokenizer.unk_token,
            "chat_template": tokenizer.chat_template,
            "model_max_length": client.max_model_len, "vocab_size": client.vocab_size})


def _add_version_route(app: FastAPI) -> None:
    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version() -> dict:
        return {"version": __version__}


def _add_completion_routes(app: FastAPI, server: OpenAIServer) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.create(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.create(request, chat=True)


def _add_health_route(app: FastAPI, client: EngineClient) -> None:
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        try:
            await client.check_health()
        except Exception as e:
            err = RequestError(public_message(f"unhealthy: {e}"), None, "engine_unavailable",
                               503, "service_unavailable")
            return JSONResponse(err.body(), status_code=503)
        return JSONResponse({"status": "ok"})


def _add_metrics_route(app: FastAPI, client: EngineClient, metrics: ServingMetrics) -> None:
    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        with suppress(Exception):  # a dead engine still has request metrics worth scraping
            await client.refresh()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)
