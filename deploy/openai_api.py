"""The OpenAI-compatible HTTP API over any `EngineClient`: /v1/models[/{id}],
/v1/completions, /v1/chat/completions (JSON or SSE), /tokenize, /detokenize,
/tokenizer_info (vLLM's), /version, /health, /metrics. With an API key, every route but
/health and /version needs `Authorization: Bearer <key>`; CORS as configured (ApiOptions).

Text lives here, token ids in the engine: prompts are tokenised (chat through the target's
template), outputs detokenised incrementally, and stop strings cut here (the engine request is
aborted as soon as one appears).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, asynccontextmanager, suppress
from dataclasses import dataclass
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from deploy import __version__
from deploy.chat_template import ChatTemplate, RenderLimits
from deploy.detokenizer import TextStream
from deploy.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineDraining,
    EngineOverloaded,
    EngineRequest,
    EngineStepError,
    RequestStream,
    RequestTiming,
)
from deploy.metrics import ServingMetrics
from deploy.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    OPENAI_DEFAULTS,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    PromptLogprob,
    RequestError,
    SamplingDefaults,
    TokenizeRequest,
    TopLogprob,
    Usage,
    parse_request,
    value_error,
)
from deploy.token_text import TokenTexts
from workers.logprobs import TokenLogprob

log = logging.getLogger(__name__)
T = TypeVar("T")


class _Generation:
    """One choice's stream of (text delta, token ids, their log-probabilities, finish
    reason). `echo_only` (max_tokens 0 with echo): the engine generates one token for the
    prompt's log-probabilities, and the choice reports none."""

    def __init__(self, stream: RequestStream, prompt_ids: list[int], text: TextStream,
                 timing: RequestTiming, echo_only: bool = False):
        self.prompt_ids = prompt_ids
        self.text = text
        self.timing = timing
        self.echo_only = echo_only
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.prompt_owner: _Generation = self  # the choice that brings the prompt's logprobs
        self.finish_reason: str | None = None
        self._stream = stream
        self._first = None

    async def start(self) -> None:
        """Waits for the first output, so request errors surface before any response."""
        try:
            self._first = await anext(self._stream)
            self.prompt_logprobs = self._first.prompt_logprobs
        except BaseException:
            await self._stream.aclose()
            raise

    async def close(self) -> None:
        await self._stream.aclose()  # aborts the engine request if it is still running

    async def deltas(self) -> AsyncIterator[tuple[str, list[int], list[TokenLogprob],
                                                  str | None]]:
        out = self._first
        try:
            if self.echo_only:
                while not out.finished:
                    out = await anext(self._stream)
                self.finish_reason = "length" if out.finish_reason != "abort" else "abort"
                yield "", [], [], self.finish_reason
                return
            while True:
                kept = self.text.add(out.new_token_ids)
                ids, lps = out.new_token_ids[:kept], (out.new_logprobs or [])[:kept]
                self.token_ids += ids
                self.logprobs += lps
                done = self.text.stopped or out.finished
                delta = self.text.release(final=done)  # may still meet a stop string
                if done:
                    self.finish_reason = "stop" if self.text.stopped else out.finish_reason
                    yield delta, ids, lps, self.finish_reason
                    return
                if delta or ids:
                    yield delta, ids, lps, None
                out = await anext(self._stream)
        finally:
            await self.close()

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


def _prompts_of(gens: list[_Generation]) -> list[list[int]]:
    """The distinct prompts (a prompt's n choices share its one id list)."""
    return list({id(g.prompt_ids): g.prompt_ids for g in gens}.values())


def _usage(gens: list[_Generation]) -> Usage:
    """Each prompt counts once however many choices it has; every choice's tokens count."""
    n = sum(map(len, _prompts_of(gens)))
    m = sum(g.completion_tokens for g in gens)
    return Usage(prompt_tokens=n, completion_tokens=m, total_tokens=n + m)


