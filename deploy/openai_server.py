"""The handlers behind the routes (deploy/openai_api.py): a request's body read within its
limits and parsed (deploy/request_body.py), its prompts tokenized and checked against the
context, its choices sent to the engine together, and the response written
(deploy/responses.py); also vLLM's /tokenize and /detokenize. Every error becomes OpenAI's
error JSON (deploy/api_errors.py) and a count in the metrics."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from starlette.requests import ClientDisconnect

from deploy.api_errors import as_request_error
from deploy.chat_template import ChatTemplate, RenderLimits
from deploy.detokenizer import TextStream
from deploy.engine_client import EngineClient, EngineRequest, RequestTiming
from deploy.generation import (
    ClosingStream,
    Generation,
    close_all,
    start_all,
    unless_disconnected,
)
from deploy.logprobs import check_response_size
from deploy.metrics import ServingMetrics
from deploy.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    OPENAI_DEFAULTS,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    SamplingDefaults,
    TokenizeRequest,
    value_error,
)
from deploy.request_body import parse_body, read_body
from deploy.responses import Responses, sse
from deploy.sampling_controls import GrammarCheck, bad_words_token_ids
from deploy.token_text import TokenTexts
from deploy.tool_calls import (
    NO_PARSERS,
    ChatParsing,
    check_tool_choice,
    grammar_starts_after,
    output_parser,
    template_messages,
    template_tools,
)

# A text prompt of more characters than the context × this cannot fit and is refused before
# it is tokenized (tokenizing megabytes takes seconds); also the chat template's output limit.
MAX_CHARS_PER_TOKEN = 64
# With parallel_tool_calls false and tool_choice auto, generation stops where the first call
# ends (the parsers read a call cut there as complete)
ONE_CALL_ENDS = "</tool_call>"


def openai_stream_error(err: RequestError) -> str:
    """An error after a stream's headers, in-band as OpenAI sends it."""
    return sse(err.body()) + sse("[DONE]")


@dataclass
class Job:
    """A generating request as the server runs it: what the engine generates (`req`, with
    its choices' ids prefixed `id_prefix`) and how the client reads the result: `complete`
    the JSON body once every choice has finished, `events` the stream's events (both take
    the request, its id, the choices and their echoes), `stream_error` an error once the
    stream has started."""

    req: CompletionRequest | ChatCompletionRequest
    id_prefix: str
    complete: Callable[..., Awaitable[Any]]
    events: Callable[..., AsyncIterator[str]]
    stream_error: Callable[[RequestError], str] = openai_stream_error


