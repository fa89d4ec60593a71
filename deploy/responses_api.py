"""OpenAI's Responses API over the chat pipeline: POST /v1/responses (one JSON response, or
typed server-sent events), GET and DELETE /v1/responses/{id}.

A request becomes a chat completion request (deploy/responses_input.py: every chat check
applies, and its errors name the Responses field), runs as one (OpenAIServer.run), and its
output, through the server's parsers, becomes output items (deploy/responses_output.py). The
decisions:
- `store` (default true) keeps the response, and the conversation it ends, in this replica's
  memory (deploy/response_store.py).
- `reasoning.effort` "none" or "minimal" turns Qwen3.5's thinking off (chat_template_kwargs
  {"enable_thinking": false}); the other efforts leave it on, as the template does by
  default.
- `truncation: "auto"` is a 400: nothing is dropped to fit the context, so a client relying
  on it learns at its first request, not at the turn that overflows.
- `include`, `service_tier`, `prompt_cache_key`, `safety_identifier`, `text.verbosity` are
  accepted without effect, except "message.output_text.logprobs" (a 400); `background`,
  `conversation`, `prompt`, `max_tool_calls`, `top_logprobs` are 400s; vLLM's sampling
  extensions (PASSTHROUGH) go to the chat as sent, an explicit `chat_template_kwargs` winning
  over the effort.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field

from deploy.generation import Generation
from deploy.openai_server import Job, OpenAIServer
from deploy.protocol import REASONING_EFFORTS, ChatCompletionRequest, RequestError
from deploy.request_body import parse_body
from deploy.response_store import ResponseStore
from deploy.responses_input import (
    Origin,
    chat_messages,
    chat_request,
    chat_tool_choice,
    chat_tools,
    response_format,
    responses_error,
)
from deploy.responses_output import OutputItems, reasoning_end_ids, response_usage, sse_event

THINKING_OFF = ("none", "minimal")
# vLLM's sampling extensions (and the template's variables), passed to the chat as sent
PASSTHROUGH = ("top_k", "seed", "stop", "stop_token_ids", "ignore_eos", "presence_penalty",
               "frequency_penalty", "repetition_penalty", "min_p", "min_tokens", "logit_bias",
               "bad_words", "allowed_token_ids", "chat_template_kwargs")
# OpenAI's fields we do not implement, with the values that ask for nothing
UNSUPPORTED = {"background": (None, False), "conversation": (None,), "prompt": (None,),
               "max_tool_calls": (None,), "top_logprobs": (None, 0)}


class ReasoningConfig(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    effort: Literal[REASONING_EFFORTS] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesRequest(BaseModel):
    """POST /v1/responses; input items, tools and tool_choice are read as they are translated
    (deploy/responses_input.py; their errors name the item: input[2].content[0])."""

    model_config = ConfigDict(extra="allow", strict=True)
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None  # a system message first; not carried to the next turn
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: int | None = None
    temperature: float | None = Field(None, allow_inf_nan=False)
    top_p: float | None = Field(None, allow_inf_nan=False)
    stream: bool | None = False
    previous_response_id: str | None = None
    store: bool | None = True
    metadata: dict[str, str] | None = None
    text: TextConfig | None = None
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    include: list[str] | None = None

    def check(self) -> None:
        extra = self.model_extra or {}
        for name, neutral in UNSUPPORTED.items():
            if extra.get(name) not in neutral:
                raise RequestError(f"{name} is not supported by this server", name)
        if self.truncation == "auto":
            raise RequestError('truncation "auto" is not supported: nothing is dropped to fit '
                               'the context; send "disabled" or leave it out', "truncation")
        if "message.output_text.logprobs" in (self.include or []):
            raise RequestError("log-probabilities are not available through /v1/responses; use "
                               "/v1/chat/completions with logprobs", "include")

    @property
    def thinking(self) -> bool:
        return self.reasoning is None or self.reasoning.effort not in THINKING_OFF


# ---- one request -----------------------------------------------------------------------------


class _Call:
    """One POST /v1/responses: its body translated to a chat (`make_job`), its output
    written as the response (`complete`, or `events` then perhaps `stream_error`), and kept
    (store)."""

    def __init__(self, server: OpenAIServer, store: ResponseStore, reasoning_ends: dict):
        self.server, self.store, self.reasoning_ends = server, store, reasoning_ends
        self.req: ResponsesRequest | None = None
        self.origins: list[Origin] | None = None  # set once translated: errors renamed
        self.inputs: list[dict] = []  # the conversation's input items, kept with the response
        self.chat: ChatCompletionRequest | None = None
        self.id, self.created_at = "", int(time.time())
        self.sequence_number = 0
        self.pending: list[str] | None = None  # streaming: the events not yet sent
        self.output = OutputItems(self._emit)

    async def make_job(self, raw: bytes) -> Job:
        req = self.req = await parse_body(ResponsesRequest, raw)
        history: list[dict] = []
        if req.previous_response_id is not None:
            kept = self.store.get(req.previous_response_id)
            if kept is None:
                raise RequestError(f"previous response with id {req.previous_response_id!r} "
                                   f"not found (responses are kept in memory by the replica "
                                   f"that served them, the last {self.store.max_responses})",
                                   "previous_response_id", "previous_response_not_found", 404)
            history = kept.inputs + kept.response["output"]
        if isinstance(req.input, str):
            items, params = [{"type": "message", "role": "user", "content": req.input}], \
                ["input"]
        else:
            items, params = req.input, [f"input[{i}]" for i in range(len(req.input))]
        messages, origins = chat_messages(history + items,
                                          ["previous_response_id"] * len(history) + params)
        if not messages:
            raise RequestError("input is empty", "input")
        if req.instructions is not None:
            messages.insert(0, {"role": "system", "content": req.instructions})
            origins.insert(0, Origin("instructions"))
        self.inputs, self.origins = history + items, origins
        self.chat = chat_request(self._chat_body(req, messages))
        return Job(self.chat, "resp", self.complete, self.events, self.stream_error)

    def _chat_body(self, req: ResponsesRequest, messages: list[dict]) -> dict:
        body: dict[str, Any] = {
            "model": req.model, "messages": messages, "stream": bool(req.stream),
            "max_completion_tokens": req.max_output_tokens, "temperature": req.temperature,
            "top_p": req.top_p, "user": req.user, "metadata": req.metadata,
            "parallel_tool_calls": req.parallel_tool_calls,
            "tools": None if req.tools is None else chat_tools(req.tools),
            "tool_choice": chat_tool_choice(req.tool_choice),
            "response_format": response_format(req.text.format if req.text else None)}
        extra = req.model_extra or {}
        body |= {k: extra[k] for k in PASSTHROUGH if k in extra}
        if not req.thinking:
            kwargs = body.get("chat_template_kwargs")
            body["chat_template_kwargs"] = {"enable_thinking": False,
                                            **(kwargs if isinstance(kwargs, dict) else {})}
        return {k: v for k, v in body.items() if v is not None}

    def error_body(self, err: RequestError) -> dict:
        if self.origins is None:  # not translated yet: no chat field to rename
            return err.body()
        return responses_error(err, self.origins)

    # ---- the response ----------------------------------------------------------------------

    async def complete(self, chat, request_id: str, gens: list[Generation],
                       echoes: list) -> dict:
        self.id = "resp_" + request_id.split("-", 1)[1]
        async with aclosing(self._generate(gens[0])) as steps:
            async for _ in steps:
                pass
        return self._finish(gens[0])

    async def events(self, chat, request_id: str, gens: list[Generation],
                     echoes: list) -> AsyncIterator[str]:
        self.id, self.pending = "resp_" + request_id.split("-", 1)[1], []
        for kind in ("response.created", "response.in_progress"):
            self._emit({"type": kind, "response": self._response("in_progress")})
        yield self._flush()
        async with aclosing(self._generate(gens[0])) as steps:
            async for _ in steps:
                if self.pending:
                    yield self._flush()
        final = self._finish(gens[0])
        self._emit({"type": f"response.{final['status']}", "response": final})
        yield self._flush()

    def stream_error(self, err: RequestError) -> str:
        """The stream's end when generation fails: response.failed, with the items so far."""
        self.pending = []
        code = "rate_limit_exceeded" if err.status == 429 else \
            "server_error" if err.status >= 500 else "invalid_prompt"
        self._emit({"type": "response.failed", "response": self._response(
            "failed", error={"code": code, "message": err.message})})
        return self._flush()

    async def _generate(self, gen: Generation) -> AsyncIterator[None]:
        """The output items, grown by each delta of the engine (a step each)."""
        parser = gen.parser
        async with aclosing(gen.deltas()) as deltas:
            async for text, _, _, finish in deltas:
                if parser is None:
                    parsed = [{"content": text}]
                else:
                    parsed = parser.feed(text) + (parser.finish() if finish else [])
                for delta in parsed:
                    self.output.add(delta)
                yield

    def _finish(self, gen: Generation) -> dict:
        finish = gen.finish_reason
        self.output.finish("completed" if finish == "stop" else "incomplete")
        usage = response_usage(gen, self.output.reasoning, self.reasoning_ends)
        response = self._response(
            "completed" if finish == "stop" else "incomplete", usage=usage,
            incomplete_details=None if finish == "stop" else {
                "reason": "max_output_tokens" if finish == "length" else None},
            completed_at=int(time.time()))
        if self.req.store is not False:
            self.store.put(response, self.inputs)
        return response

    def _response(self, status: str, **fields) -> dict:
        req, chat, defaults = self.req, self.chat, self.server.defaults
        choice = chat.effective_tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "status": status, "background": False, "error": None, "incomplete_details": None,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens,
            "model": self.server.client.model_name, "output": self.output.items,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id,
            "reasoning": {"effort": req.reasoning.effort if req.reasoning else None,
                          "summary": req.reasoning.summary if req.reasoning else None},
            "service_tier": "default", "store": req.store is not False,
            "temperature": defaults.temperature if req.temperature is None
            else req.temperature,
            "text": {"format": (req.text.format if req.text else None) or {"type": "text"}},
            "tool_choice": choice if isinstance(choice, str)
            else {"type": "function", "name": choice.function.name},
            "tools": req.tools or [], "top_p": defaults.top_p if req.top_p is None
            else req.top_p,
            "truncation": "disabled", "usage": None, "user": req.user,
            "metadata": req.metadata or {}, **fields}

    def _flush(self) -> str:
        out, self.pending = "".join(self.pending), []
        return out

    def _emit(self, payload: dict) -> None:
        if self.pending is not None:  # serialized now: the items change on
            self.pending.append(sse_event({**payload, "sequence_number": self.sequence_number}))
            self.sequence_number += 1


def _not_found(response_id: str) -> JSONResponse:
    err = RequestError(f"response with id {response_id!r} not found", None, None, 404)
    return JSONResponse(err.body(), status_code=404)


def add_routes(app: FastAPI, server: OpenAIServer,
               store: ResponseStore | None = None) -> None:
    store = ResponseStore() if store is None else store
    reasoning_ends = reasoning_end_ids(server.tokenizer)

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        call = _Call(server, store, reasoning_ends)
        return await server.run("responses", request, call.make_job, call.error_body)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        kept = store.get(response_id)
        return _not_found(response_id) if kept is None else JSONResponse(kept.response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        if not store.delete(response_id):
            return _not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})