async def _merged(gens: list[_Generation]) -> AsyncIterator[tuple[int, tuple]]:
    """Every choice's deltas as they come, tagged with the choice's index. A choice that
    raises raises here; closing this closes (aborts) every choice still running."""
    if len(gens) == 1:
        async with aclosing(gens[0].deltas()) as deltas:
            async for item in deltas:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: _Generation) -> None:
        try:
            async with aclosing(gen.deltas()) as deltas:
                async for item in deltas:
                    await queue.put((i, item))
            await queue.put((i, done))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # a pump cancelled before it ran never closed its choice: close every one here
        await _close_all(gens)
        await asyncio.gather(*tasks, return_exceptions=True)


async def _close_all(gens: list[_Generation]) -> None:
    """Aborts every choice still running. It never suspends (closing a stream only sends the
    abort), so a cancellation cannot cut it short."""
    for g in gens:
        await g.close()


async def _unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, or cancels it (aborting the engine request) and raises ClientDisconnect
    if the client hangs up first: uvicorn does not cancel a handler whose client left."""

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


class _ClosingStream(StreamingResponse):
    """A stream whose body and choices are closed however the response ends, which aborts
    the engine requests still running at once. Starlette itself leaves the body open when the
    response does not complete: a send that fails because the client left (ASGI ≥ 2.4) or a
    handler cancelled when it did (Ray Serve cancels a replica's request then); and a body
    that never started cannot close what it was given."""

    def __init__(self, body, gens: list[_Generation], **kwargs):
        super().__init__(body, **kwargs)
        self.gens = gens

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await _close_all(self.gens)


def _sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


# What an engine error's text may carry that clients must not see: node addresses, process
# ids, Ray's actor/task/job ids and namespace.
_PRIVATE = [
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<address>"),
    (re.compile(r"\[[0-9a-fA-F:]{3,}\](?::\d+)?"), "<address>"),
    (re.compile(r"\b(pid|PID|Process|process)([=: ]+)\d+"), r"\1\2<pid>"),
    (re.compile(r"\b[0-9a-f]{16,}\b"), "<id>"),
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "<pointer>"),
    (re.compile(r"(namespace[=: ]+)\S+", re.IGNORECASE), r"\1<namespace>"),
]
MAX_PUBLIC_MESSAGE = 400


def public_message(text: str) -> str:
    """An engine error as a client may read it: its first line (Ray appends advice and
    tracebacks after it), no addresses, pids or Ray ids, at most MAX_PUBLIC_MESSAGE chars. The
    whole text goes to the server's log."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    for pattern, repl in _PRIVATE:
        line = pattern.sub(repl, line)
    return line if len(line) <= MAX_PUBLIC_MESSAGE else line[: MAX_PUBLIC_MESSAGE - 1] + "…"


def as_request_error(e: Exception) -> RequestError:
    if isinstance(e, RequestError):
        return e
    if isinstance(e, ValueError):
        return value_error(e)
    if isinstance(e, EngineOverloaded):
        return RequestError(str(e), None, "engine_overloaded", 429, "rate_limit_error")
    if isinstance(e, EngineDraining):
        return RequestError(str(e), None, "server_shutting_down", 503, "service_unavailable")
    if isinstance(e, EngineDeadError):
        log.warning("engine unavailable: %s", e)
        return RequestError(public_message(str(e)), None, "engine_unavailable", 503,
                            "service_unavailable")
    if isinstance(e, EngineStepError):
        log.warning("engine step failed: %s", e)
        return RequestError(public_message(str(e)), None, "engine_step_failed", 500,
                            "internal_server_error")
    log.error("unexpected error", exc_info=e)
    return RequestError(public_message(f"internal server error ({type(e).__name__}: {e})"),
                        None, "internal_error", 500, "internal_server_error")


MIN_LOGPROB = -9999.0  # what -inf is reported as (vLLM's value)
# A text prompt of more characters than the context × this cannot fit and is refused before
# it is tokenized (tokenizing megabytes takes seconds); also the chat template's output limit.
MAX_CHARS_PER_TOKEN = 64
# Bodies up to this size are parsed on the event loop; larger ones in a thread.
PARSE_INLINE_BYTES = 64 << 10
# Log-probabilities one response may hold (a token's, or an alternative's): about 200 MB of
# JSON. A response grows with n × max_tokens × alternatives; one request may not ask for
# more than this (a 400 before any work).
MAX_LOGPROB_ENTRIES = 1 << 22


class OpenAIServer:
    def __init__(self, client: EngineClient, tokenizer, metrics: ServingMetrics,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 defaults: SamplingDefaults = OPENAI_DEFAULTS,
                 trust_request_chat_template: bool = False):
        self.client, self.tokenizer, self.metrics = client, tokenizer, metrics
        self.max_request_bytes, self.defaults = max_request_bytes, defaults
        self.max_chars = client.max_model_len * MAX_CHARS_PER_TOKEN
        self.chat = None if tokenizer is None else ChatTemplate(
            tokenizer, RenderLimits(max_chars=self.max_chars), trust_request_chat_template)
        self.tokens = TokenTexts(tokenizer)

    async def _body(self, request: Request) -> bytes:
        """The body, refused with 413 once it is larger than max_request_bytes (by its
        Content-Length before reading, else while reading); a compressed body is a 415."""
        encoding = request.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise RequestError(f"Content-Encoding {encoding!r} is not supported: send the body "
                               f"uncompressed", None, "unsupported_media_type", 415)
        limit = self.max_request_bytes
        too_large = RequestError(f"the request body is larger than {limit} bytes (the "
                                 f"server's max_request_bytes)", None, "request_too_large", 413)
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise too_large
        chunks, size = [], 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                raise too_large
            chunks.append(chunk)
        return b"".join(chunks)

    @staticmethod
    async def _parse(model: type[T], raw: bytes) -> T:
        """The body as `model`; a large one is parsed in a thread, so that the event loop (the
        other streams, /health) is not held for the whole of it."""
        if len(raw) <= PARSE_INLINE_BYTES:
            return parse_request(model, raw)
        return await asyncio.to_thread(parse_request, model, raw)

    def _check_chars(self, num_chars: int, param: str) -> None:
        context = self.client.max_model_len
        if num_chars > self.max_chars:
            raise RequestError(
                f"the prompt has {num_chars} characters; a context of {context} tokens holds "
                f"far fewer; shorten the prompt", param, "context_length_exceeded")

    def _check_ids(self, ids: list[int], param: str) -> None:
        vocab = self.client.vocab_size
        if any(type(t) is not int or not 0 <= t < vocab for t in ids):
            raise RequestError(f"token ids must be integers in [0, {vocab})", param)

    def error(self, endpoint: str, e: Exception) -> JSONResponse:
        err = as_request_error(e)
        self.metrics.observe_error(endpoint, err.status)
        return JSONResponse(err.body(), status_code=err.status)

    async def _prompts(self, req: CompletionRequest | ChatCompletionRequest
                       ) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids, and its text where the request gave text (echo repeats
        it as given); text is tokenized off the event loop (other streams and /health go on
        meanwhile)."""
        if isinstance(req, ChatCompletionRequest):
            return [(await self._chat_ids(req.messages, True, req.chat_template_kwargs,
                                          req.chat_template), None)]
        out = []
        for prompt in req.prompts:
            if isinstance(prompt, list):
                ids, text = list(prompt), None
            else:
                self._need_tokenizer("prompt")
                self._check_chars(len(prompt), "prompt")
                ids, text = await asyncio.to_thread(self.tokenizer.encode, prompt), prompt
            if not ids:
                raise RequestError("prompt is empty", "prompt")
            self._check_ids(ids, "prompt")
            out.append((ids, text))
        return out

    async def _chat_ids(self, messages, add_generation_prompt: bool,
                        template_kwargs: dict | None, template: str | None) -> list[int]:
        """Chat messages through the chat template (off the event loop), within its limits;
        only the variables it allows (deploy/chat_template.py)."""
        self._need_tokenizer("messages")
        texts = [{"role": m.role, "content": m.text()} for m in messages]
        self._check_chars(sum(len(m["content"]) for m in texts), "messages")
        ids = await asyncio.to_thread(self.chat.ids, texts, add_generation_prompt,
                                      template_kwargs, template)
        self._check_ids(ids, "messages")
        return ids

    def _need_tokenizer(self, param: str) -> None:
        if self.tokenizer is None:
            raise RequestError("this model has no tokenizer; send the prompt as token ids to "
                               "/v1/completions", param)

    def _max_tokens(self, req, num_prompt: int) -> int:
        chat = isinstance(req, ChatCompletionRequest)
        requested = req.requested_max_tokens if chat else req.max_tokens
        param = "max_completion_tokens" if chat and req.max_completion_tokens is not None \
            else "max_tokens"
        context = self.client.max_model_len
        if num_prompt >= context:
            raise RequestError(
                f"the prompt has {num_prompt} tokens but the context holds {context}; "
                "shorten the prompt", "messages" if chat else "prompt", "context_length_exceeded")
        if requested is None:
            return context - num_prompt
        if requested == 0 and not chat and req.echo:
            return 0
        if requested <= 0:
            raise RequestError(f"{param} must be a positive integer, got {requested}", param)
        if num_prompt + requested > context:
            raise RequestError(
                f"the context holds {context} tokens; the prompt has {num_prompt} and {param} "
                f"asks for {requested} more; lower {param}", param, "context_length_exceeded")
        return requested

    @staticmethod
    def _check_response_size(req, prompts: list[list[int]], budgets: list[int]) -> None:
        """Refuses a request whose response would hold more than MAX_LOGPROB_ENTRIES
        log-probabilities (each token's and its alternatives', counted at most: every choice
        running to its max_tokens), before any work is done."""
        k_out, k_prompt = req.logprob_counts()
        n, echo = req.num_choices, bool(getattr(req, "echo", False))
        entries = 0
        for ids, budget in zip(prompts, budgets, strict=True):
            if k_prompt is not None:  # once per prompt, however many choices it has
                entries += len(ids) * (k_prompt + 1)
            if k_out is not None:
                entries += n * (budget + (len(ids) if echo else 0)) * (k_out + 1)
        if entries > MAX_LOGPROB_ENTRIES:
            param = "n" if n > 1 else "logprobs" if k_out is not None else "prompt_logprobs"
            raise RequestError(
                f"the response could hold {entries} log-probabilities (tokens × (1 + "
                f"alternatives) × choices); at most {MAX_LOGPROB_ENTRIES}: lower n, max_tokens "
                f"or the number of alternatives", param)

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.client.model_name:
            raise RequestError(f"the model {model!r} does not exist; this server serves "
                               f"{self.client.model_name!r}", "model", "model_not_found", 404)

    async def tokenize(self, request: Request) -> Response:
        try:
            req = await self._parse(TokenizeRequest, await self._body(request))
            self.check_model(req.model)
            if req.messages is not None:
                ids = await self._chat_ids(req.messages, req.add_generation_prompt,
                                           req.chat_template_kwargs, req.chat_template)
            else:
                self._need_tokenizer("prompt")
                self._check_chars(len(req.prompt), "prompt")
                ids = await asyncio.to_thread(self.tokenizer.encode, req.prompt,
                                              add_special_tokens=req.add_special_tokens)
            return JSONResponse({"count": len(ids), "max_model_len": self.client.max_model_len,
                                 "tokens": list(ids)})
        except Exception as e:
            return self.error("tokenize", e)

    async def detokenize(self, request: Request) -> Response:
        try:
            # a list longer than the context is refused before it is parsed: a comma per id
            # is counted in a few milliseconds, parsing millions of ids takes seconds
            context = self.client.max_model_len
            raw = await self._body(request)
            if raw.count(b",") >= context:
                raise RequestError(f"tokens: more ids than the context holds ({context})",
                                   "tokens")
            req = await self._parse(DetokenizeRequest, raw)
            self.check_model(req.model)
            self._need_tokenizer("tokens")
            if len(req.tokens) > context:
                raise RequestError(f"tokens: more ids than the context holds ({context})",
                                   "tokens")
            self._check_ids(req.tokens, "tokens")
            text = await asyncio.to_thread(self.tokenizer.decode, req.tokens)
            return JSONResponse({"prompt": text})
        except Exception as e:
            return self.error("detokenize", e)

    async def create(self, request: Request, chat: bool) -> Response:
        endpoint = "chat_completions" if chat else "completions"
        gens: list[_Generation] = []
        streaming = False  # the response owns the choices from then on
        try:
            req = await self._parse(ChatCompletionRequest if chat else CompletionRequest,
                                    await self._body(request))
            self.check_model(req.model)
            needs_text = [name for name, on in (
                ("stop", bool(req.stop_strings)), ("logprobs", req.logprob_counts()[0] is not None),
                ("prompt_logprobs", req.prompt_logprobs is not None),
                ("echo", not chat and bool(req.echo))) if on]
            if needs_text:  # token texts: the first field that asks for them names the error
                self._need_tokenizer(needs_text[0])
            prompts = await self._prompts(req)
            budgets = [self._max_tokens(req, len(ids)) for ids, _ in prompts]
            self._check_response_size(req, [ids for ids, _ in prompts], budgets)
            request_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
            n = req.num_choices
            wanted: list[tuple[EngineRequest, list[int], bool]] = []
            for (ids, _), budget in zip(prompts, budgets, strict=True):
                base = req.sampling_params(max(budget, 1), self.defaults)
                for j in range(n):  # with a seed, choice j samples with seed + j
                    params = base if base.seed is None else \
                        dataclasses.replace(base, seed=base.seed + j)
                    if j and params.prompt_logprobs is not None:  # the first choice's serve all
                        params = dataclasses.replace(params, prompt_logprobs=None)
                    engine_id = request_id if len(prompts) * n == 1 else \
                        f"{request_id}-{len(wanted)}"
                    wanted.append((EngineRequest(engine_id, ids, params, RequestTiming()), ids,
                                   budget == 0))
            # Every choice admitted at once, or none (429 at once when they do not fit). Not
            # under _unless_disconnected: its streams would be lost with a disconnect that
            # came as they were returned; a cancellation while it runs aborts them itself.
            streams = await self.client.generate_many([w for w, _, _ in wanted])
            gens = [_Generation(stream, ids, TextStream(self.tokenizer, req.stop_strings),
                                w.timing, echo_only=echo_only)
                    for stream, (w, ids, echo_only) in zip(streams, wanted, strict=True)]
            for i, g in enumerate(gens):
                g.prompt_owner = gens[i - i % n]
            await _unless_disconnected(request, self._start(gens))
            echoes = [text for _, text in prompts for _ in range(n)]
            if req.stream:
                body = self._stream(endpoint, req, request_id, gens, echoes)
                streaming = True
                return _ClosingStream(body, gens, media_type="text/event-stream")
            response = await _unless_disconnected(
                request, self._complete(req, request_id, gens, echoes))
        except ClientDisconnect:  # the engine requests were aborted; nobody reads a reply
            self._observe(endpoint, gens)
            return Response(status_code=499)
        except Exception as e:
            return self.error(endpoint, e)
        finally:
            if not streaming:  # also when cancelled: no choice may run on without a reader
                await _close_all(gens)
        self._observe(endpoint, gens)
        return JSONResponse(response.model_dump(mode="json"))

    @staticmethod
    async def _start(gens: list[_Generation]) -> None:
        """Starts every choice; if one fails, the others are aborted and its error raised."""
        results = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
        failed = [r for r in results if isinstance(r, BaseException)]
        if failed:
            await _close_all(gens)
            raise failed[0]
        for g in gens:  # a prompt's log-probabilities come with its first choice only
            g.prompt_logprobs = g.prompt_owner.prompt_logprobs

    # ---- log-probabilities as the API shows them -----------------------------------------

    @staticmethod
    def _finite(logprob: float) -> float:
        return max(logprob, MIN_LOGPROB)  # JSON has no -inf

    def _completion_logprobs(self, ids: list[int], lps: list[TokenLogprob | None],
                             offset: int, num: int) -> CompletionLogprobs:
        """Legacy completions logprobs of tokens `ids` whose text starts at `offset`, with
        `num` alternatives each (the prompt's may hold more, for prompt_logprobs), keyed by
        token name with none lost (deploy/token_text.py)."""
        out, names = CompletionLogprobs(), self.tokens
        for tok, lp in zip(ids, lps, strict=True):
            out.tokens.append(names.name(tok))
            out.token_logprobs.append(None if lp is None else self._finite(lp.logprob))
            out.top_logprobs.append(None if lp is None else names.keyed(
                (t, self._finite(v)) for t, v in lp.top[:num]))
            out.text_offset.append(offset)
            offset += len(names.text(tok))
        return out

    def _chat_logprobs(self, ids: list[int], lps: list[TokenLogprob]) -> ChatLogprobs:
        def entry(tok: int, logprob: float) -> dict:
            return {"token": self.tokens.name(tok), "logprob": self._finite(logprob),
                    "bytes": self.tokens.bytes(tok)}

        return ChatLogprobs(content=[
            ChatTokenLogprob(**entry(tok, lp.logprob),
                             top_logprobs=[TopLogprob(**entry(t, v)) for t, v in lp.top])
            for tok, lp in zip(ids, lps, strict=True)])

    def _prompt_logprobs(self, gen: _Generation, num: int) -> list[dict | None]:
        """vLLM's prompt_logprobs: per prompt token after the first, {id: {logprob, rank,
        decoded_token}} for the token itself and the `num` most likely."""
        out: list[dict | None] = [None]
        name = self.tokens.name
        for tok, lp in zip(gen.prompt_ids[1:], (gen.prompt_logprobs or [None])[1:], strict=True):
            entries = {str(t): PromptLogprob(logprob=self._finite(v), rank=r,
                                             decoded_token=name(t))
                       for r, (t, v) in enumerate(lp.top[:num], start=1)}
            entries[str(tok)] = PromptLogprob(logprob=self._finite(lp.logprob), rank=lp.rank,
                                              decoded_token=name(tok))
            out.append(entries)
        return out

    def _echo(self, gen: _Generation, text: str | None) -> str:
        return text if text is not None else self.tokenizer.decode(gen.prompt_ids)

    @staticmethod
    def _echo_logprobs(gen: _Generation) -> list[TokenLogprob | None]:
        """The echoed prompt's log-probabilities (all None when none were asked for)."""
        return gen.prompt_logprobs or [None] * len(gen.prompt_ids)

    # ---- responses -----------------------------------------------------------------------

    async def _complete(self, req, request_id: str, gens: list[_Generation],
                        echoes: list[str | None]
                        ) -> CompletionResponse | ChatCompletionResponse:
        texts: list[list[str]] = [[] for _ in gens]
        async with aclosing(_merged(gens)) as deltas:
            async for i, (delta, _, _, _) in deltas:
                texts[i].append(delta)
        tokens = req.return_token_ids
        common = dict(id=request_id, model=self.client.model_name, usage=_usage(gens))
        single_prompt = len(_prompts_of(gens)) == 1
        if tokens and single_prompt:
            common["prompt_token_ids"] = gens[0].prompt_ids
        wants_logprobs = req.logprob_counts()[0] is not None
        prompt_k = req.prompt_logprobs
        if isinstance(req, ChatCompletionRequest):
            if prompt_k is not None:
                common["prompt_logprobs"] = self._prompt_logprobs(gens[0], prompt_k)
            return ChatCompletionResponse(**common, choices=[ChatChoice(
                index=i, message=AssistantMessage(content="".join(text)),
                finish_reason=g.finish_reason, token_ids=g.token_ids if tokens else None,
                logprobs=self._chat_logprobs(g.token_ids, g.logprobs) if wants_logprobs
                else None)
                for i, (g, text) in enumerate(zip(gens, texts, strict=True))])
        choices = []
        for i, (g, text, echo) in enumerate(zip(gens, texts, echoes, strict=True)):
            body, lp_ids, lps = "".join(text), g.token_ids, g.logprobs
            if req.echo:
                prompt_text = self._echo(g, echo)
                body = prompt_text + body
                lp_ids = g.prompt_ids + g.token_ids
                lps = self._echo_logprobs(g) + g.logprobs
            choices.append(CompletionChoice(
                index=i, text=body, finish_reason=g.finish_reason,
                token_ids=g.token_ids if tokens else None,
                prompt_token_ids=g.prompt_ids if tokens and not single_prompt else None,
                logprobs=self._completion_logprobs(lp_ids, lps, 0, req.logprobs)
                if wants_logprobs else None,
                # once per prompt: on its first choice (the others would repeat it n times)
                prompt_logprobs=None if prompt_k is None or i % req.num_choices
                else self._prompt_logprobs(g, prompt_k)))
        return CompletionResponse(**common, choices=choices)

    async def _stream(self, endpoint: str, req, request_id: str, gens: list[_Generation],
                      echoes: list[str | None]) -> AsyncIterator[str]:
        chat = isinstance(req, ChatCompletionRequest)
        created, model = int(time.time()), self.client.model_name
        exclude = None if req.include_usage else {"usage"}
        first_ids = {"prompt_token_ids": gens[0].prompt_ids} \
            if req.return_token_ids and len(_prompts_of(gens)) == 1 else {}
        wants_logprobs = req.logprob_counts()[0] is not None
        offsets = [0] * len(gens)  # each choice's text_offset so far

        def chunk(i: int, text: str | None, ids: list[int] | None,
                  lps: list[TokenLogprob | None] | None, finish: str | None,
                  role: str | None = None) -> str:
            token_ids = ids if req.return_token_ids else None
            if chat:
                logprobs = self._chat_logprobs(ids, lps) if wants_logprobs and ids else None
                body = ChatCompletionChunk(id=request_id, created=created, model=model,
                                           **first_ids, choices=[ChatChunkChoice(
                                               index=i, delta=DeltaMessage(role=role,
                                                                           content=text),
                                               finish_reason=finish, token_ids=token_ids,
                                               logprobs=logprobs)])
            else:
                logprobs = None
                if wants_logprobs and ids:
                    logprobs = self._completion_logprobs(ids, lps, offsets[i], req.logprobs)
                    offsets[i] += sum(len(self.tokens.text(t)) for t in ids)
                body = CompletionResponse(id=request_id, created=created, model=model,
                                          **first_ids, choices=[CompletionChoice(
                                              index=i, text=text, finish_reason=finish,
                                              token_ids=token_ids, logprobs=logprobs)])
            first_ids.clear()
            return _sse(body.model_dump(mode="json", exclude=exclude))

        failed = False
        try:
            for i, g in enumerate(gens):
                if chat:
                    yield chunk(i, "", None, None, None, role="assistant")
                elif req.echo:  # the prompt first, with its log-probabilities
                    yield chunk(i, self._echo(g, echoes[i]), g.prompt_ids,
                                self._echo_logprobs(g), None)
            async with aclosing(_merged(gens)) as deltas:
                async for i, (delta, ids, lps, finish) in deltas:
                    yield chunk(i, delta, ids, lps, finish)
            if req.include_usage:
                cls = ChatCompletionChunk if chat else CompletionResponse
                yield _sse(cls(id=request_id, created=created, model=model, choices=[],
                               usage=_usage(gens)).model_dump(mode="json"))
            yield _sse("[DONE]")
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            failed, err = True, as_request_error(e)
            self.metrics.observe_error(endpoint, err.status)
            yield _sse(err.body())
            yield _sse("[DONE]")
        finally:  # also on client disconnect (cancellation): the engine requests were aborted
            if not failed:
                self._observe(endpoint, gens)

    def _observe(self, endpoint: str, gens: list[_Generation]) -> None:
        """Every choice counts as a request (an engine request each), as in vLLM."""
        now = time.monotonic()
        for g in gens:
            self.metrics.observe_request(endpoint, g.finish_reason or "abort",
                                         len(g.prompt_ids), g.completion_tokens, g.timing, now)


