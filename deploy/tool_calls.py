"""Tool calling and reasoning on the request side: the checks a chat request's `tools`,
`tool_choice` and tool messages get, the conversation as the chat template reads it (tool calls
with their arguments as objects, reasoning as `reasoning_content`), and what a `required` or
named tool_choice constrains the output to.

A forced call is vLLM's: `required` constrains the output to a JSON array of
`{"name": …, "parameters": {…}}` objects, one of the tools each (one at most without
parallel_tool_calls); a named function constrains it to that function's arguments object. The
constraint holds whatever the model, and the output parses into tool calls
(`ForcedCallParser`), streamed as they are written. With a reasoning parser the constraint
starts after the reasoning (`</think>`): the model thinks first, freely."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from configs.engine import GrammarSpec
from deploy.chat_parsers import REASONING_PARSERS, TOOL_PARSERS, ChatOutputParser
from deploy.chat_parsers import new_call_id as new_tool_call_id
from deploy.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    NamedToolChoice,
    RequestError,
    ToolDefinition,
)
from deploy.reasoning_parser import END_THINK, opens_reasoning

# OpenAI's function names, plus the dots and colons of namespaced (MCP) tools; nothing that
# could end the template's `<function=NAME>` tag
TOOL_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


@dataclass(frozen=True)
class ChatParsing:
    """The server's parsers (vLLM's flags): --reasoning-parser, --enable-auto-tool-choice,
    --tool-call-parser."""

    reasoning_parser: str | None = None
    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    def __post_init__(self) -> None:
        if self.reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got "
                             f"{self.reasoning_parser!r}")
        if self.tool_call_parser not in (None, *TOOL_PARSERS):
            raise ValueError(f"tool_call_parser must be one of {TOOL_PARSERS}, got "
                             f"{self.tool_call_parser!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("enable_auto_tool_choice needs a tool_call_parser "
                             f"(one of {TOOL_PARSERS})")


NO_PARSERS = ChatParsing()


def check_tools(req: ChatCompletionRequest) -> None:
    """The request's tools, tool_choice and tool messages, as OpenAI checks them (400 naming
    the field)."""
    names: set[str] = set()
    for i, tool in enumerate(req.tools or []):
        f, where = tool.function, f"tools[{i}].function"
        if not TOOL_NAME.fullmatch(f.name):
            raise RequestError(f"a tool's name is 1 to 64 letters, digits, '_', '-', '.' or "
                               f"':', got {f.name!r}", f"{where}.name")
        if f.name in names:
            raise RequestError(f"two tools are named {f.name!r}", f"{where}.name")
        names.add(f.name)
        if f.parameters is not None and f.parameters.get("type", "object") != "object":
            raise RequestError("a tool's parameters are a JSON schema of type object",
                               f"{where}.parameters")
    choice = req.tool_choice
    if choice is not None and choice != "none" and not req.tools:
        raise RequestError("tool_choice needs tools", "tool_choice")
    if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
        raise RequestError(f"tool_choice names {choice.function.name!r}, which is not among "
                           f"the tools ({', '.join(sorted(names))})", "tool_choice")
    called: set[str] = set()
    for i, m in enumerate(req.messages):
        if m.role == "tool":
            if not m.tool_call_id:
                raise RequestError("a tool message needs the tool_call_id of the call it "
                                   "answers", f"messages[{i}].tool_call_id")
            if m.tool_call_id not in called:
                raise RequestError(f"tool_call_id {m.tool_call_id!r} answers no tool call of "
                                   f"an earlier assistant message", f"messages[{i}].tool_call_id")
        for j, call in enumerate(m.tool_calls or []):
            where = f"messages[{i}].tool_calls[{j}]"
            if m.role != "assistant":
                raise RequestError("only assistant messages make tool calls", where)
            arguments_object(call.function.arguments, f"{where}.function.arguments")
            called.add(call.id)


def arguments_object(text: str, param: str) -> dict[str, Any]:
    try:
        value = json.loads(text) if text.strip() else {}
    except json.JSONDecodeError as e:
        raise RequestError(f"a tool call's arguments must be a JSON object: {e}", param) \
            from None
    if not isinstance(value, dict):
        raise RequestError("a tool call's arguments must be a JSON object", param)
    return value


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """The conversation as chat templates read it (transformers' form): text content, an
    assistant's tool calls with their arguments as objects and its reasoning as
    `reasoning_content`; a tool result with its `tool_call_id`. OpenAI's `developer` role is
    its newer name for `system`."""
    out = []
    for i, m in enumerate(messages):
        d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                             "content": m.text()}
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if m.role == "assistant" and reasoning is not None:
            d["reasoning_content"] = reasoning
        if m.tool_calls:
            d["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": arguments_object(
                    c.function.arguments, f"messages[{i}].tool_calls[{j}].function.arguments")}}
                for j, c in enumerate(m.tool_calls)]
        if m.role == "tool":
            d["tool_call_id"] = m.tool_call_id
        out.append(d)
    return out


def template_tools(tools: list[ToolDefinition] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [t.model_dump(mode="json", exclude_unset=True) for t in tools]


def forced_call_spec(req: ChatCompletionRequest) -> GrammarSpec | None:
    """The constraint of a `required` or named tool_choice; None for `auto` and `none`."""
    choice = req.effective_tool_choice
    if isinstance(choice, NamedToolChoice):
        tool = next(t for t in req.tools if t.function.name == choice.function.name)
        return GrammarSpec("json", json.dumps(_parameters(tool.function.parameters)))
    if choice != "required":
        return None
    calls: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": [
        {"type": "object", "properties": {
            "name": {"type": "string", "enum": [t.function.name]},
            "parameters": _parameters(t.function.parameters)},
         "required": ["name", "parameters"], "additionalProperties": False}
        for t in req.tools]}}
    if req.parallel_tool_calls is False:
        calls["maxItems"] = 1
    return GrammarSpec("json", json.dumps(calls))


def _parameters(schema: dict[str, Any] | None) -> dict[str, Any]:
    return schema if schema is not None else {"type": "object", "properties": {}}


def output_parser(parsing: ChatParsing, req: ChatCompletionRequest, prompt_text: str,
                  new_call_id: Callable[[], str] | None = None):
    """The parser of one choice's output: reasoning (the server's parser), then tool calls
    as tool_choice says (`auto`: the server's tool parser; `required` or named: the forced
    call's JSON)."""
    ids = {} if new_call_id is None else {"new_call_id": new_call_id}
    choice = req.effective_tool_choice
    auto = choice == "auto" and parsing.tool_call_parser is not None
    inner = ChatOutputParser(parsing.reasoning_parser,
                             parsing.tool_call_parser if auto else None,
                             template_tools(req.tools) if auto else None, prompt_text, **ids)
    if choice == "required" or isinstance(choice, NamedToolChoice):
        return ForcedCallParser(inner, None if choice == "required" else choice.function.name,
                                new_call_id or new_tool_call_id)
    return inner


def check_tool_choice(parsing: ChatParsing, req: ChatCompletionRequest) -> None:
    """`auto` (OpenAI's default with tools) needs the server's tool parser, as in vLLM."""
    if req.effective_tool_choice == "auto" and not (
            parsing.enable_auto_tool_choice and parsing.tool_call_parser):
        raise RequestError('tool_choice "auto" (the default with tools) needs a server started '
                           'with --enable-auto-tool-choice and --tool-call-parser; send '
                           'tool_choice "required", "none" or a named function, or start the '
                           'server with those flags', "tool_choice")


def grammar_starts_after(parsing: ChatParsing, tokenizer, prompt_text: str) -> int | None:
    """The token after which structured outputs start: `</think>` when the server parses
    reasoning and the prompt leaves the output inside it; None: from the first token."""
    if parsing.reasoning_parser is None or tokenizer is None or \
            not opens_reasoning(prompt_text):
        return None
    ids = tokenizer.encode(END_THINK, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None


class ForcedCallParser:
    """A forced call's output as tool calls, streamed as it is written: the reasoning and any
    text from `inner` (a ChatOutputParser without tools), the JSON after it read as it comes.
    Named: the JSON is the arguments, sent as it arrives after a header. Required: an array of
    {"name", "parameters"}; each element's header when its name is complete, its parameters'
    text as it arrives ("name" comes first: the constraint writes the schema's order)."""

    def __init__(self, inner: ChatOutputParser, name: str | None,
                 new_call_id: Callable[[], str]):
        self.inner, self.name, self.new_call_id = inner, name, new_call_id
        self.calls: list[dict[str, Any]] = []
        self._json = _JsonCalls(name)

    def feed(self, text: str) -> list[dict]:
        return self._route(self.inner.feed(text))

    def finish(self) -> list[dict]:
        return self._route(self.inner.finish())

    def _route(self, deltas: list[dict]) -> list[dict]:
        out = []
        for d in deltas:
            if "content" in d:
                out += self._calls(self._json.feed(d["content"]))
            else:
                out.append(d)
        return out

    def _calls(self, events: list[tuple[str, str]]) -> list[dict]:
        out = []
        for kind, text in events:
            if kind == "name":
                call = {"id": self.new_call_id(), "type": "function",
                        "function": {"name": text, "arguments": ""}}
                self.calls.append(call)
                out.append({"tool_calls": [{"index": len(self.calls) - 1, **call,
                                            "function": {"name": text, "arguments": ""}}]})
            else:
                self.calls[-1]["function"]["arguments"] += text
                out.append({"tool_calls": [{"index": len(self.calls) - 1,
                                            "function": {"arguments": text}}]})
        return out

    def message(self) -> dict:
        m = dict(self.inner.message())
        m["content"] = None
        m["tool_calls"] = self.calls
        return m

    @property
    def tool_called(self) -> bool:
        return bool(self.calls)


# an element of the required calls' array up to its arguments: '[{"name": "f", "parameters": '
_ELEMENT_HEAD = re.compile(
    r'\s*[\[,]?\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"parameters"\s*:\s*')


class _JsonCalls:
    """The forced call's JSON read as it comes: events ("name", NAME) and
    ("arguments", text)."""

    def __init__(self, name: str | None):
        self.named = name
        self.buf = ""
        self.depth = 0  # of the arguments object being read (0: outside one)
        self.in_string = self.escaped = False
        # named: the arguments from the first character; required: "[" then per element
        # '{"name":"NAME","parameters":' … '}' and "," or "]"
        self.state = "arguments" if name is not None else "head"
        self.started = False

    def feed(self, text: str) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        if self.named is not None and not self.started and text:
            self.started = True
            out.append(("name", self.named))
        self.buf += text
        while self.buf:
            if self.state == "arguments":
                if self.depth == 0:  # the whitespace before the object is not its text
                    self.buf = self.buf.lstrip()
                    if not self.buf:
                        break
                n = self._arguments_end()
                chunk, self.buf = self.buf[:n], self.buf[n:]
                if chunk:
                    out.append(("arguments", chunk))
                if self.depth == 0 and chunk:
                    self.state = "tail" if self.named is None else "done"
                if self.buf == "" or self.state == "arguments":
                    break
            elif self.state == "head":
                m = _ELEMENT_HEAD.match(self.buf)
                if m is None:
                    break  # not complete yet
                out.append(("name", json.loads(f'"{m.group(1)}"')))
                self.buf = self.buf[m.end():]
                self.state = "arguments"
            elif self.state == "tail":  # the element's closing brace
                rest = self.buf.lstrip()
                if not rest.startswith("}"):
                    break
                self.buf = rest[1:]
                self.state = "head"
            else:
                self.buf = ""
        return out

    def _arguments_end(self) -> int:
        """How much of buf belongs to the arguments object (all of it while it is open)."""
        for i, ch in enumerate(self.buf):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    return i + 1
        return len(self.buf)