class OpenAIServer:
    def __init__(self, client: EngineClient, tokenizer, metrics: ServingMetrics,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
                 defaults: SamplingDefaults = OPENAI_DEFAULTS,
                 trust_request_chat_template: bool = False,
                 parsing: ChatParsing = NO_PARSERS):
        self.client, self.tokenizer, self.metrics = client, tokenizer, metrics
        self.parsing = parsing
        self.max_request_bytes, self.defaults = max_request_bytes, defaults
        self.max_chars = client.max_model_len * MAX_CHARS_PER_TOKEN
        self.chat = None if tokenizer is None else ChatTemplate(
            tokenizer, RenderLimits(max_chars=self.max_chars), trust_request_chat_template)
        self.tokens = TokenTexts(tokenizer)
        self.responses = Responses(client, tokenizer, self.tokens)
        self.grammars = GrammarCheck(tokenizer, client.vocab_size)

    # ---- the request ---------------------------------------------------------------------

    async def body(self, request: Request) -> bytes:
        return await read_body(request, self.max_request_bytes)

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

    def error(self, endpoint: str, e: Exception,
              error_body: Callable[[RequestError], dict] = RequestError.body) -> JSONResponse:
        err = as_request_error(e)
        self.metrics.observe_error(endpoint, err.status)
        return JSONResponse(error_body(err), status_code=err.status)

    async def _prompts(self, req: CompletionRequest | ChatCompletionRequest
                       ) -> list[tuple[list[int], str | None]]:
        """Each prompt's token ids, and its text where the request gave text (echo repeats
        it as given); text is tokenized off the event loop (other streams and /health go on
        meanwhile)."""
        if isinstance(req, ChatCompletionRequest):  # with the rendered text (the parsers')
            text, ids = await self.chat_prompt(req.messages, True, req.chat_template_kwargs,
                                                req.chat_template, req.tools)
            return [(ids, text)]
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

    async def chat_prompt(self, messages, add_generation_prompt: bool,
                           template_kwargs: dict | None, template: str | None,
                           tools=None) -> tuple[str, list[int]]:
        """Chat messages (and tools) through the chat template (off the event loop), within
        its limits; only the variables it allows (deploy/chat_template.py). The text and its
        ids."""
        self._need_tokenizer("messages")
        conversation = template_messages(messages)
        tool_dicts = template_tools(tools)
        self._check_chars(sum(len(json.dumps(m)) for m in conversation)
                          + len(json.dumps(tool_dicts)), "messages")
        text, ids = await asyncio.to_thread(self.chat.text_and_ids, conversation,
                                            add_generation_prompt, template_kwargs, template,
                                            tool_dicts)
        self._check_ids(ids, "messages")
        return text, ids

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

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.client.model_name:
            raise RequestError(f"the model {model!r} does not exist; this server serves "
                               f"{self.client.model_name!r}", "model", "model_not_found", 404)

    # ---- tokens and text -----------------------------------------------------------------

    async def tokenize(self, request: Request) -> Response:
        try:
            req = await parse_body(TokenizeRequest, await self.body(request))
            self.check_model(req.model)
            if req.messages is not None:
                _, ids = await self.chat_prompt(req.messages, req.add_generation_prompt,
                                                 req.chat_template_kwargs, req.chat_template,
                                                 req.tools)
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
            raw = await self.body(request)
            if raw.count(b",") >= context:
                raise RequestError(f"tokens: more ids than the context holds ({context})",
                                   "tokens")
            req = await parse_body(DetokenizeRequest, raw)
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

    # ---- completions ---------------------------------------------------------------------

    async def create(self, request: Request, chat: bool) -> Response:
        """/v1/completions and /v1/chat/completions."""
        model = ChatCompletionRequest if chat else CompletionRequest

        async def job(raw: bytes) -> Job:
            req = await parse_body(model, raw)
            return Job(req, "chatcmpl" if chat else "cmpl", self.responses.complete,
                       self.responses.events)

        return await self.run("chat_completions" if chat else "completions", request, job)

    async def run(self, endpoint: str, request: Request,
                  make_job: Callable[[bytes], Awaitable[Job]],
                  error_body: Callable[[RequestError], dict] = RequestError.body) -> Response:
        """A generating request from its body to its response: `make_job` parses the body into
        what the engine runs and how the response is written (OpenAI's completions and chat
        completions, and the APIs written over them); `error_body`: its errors' JSON."""
        gens: list[Generation] = []
        streaming = False  # the response owns the choices from then on
        try:
            job = await make_job(await self.body(request))
            req = job.req
            request_id, echoes = await self.start(req, request, job.id_prefix, gens)
            if req.stream:
                body = self._stream(endpoint, job, request_id, gens, echoes)
                streaming = True
                return ClosingStream(body, gens, media_type="text/event-stream")
            response = await unless_disconnected(
                request, job.complete(req, request_id, gens, echoes))
        except ClientDisconnect:  # the engine requests were aborted; nobody reads a reply
            self._observe(endpoint, gens)
            return Response(status_code=499)
        except Exception as e:
            return self.error(endpoint, e, error_body)
        finally:
            if not streaming:  # also when cancelled: no choice may run on without a reader
                await close_all(gens)
        self._observe(endpoint, gens)
        body = response if isinstance(response, dict) else response.model_dump(mode="json")
        return JSONResponse(body)

    async def start(self, req: CompletionRequest | ChatCompletionRequest, request: Request,
                    id_prefix: str, gens: list[Generation]
                    ) -> tuple[str, list[str | None]]:
        """A parsed request's choices admitted to the engine (into `gens`, which the caller
        closes however it ends) and started (their first output in, so that errors come
        before any response): the request's id and each choice's prompt text to echo
        (completions)."""
        chat = isinstance(req, ChatCompletionRequest)
        self.check_model(req.model)
        needs_text = [name for name, on in (
            ("stop", bool(req.stop_strings)), ("logprobs", req.logprob_counts()[0] is not None),
            ("prompt_logprobs", req.prompt_logprobs is not None),
            ("echo", not chat and bool(req.echo))) if on]
        if needs_text:  # token texts: the first field that asks for them names the error
            self._need_tokenizer(needs_text[0])
        if req.bad_words:
            self._need_tokenizer("bad_words")
        try:
            bad_words = bad_words_token_ids(self.tokenizer, req.bad_words) \
                if req.bad_words else ()
        except ValueError as e:
            raise RequestError(str(e), "bad_words") from None
        if chat and req.tools:
            check_tool_choice(self.parsing, req)
        prompts = await self._prompts(req)
        budgets = [self._max_tokens(req, len(ids)) for ids, _ in prompts]
        check_response_size(req, [ids for ids, _ in prompts], budgets)
        await self.grammars.check(req)  # compiled off the event loop; 400 if it does not
        request_id = f"{id_prefix}-{uuid.uuid4().hex}"
        n = req.num_choices
        # with a reasoning parser, structured outputs start after the reasoning
        starts_after = grammar_starts_after(self.parsing, self.tokenizer, prompts[0][1]) \
            if chat else None
        wanted = self._engine_requests(req, request_id, prompts, budgets, bad_words,
                                       starts_after)
        # Every choice admitted at once, or none (429 at once when they do not fit). Not
        # under unless_disconnected: its streams would be lost with a disconnect that came
        # as they were returned; a cancellation while it runs aborts them itself.
        stops = req.stop_strings
        if chat and req.parallel_tool_calls is False and req.effective_tool_choice == "auto":
            stops = [*stops, ONE_CALL_ENDS]  # the model may call one tool: stop after it
        streams = await self.client.generate_many([w for w, _, _ in wanted])
        gens += [Generation(stream, ids, TextStream(self.tokenizer, stops),
                            w.timing, echo_only=echo_only)
                 for stream, (w, ids, echo_only) in zip(streams, wanted, strict=True)]
        for i, g in enumerate(gens):
            g.prompt_owner = gens[i - i % n]
            if chat and self._parses(req):
                g.parser = output_parser(self.parsing, req, prompts[0][1])
        await unless_disconnected(request, start_all(gens))
        echoes = [None if chat else text for _, text in prompts for _ in range(n)]
        return request_id, echoes

    def _parses(self, req: ChatCompletionRequest) -> bool:
        """Whether a chat's output goes through the parsers: reasoning, or tools to call."""
        return self.parsing.reasoning_parser is not None or (
            bool(req.tools) and req.effective_tool_choice != "none")

    def _engine_requests(self, req, request_id: str,
                         prompts: list[tuple[list[int], str | None]], budgets: list[int],
                         bad_words: tuple[tuple[int, ...], ...] = (),
                         grammar_starts_after: int | None = None
                         ) -> list[tuple[EngineRequest, list[int], bool]]:
        """One engine request per choice, prompt-major: (the request, its prompt ids, whether
        it only echoes the prompt)."""
        n = req.num_choices
        wanted: list[tuple[EngineRequest, list[int], bool]] = []
        for (ids, _), budget in zip(prompts, budgets, strict=True):
            base = req.sampling_params(max(budget, 1), self.defaults, bad_words)
            if base.grammar is not None and grammar_starts_after is not None:
                base = dataclasses.replace(base, grammar=dataclasses.replace(
                    base.grammar, starts_after=grammar_starts_after))
            try:
                base.check_vocab(self.client.vocab_size)
            except ValueError as e:
                raise value_error(e) from None
            for j in range(n):  # with a seed, choice j samples with seed + j
                params = base if base.seed is None else \
                    dataclasses.replace(base, seed=base.seed + j)
                if j and params.prompt_logprobs is not None:  # the first choice's serve all
                    params = dataclasses.replace(params, prompt_logprobs=None)
                engine_id = request_id if len(prompts) * n == 1 else \
                    f"{request_id}-{len(wanted)}"
                wanted.append((EngineRequest(engine_id, ids, params, RequestTiming()), ids,
                               budget == 0))
        return wanted

    async def _stream(self, endpoint: str, job: Job, request_id: str,
                      gens: list[Generation], echoes: list[str | None]) -> AsyncIterator[str]:
        failed = False
        try:
            async with aclosing(job.events(job.req, request_id, gens, echoes)) as events:
                async for event in events:
                    yield event
        except Exception as e:  # headers are sent: report in-band, as OpenAI does
            failed, err = True, as_request_error(e)
            self.metrics.observe_error(endpoint, err.status)
            yield job.stream_error(err)
        finally:  # also on client disconnect (cancellation): the engine requests were aborted
            if not failed:
                self._observe(endpoint, gens)

    def _observe(self, endpoint: str, gens: list[Generation]) -> None:
        """Every choice counts as a request (an engine request each), as in vLLM."""
        now = time.monotonic()
        for g in gens:
            self.metrics.observe_request(endpoint, g.finish_reason or "abort",
                                         len(g.prompt_ids), g.completion_tokens, g.timing, now)
