"""Anthropic's Messages API over the chat pipeline: POST /v1/messages (JSON, or SSE with
Anthropic's events) and /v1/messages/count_tokens. A request is translated into a chat
completion request (deploy/messages_protocol.py), run as one (OpenAIServer.run), and its
output written as Anthropic's message (`MessageWriter`): the chat parsers' reasoning as a
`thinking` block, content as `text`, tool calls as `tool_use` blocks, built by one
`ContentBlocks` for both kinds of response so that a stream reassembles to the JSON message.
Errors are Anthropic's JSON, the chat's field names renamed to Anthropic's (`anthropic_error`).

Mapping decisions, out:
- `thinking` blocks come out only with the server's --reasoning-parser; without it reasoning
  is text. Signatures are "" (nothing verifies them when they come back).
- tool_use ids are "toolu_" + the parser's call id; stop_reason "tool_use" when a call was
  made (over a stop sequence), "stop_sequence" with the string that matched, "max_tokens",
  else "end_turn". A call cut by max_tokens whose JSON is incomplete has input {} (a stream
  sent its fragments).
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from contextlib import aclosing
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from deploy.detokenizer import TextStream
from deploy.generation import Generation
from deploy.messages_protocol import (
    CountTokensRequest,
    MessagesRequest,
    chat_request,
    check_auto_tool_choice,
)
from deploy.openai_server import Job, OpenAIServer
from deploy.protocol import ChatCompletionRequest, RequestError
from deploy.request_body import parse_body

# ---- errors --------------------------------------------------------------------------------

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "not_found_error", 413: "request_too_large",
                429: "rate_limit_error", 500: "api_error", 503: "overloaded_error",
                504: "timeout_error", 529: "overloaded_error"}
# the chat request's fields, as the Anthropic request names them
_PARAMS = [(re.compile(r"^tools\[(\d+)\]\.function\.name"), r"tools[\1].name"),
           (re.compile(r"^tools\[(\d+)\]\.function\.parameters"), r"tools[\1].input_schema"),
           (re.compile(r"^stop$"), "stop_sequences"),
           (re.compile(r"^response_format"), "output_config.format"),
           (re.compile(r"^chat_template_kwargs"), "thinking")]


def anthropic_error(err: RequestError) -> dict:
    """Anthropic's error JSON; the field, as Anthropic's request names it, begins the
    message."""
    param = err.param
    for pattern, name in _PARAMS:
        param = pattern.sub(name, param) if param else param
    message = err.message if not param or err.message.startswith(f"{param}:") \
        else f"{param}: {err.message}"
    kind = _ERROR_TYPES.get(err.status) or (
        "api_error" if err.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


# ---- the response --------------------------------------------------------------------------


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


class ContentBlocks:
    """One output's content blocks, built from the chat parser's deltas as they come
    (reasoning → thinking, content → text, a call → tool_use): `add` and `close` return the
    stream's events, `content()` the message's blocks; the same blocks either way."""

    def __init__(self):
        self.blocks: list[dict[str, Any]] = []  # as started, their text appended
        self.arguments: dict[int, str] = {}  # a tool_use block's index → its input's JSON
        self.calls: dict[int, int] = {}  # the parser's call index → its block's index
        self.open = False  # the last block is open

    def add(self, delta: dict) -> list[tuple[str, dict]]:
        events = []
        if delta.get("reasoning"):
            events += self._text("thinking", delta["reasoning"])
        if delta.get("content"):
            events += self._text("text", delta["content"])
        for call in delta.get("tool_calls") or ():
            if "id" in call:  # the call's header: a new block
                events += self._start({"type": "tool_use", "id": tool_use_id(call["id"]),
                                       "name": call["function"]["name"], "input": {}})
                self.calls[call["index"]] = len(self.blocks) - 1
                self.arguments[len(self.blocks) - 1] = ""
            fragment = call["function"].get("arguments") or ""
            if fragment:
                i = self.calls[call["index"]]
                self.arguments[i] += fragment
                events.append(_delta(i, {"type": "input_json_delta", "partial_json": fragment}))
        return events

    def close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open = False
        i = len(self.blocks) - 1
        events = []
        if self.blocks[i]["type"] == "thinking":  # as Anthropic ends one: its signature
            events.append(_delta(i, {"type": "signature_delta", "signature": ""}))
        return events + [("content_block_stop", {"type": "content_block_stop", "index": i})]

    def content(self) -> list[dict[str, Any]]:
        return [{**b, "input": _input(self.arguments[i])} if b["type"] == "tool_use" else b
                for i, b in enumerate(self.blocks)]

    def _text(self, kind: str, text: str) -> list[tuple[str, dict]]:
        """Thinking or text (each block type names its text field after itself)."""
        events = []
        if not (self.open and self.blocks[-1]["type"] == kind):
            events += self._start({"type": kind, kind: "",
                                   **({"signature": ""} if kind == "thinking" else {})})
        self.blocks[-1][kind] += text
        return events + [_delta(len(self.blocks) - 1, {"type": f"{kind}_delta", kind: text})]

    def _start(self, block: dict[str, Any]) -> list[tuple[str, dict]]:
        events = self.close()
        self.blocks.append(block)
        self.open = True
        return events + [("content_block_start", {"type": "content_block_start",
                                                  "index": len(self.blocks) - 1,
                                                  "content_block": dict(block)})]


def _delta(index: int, delta: dict) -> tuple[str, dict]:
    return "content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta}


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as tool_use's input; {} when they are not a whole JSON object (a
    forced call cut by max_tokens)."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


def _parsed(gen: Generation, text: str, final: bool) -> list[dict]:
    """Output text as chat deltas: its parser's, or plain content."""
    if gen.parser is None:
        return [{"content": text}] if text else []
    return gen.parser.feed(text) + (gen.parser.finish() if final else [])