@dataclass(frozen=True)
class ApiOptions:
    """Access to the API: `api_key` (None: open) is required as a Bearer token on every route
    but /health and /version (load balancers and probes); CORS as in vLLM's flags, every
    origin allowed by default (a browser cannot send the key to another origin unless listed
    here, or with "*"); `trust_request_chat_template`: requests may bring their own chat
    template (vLLM's --trust-request-chat-template; the server's only, by default)."""

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


class _RequireKey:
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
            if not key_matches(got, self.key):
                err = RequestError("invalid or missing API key: send Authorization: Bearer "
                                   "<key>", None, "invalid_api_key", 401)
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(client: EngineClient, tokenizer, shutdown_client: bool = False,
              max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
              options: ApiOptions = ApiOptions(),
              defaults: SamplingDefaults = OPENAI_DEFAULTS) -> FastAPI:
    """The API over `client`; `tokenizer` is the target's (None: token-id prompts only).
    `shutdown_client`: the app owns the client and shuts it down when the app stops.
    `defaults`: the sampling values of requests that leave them out (generation_config)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_client:
            await client.shutdown()

    app = FastAPI(title="dflash-serve", docs_url=None, redoc_url=None, lifespan=lifespan)
    metrics = ServingMetrics(client.snapshot, client.model_name)
    server = OpenAIServer(client, tokenizer, metrics, max_request_bytes, defaults,
                          options.trust_request_chat_template)
    app.state.metrics, app.state.server = metrics, server
    created = int(time.time())  # the model's, as /v1/models shows it: when this server started

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = RequestError(str(exc.detail), None, None, exc.status_code)
        return JSONResponse(err.body(), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        """What no handler caught: OpenAI's error JSON, never a plain-text 500."""
        err = as_request_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    if options.api_key is not None:
        app.add_middleware(_RequireKey, key=options.api_key)
    # Outermost: preflights are answered before the key check, and errors carry the headers.
    app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins),
                       allow_methods=list(options.allowed_methods),
                       allow_headers=list(options.allowed_headers),
                       allow_credentials=options.allow_credentials)

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

    @app.api_route("/version", methods=["GET", "HEAD"])
    async def version() -> dict:
        return {"version": __version__}

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await server.create(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await server.create(request, chat=True)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health() -> Response:
        try:
            await client.check_health()
        except Exception as e:
            err = RequestError(public_message(f"unhealthy: {e}"), None, "engine_unavailable",
                               503, "service_unavailable")
            return JSONResponse(err.body(), status_code=503)
        return JSONResponse({"status": "ok"})

    @app.api_route("/metrics", methods=["GET", "HEAD"])
    async def prometheus() -> Response:
        with suppress(Exception):  # a dead engine still has request metrics worth scraping
            await client.refresh()
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
