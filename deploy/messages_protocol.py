"""Anthropic's Messages request (/v1/messages and /v1/messages/count_tokens bodies) and its
translation into a chat completion request (`chat_request`): every check of the chat path
applies (`check_auto_tool_choice` words the server-dependent one as Anthropic's), and its
errors name Anthropic's fields (deploy/messages_api.py renames those the chat names).

Mapping decisions:
- Blocks in: `text`; `tool_use` (an assistant's tool_calls, the input as JSON arguments);
  `tool_result` (a `tool` message, in order with the user text around it; `is_error` puts
  "Error: " before its text, the template having no slot for it); `thinking` (the assistant's
  reasoning_content; its signature is ignored). Any other block (image, document,
  redacted_thinking, server tools' blocks) is a 400, as is a last assistant turn (prefill,
  Anthropic's answer for models without it).
- `thinking`: enabled/adaptive → enable_thinking true, disabled → false, absent → the
  template's default (Qwen3.5 thinks); budget_tokens is accepted without effect.
- `tool_choice`: auto/any/tool/none → "auto"/"required"/a named function/"none";
  disable_parallel_tool_use → parallel_tool_calls false. `output_config.format` (json_schema)
  → response_format json_schema; `effort`, `metadata`, `cache_control`, `service_tier` are
  accepted without effect; `container`, `mcp_servers`, `context_management` are 400s.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from deploy.openai_server import OpenAIServer
from deploy.protocol import ChatCompletionRequest, RequestError

# Lenient with Anthropic's extras (cache_control, citations, ...), strict with JSON types.
_MODEL = ConfigDict(extra="allow", strict=True)
UNSUPPORTED = ("container", "mcp_servers", "context_management")  # → 400 unless null/empty


class TextBlock(BaseModel):
    model_config = _MODEL
    type: Literal["text"]
    text: str


class ToolUseBlock(BaseModel):
    model_config = _MODEL
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    model_config = _MODEL
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | list[dict[str, Any]] | None = None  # text, or text blocks
    is_error: bool | None = None


class ThinkingBlock(BaseModel):
    model_config = _MODEL
    type: Literal["thinking"]
    thinking: str
    signature: str | None = None  # ignored


BLOCKS: dict[str, type[BaseModel]] = {"text": TextBlock, "tool_use": ToolUseBlock,
                                      "tool_result": ToolResultBlock, "thinking": ThinkingBlock}
ROLE_BLOCKS = {"user": ("text", "tool_result"), "assistant": ("text", "tool_use", "thinking")}


class InputMessage(BaseModel):
    model_config = _MODEL
    role: Literal["user", "assistant"]
    content: str | list[dict[str, Any]]  # a block each; checked by type in `chat_request`


class Tool(BaseModel):
    model_config = _MODEL
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None  # required (checked: server tools lack it)
    type: str | None = None  # "custom"; Anthropic's server tools have their own


class ToolChoice(BaseModel):
    model_config = _MODEL
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type "tool"
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(BaseModel):
    model_config = _MODEL
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None  # accepted, no effect
    display: Literal["summarized", "omitted"] | None = None  # "omitted" → 400


class OutputFormat(BaseModel):
    model_config = _MODEL
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    model_config = _MODEL
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None  # no effect


class CountTokensRequest(BaseModel):
    model_config = _MODEL
    model: str | None = None  # None → the served model
    messages: list[InputMessage] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None  # text, or text blocks
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None

    def check(self) -> None:
        for name in UNSUPPORTED:
            if (self.model_extra or {}).get(name) not in (None, [], {}):
                raise RequestError("not supported by this server", name)
        for i, tool in enumerate(self.tools or []):
            if tool.type not in (None, "custom"):
                raise RequestError(f"tools of type {tool.type!r} (Anthropic's server tools) are "
                                   "not supported; only custom tools, with an input_schema",
                                   f"tools[{i}].type")
            if tool.input_schema is None:
                raise RequestError("a tool needs its input_schema", f"tools[{i}].input_schema")
        if self.tool_choice is not None and self.tool_choice.type == "tool" and \
                self.tool_choice.name is None:
            raise RequestError('tool_choice {"type": "tool"} needs the name of a tool',
                               "tool_choice.name")
        if self.thinking is not None and self.thinking.display == "omitted":
            raise RequestError('"omitted" is not supported', "thinking.display")
        if self.thinking is not None and self.thinking.type == "enabled" and \
                self.thinking.budget_tokens is None:
            raise RequestError('required with thinking {"type": "enabled"} (it has no effect '
                               'here)', "thinking.budget_tokens")


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(None, allow_inf_nan=False)
    top_p: float | None = Field(None, allow_inf_nan=False)
    top_k: int | None = None
    stream: bool | None = False
    metadata: dict[str, Any] | None = None  # accepted, unused


# ---- as a chat request ---------------------------------------------------------------------


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat completion request that serves `req`, checked as the chat path checks it."""
    messages: list[dict[str, Any]] = []
    if req.system is not None:
        messages.append({"role": "system", "content": _text_parts(req.system, "system")})
    called: set[str] = set()  # the tool_use ids so far: what a tool_result may answer
    for i, m in enumerate(req.messages):
        messages += _chat_messages(m, f"messages[{i}]", called)
    if req.messages[-1].role == "assistant":
        raise RequestError("the last message is the assistant's (prefill): not supported by "
                           "this server; end with a user message", "messages")
    body: dict[str, Any] = {"model": req.model, "messages": messages}
    if req.tools:
        body["tools"] = [{"type": "function", "function": {
            "name": t.name, "parameters": t.input_schema,
            **({} if t.description is None else {"description": t.description})}}
            for t in req.tools]
    choice = req.tool_choice
    if choice is not None and (req.tools or choice.type not in ("auto", "none")):
        body["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(
            choice.type) or {"type": "function", "function": {"name": choice.name}}
        if choice.disable_parallel_tool_use:
            body["parallel_tool_calls"] = False
    if req.thinking is not None:
        body["chat_template_kwargs"] = {"enable_thinking": req.thinking.type != "disabled"}
    if req.output_config is not None and req.output_config.format is not None:
        body["response_format"] = {"type": "json_schema", "json_schema": {
            "name": "output", "schema": req.output_config.format.schema_}}
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, stream=bool(req.stream), stop=req.stop_sequences,
                    temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
    try:
        chat = ChatCompletionRequest.model_validate(
            {k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        raise _field_error(e, "") from None
    chat.check()
    return chat


def _chat_messages(m: InputMessage, where: str, called: set[str]) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages: an assistant's one message, or a user's text
    and tool results as user and tool messages, in order."""
    raw = [{"type": "text", "text": m.content}] if isinstance(m.content, str) else m.content
    blocks = [_block(b, f"{where}.content[{j}]", ROLE_BLOCKS[m.role])
              for j, b in enumerate(raw)]
    if m.role == "assistant":
        out: dict[str, Any] = {"role": "assistant", "content": [
            _part(b.text) for b in blocks if isinstance(b, TextBlock)]}
        thinking = [b.thinking for b in blocks if isinstance(b, ThinkingBlock)]
        if thinking:
            out["reasoning_content"] = "".join(thinking)
        calls = [b for b in blocks if isinstance(b, ToolUseBlock)]
        if calls:
            out["tool_calls"] = [{"id": b.id, "type": "function", "function": {
                "name": b.name, "arguments": json.dumps(b.input, ensure_ascii=False)}}
                for b in calls]
            called.update(b.id for b in calls)
        return [out]
    messages: list[dict[str, Any]] = []
    text: list[dict[str, str]] = []
    for j, b in enumerate(blocks):
        if isinstance(b, TextBlock):
            text.append(_part(b.text))
            continue
        if b.tool_use_id not in called:
            raise RequestError(f"tool_use_id {b.tool_use_id!r} answers no tool_use block of an "
                               "earlier assistant message", f"{where}.content[{j}].tool_use_id")
        if text:
            messages.append({"role": "user", "content": text})
            text = []
        content = _text_parts(b.content or "", f"{where}.content[{j}].content")
        if b.is_error:
            content = [_part("Error: "), *(content if isinstance(content, list)
                                           else [_part(content)])]
        messages.append({"role": "tool", "tool_call_id": b.tool_use_id, "content": content})
    if text or not messages:
        messages.append({"role": "user", "content": text})
    return messages


def _block(raw: dict[str, Any], where: str, allowed: tuple[str, ...]) -> BaseModel:
    kind = raw.get("type")
    if not isinstance(kind, str) or kind not in BLOCKS:
        raise RequestError(f"content blocks of type {kind!r} are not supported by this server "
                           f"(only {', '.join(BLOCKS)})", where)
    if kind not in allowed:
        raise RequestError(f"a {kind} block is not allowed here (only {', '.join(allowed)})",
                           where)
    try:
        return BLOCKS[kind].model_validate(raw)
    except ValidationError as e:
        raise _field_error(e, where) from None


def _text_parts(content: str | list[dict[str, Any]], where: str) -> str | list[dict[str, str]]:
    """Text, or text blocks as the chat's content parts (joined as the chat joins them)."""
    if isinstance(content, str):
        return content
    return [_part(_block(raw, f"{where}[{j}]", ("text",)).text)
            for j, raw in enumerate(content)]


def _part(text: str) -> dict[str, str]:
    return {"type": "text", "text": text}


def _field_error(e: ValidationError, where: str) -> RequestError:
    err = e.errors()[0]
    path = where
    for p in err["loc"]:
        if isinstance(p, int):
            path += f"[{p}]"
        elif not (p in ("str", "int", "float", "bool", "none") or "[" in p):  # union tags
            path += f".{p}" if path else p
    return RequestError(f"{path}: {err['msg']}" if path else err["msg"], path or None)


def check_auto_tool_choice(server: OpenAIServer, chat: ChatCompletionRequest) -> None:
    """The chat path's check, in Anthropic's words."""
    parsing = server.parsing
    if chat.tools and chat.effective_tool_choice == "auto" and not (
            parsing.enable_auto_tool_choice and parsing.tool_call_parser):
        raise RequestError('tool_choice {"type": "auto"} (the default with tools) needs a server '
                           'started with --enable-auto-tool-choice and --tool-call-parser; send '
                           'tool_choice {"type": "any"}, {"type": "tool", "name": ...} or '
                           '{"type": "none"}, or start the server with those flags',
                           "tool_choice")