def stop_reason(gen: Generation) -> tuple[str, str | None]:
    """Anthropic's stop_reason and stop_sequence of a finished output."""
    finish = gen.finish_reason
    if finish == "length":
        return "max_tokens", None
    if finish != "stop":
        raise RequestError("the request was aborted before it finished", None, "aborted", 503,
                           "service_unavailable")
    if gen.parser is not None and gen.parser.tool_called:
        return "tool_use", None
    if gen.text.stopped:
        return "stop_sequence", _matched_stop(gen.text)
    return "end_turn", None


def _matched_stop(text: TextStream) -> str | None:
    """The stop string the text was cut at: the one that the whole output's text holds
    there (TextStream keeps the text up to it)."""
    whole = text.tokenizer.decode(text.ids, skip_special_tokens=True)
    return next((s for s in text.stop if whole.startswith(s, len(text.text))), None)


def _event(kind: str, payload: dict) -> str:
    return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"


def stream_error(err: RequestError) -> str:
    return _event("error", anthropic_error(err))


class MessageWriter:
    """The chat request's one choice as Anthropic's message, whole or as its events."""

    def __init__(self, model: str):
        self.model = model

    def _message(self, request_id: str, gen: Generation, content: list[dict],
                 stop: tuple[str | None, str | None], output_tokens: int) -> dict:
        return {"id": "msg_" + request_id.removeprefix("msg-"), "type": "message",
                "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop[0], "stop_sequence": stop[1],
                # Anthropic's input_tokens leave out those read from the cache
                "usage": {"input_tokens": len(gen.prompt_ids) - gen.cached_tokens,
                          "cache_read_input_tokens": gen.cached_tokens,
                          "cache_creation_input_tokens": 0, "output_tokens": output_tokens}}

    async def complete(self, req: ChatCompletionRequest, request_id: str,
                       gens: list[Generation], echoes: list[str | None]) -> dict:
        gen, texts = gens[0], []
        async with aclosing(gen.deltas()) as deltas:
            async for text, _, _, _ in deltas:
                texts.append(text)
        blocks = ContentBlocks()
        for d in _parsed(gen, "".join(texts), final=True):
            blocks.add(d)
        blocks.close()
        return self._message(request_id, gen, blocks.content(), stop_reason(gen),
                             gen.completion_tokens)

    async def events(self, req: ChatCompletionRequest, request_id: str,
                     gens: list[Generation], echoes: list[str | None]) -> AsyncIterator[str]:
        gen, blocks = gens[0], ContentBlocks()
        yield _event("message_start", {"type": "message_start", "message": self._message(
            request_id, gen, [], (None, None), 0)})
        async with aclosing(gen.deltas()) as deltas:
            async for text, _, _, finish in deltas:
                for d in _parsed(gen, text, final=finish is not None):
                    for kind, payload in blocks.add(d):
                        yield _event(kind, payload)
        for kind, payload in blocks.close():
            yield _event(kind, payload)
        reason, sequence = stop_reason(gen)
        yield _event("message_delta", {
            "type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": {"output_tokens": gen.completion_tokens}})
        yield _event("message_stop", {"type": "message_stop"})


# ---- the routes ----------------------------------------------------------------------------


def add_routes(app: FastAPI, server: OpenAIServer) -> None:
    writer = MessageWriter(server.client.model_name)

    @app.post("/v1/messages")
    async def messages(request: Request) -> Response:
        async def job(raw: bytes) -> Job:
            chat = chat_request(await parse_body(MessagesRequest, raw))
            check_auto_tool_choice(server, chat)
            return Job(chat, "msg", writer.complete, writer.events, stream_error)

        return await server.run("messages", request, job, error_body=anthropic_error)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request) -> Response:
        try:
            req = await parse_body(CountTokensRequest, await server.body(request))
            server.check_model(req.model)
            chat = chat_request(req)
            _, ids = await server.chat_prompt(chat.messages, True, chat.chat_template_kwargs,
                                               None, chat.tools)
            return JSONResponse({"input_tokens": len(ids)})
        except Exception as e:
            return server.error("messages_count_tokens", e, anthropic_error)
