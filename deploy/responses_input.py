"""A Responses request's input as the chat's: input items (with the stored conversation
before them) as chat messages (`chat_messages`), function tools, tool_choice and text.format
as the chat's fields, the translated body checked as a chat request (`chat_request`); and the
chat's errors renamed to the Responses fields they came from (`responses_error`: input[2],
tools[0].parameters, text.format), through each message's `Origin`.

Input is text only: input_image, input_file and input_audio parts are 400s, as are tools
other than function tools.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from deploy.protocol import ChatCompletionRequest, RequestError

TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
MEDIA_PARTS = ("input_image", "input_file", "input_audio")


@dataclass
class Origin:
    """The Responses field a chat message came from (errors name it): its item (`input[3]`,
    `instructions`, or `previous_response_id` for the stored conversation), and the item of
    each of its tool calls."""

    param: str
    calls: list[str] = field(default_factory=list)


def _string(item: dict, key: str, param: str, required: bool = True) -> str | None:
    value = item.get(key)
    if value is None and not required:
        return None
    if not isinstance(value, str):
        raise RequestError(f"{param}.{key} must be a string" if key in item
                           else f"{param}.{key} is required", f"{param}.{key}")
    return value


def _text(content: Any, param: str) -> str:
    """A message's (or a call output's) content: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{param} must be a string or a list of content parts", param)
    out = []
    for j, part in enumerate(content):
        where = f"{param}[{j}]"
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in MEDIA_PARTS:
            raise RequestError(f"{where}: {kind} is not supported: this server's model reads "
                               f"text only; send input_text parts", where)
        if kind not in TEXT_PARTS:
            raise RequestError(f"{where}.type: a content part is one of "
                               f"{', '.join(TEXT_PARTS)}, got {kind!r}", f"{where}.type")
        out.append(_string(part, TEXT_PARTS[kind], where))
    return "".join(out)


def _reasoning_text(item: dict, param: str) -> str:
    """A reasoning item's text: its content (reasoning_text parts), else its summary."""
    for key, sep in (("content", ""), ("summary", "\n\n")):
        parts = item.get(key) or []
        if not isinstance(parts, list) or not all(isinstance(p, dict) for p in parts):
            raise RequestError(f"{param}.{key} must be a list of text parts", f"{param}.{key}")
        texts = [_string(p, "text", f"{param}.{key}[{j}]") for j, p in enumerate(parts)]
        if texts:
            return sep.join(texts)
    return ""


def chat_messages(items: list[dict], params: list[str]) -> tuple[list[dict], list[Origin]]:
    """Input items as chat messages: a message each; the reasoning, assistant message and
    function calls that follow one another make one assistant message (its
    reasoning_content, content and tool_calls, as a chat turn holds them); a call's output a
    tool message."""
    messages: list[dict] = []
    origins: list[Origin] = []
    turn: dict | None = None  # the assistant message the items are filling

    def new_turn(param: str) -> dict:
        messages.append({"role": "assistant", "content": None})
        origins.append(Origin(param))
        return messages[-1]

    for item, param in zip(items, params, strict=True):
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "system", "developer", "assistant"):
                raise RequestError(f"{param}.role must be user, system, developer or "
                                   f"assistant, got {role!r}", f"{param}.role")
            text = _text(item.get("content"), f"{param}.content")
            if role == "assistant":
                if turn is None or turn["content"] is not None or "tool_calls" in turn:
                    turn = new_turn(param)
                turn["content"] = text
                continue
            turn = None
            messages.append({"role": role, "content": text})
            origins.append(Origin(param))
        elif kind == "reasoning":
            text = _reasoning_text(item, param)
            if turn is None or turn["content"] is not None or "tool_calls" in turn:
                turn = new_turn(param)
            turn["reasoning_content"] = turn.get("reasoning_content", "") + text
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", param), "type": "function", "function": {
                "name": _string(item, "name", param),
                "arguments": _string(item, "arguments", param)}}
            if turn is None:
                turn = new_turn(param)
            turn.setdefault("tool_calls", []).append(call)
            origins[-1].calls.append(param)
        elif kind == "function_call_output":
            turn = None
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", param),
                             "content": _text(item.get("output"), f"{param}.output")})
            origins.append(Origin(param))
        else:
            raise RequestError(f"{param}.type: input items are messages, reasoning, "
                               f"function_call and function_call_output; {kind!r} is not "
                               f"supported", f"{param}.type")
    return messages, origins


def chat_tools(tools: list[dict]) -> list[dict]:
    """Function tools in the chat's form ({type, function: {name, …}})."""
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind != "function":
            raise RequestError(f"{where}.type: only function tools are supported by this "
                               f"server, got {kind!r}", f"{where}.type")
        _string(tool, "name", where)
        _string(tool, "description", where, required=False)
        for key, types, name in (("parameters", dict, "an object"),
                                 ("strict", bool, "a boolean")):
            if tool.get(key) is not None and not isinstance(tool[key], types):
                raise RequestError(f"{where}.{key} must be {name}", f"{where}.{key}")
        out.append({"type": "function", "function": {
            k: tool[k] for k in ("name", "description", "parameters", "strict") if k in tool}})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise RequestError('tool_choice is "none", "auto", "required" or {"type": "function", '
                           '"name": …}; other tool types are not supported', "tool_choice")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(fmt: dict | None) -> dict | None:
    """text.format as the chat's response_format."""
    kind = None if fmt is None else fmt.get("type")
    if kind in (None, "text", "json_object"):
        return None if kind in (None, "text") else {"type": "json_object"}
    if kind != "json_schema":
        raise RequestError(f"text.format.type is text, json_object or json_schema, got "
                           f"{kind!r}", "text.format.type")
    if not isinstance(fmt.get("schema"), dict):
        raise RequestError("text.format json_schema needs a schema (a JSON schema object)",
                           "text.format.schema")
    return {"type": "json_schema", "json_schema": {
        k: fmt[k] for k in ("name", "description", "schema", "strict") if k in fmt}}


def chat_request(body: dict) -> ChatCompletionRequest:
    """The translated request, checked as a chat's; a field of the wrong type (the
    extensions passed on as sent) names the field."""
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        name = str(err["loc"][0]) if err["loc"] else None
        raise RequestError(f"{name}: {err['msg']}" if name else err["msg"], name) from None
    chat.check()
    return chat


# Chat fields renamed to the Responses fields they came from, in errors
_RENAMED = {"max_completion_tokens": "max_output_tokens", "response_format": "text.format",
            "messages": "input"}
_MESSAGE_PARAM = re.compile(r"messages[.\[](\d+)\]?(?:\.(.*))?")
_TOOL_PARAM = re.compile(r"tools[.\[](\d+)\]?\.function\.(.*)")
_CALL_PARAM = re.compile(r"tool_calls\[(\d+)\]\.function\.(.*)")


def responses_param(param: str | None, origins: list[Origin]) -> str | None:
    """A chat request's error param as the Responses field it came from."""
    if param is None:
        return None
    if m := _TOOL_PARAM.fullmatch(param):
        return f"tools[{m[1]}].{m[2]}"
    m = _MESSAGE_PARAM.fullmatch(param)
    if m is None or int(m[1]) >= len(origins):
        return _RENAMED.get(param, param)
    origin, rest = origins[int(m[1])], m[2]
    if rest and (c := _CALL_PARAM.fullmatch(rest)) and int(c[1]) < len(origin.calls):
        return f"{origin.calls[int(c[1])]}.{c[2]}"
    rest = {"tool_call_id": "call_id"}.get(rest, rest)
    return f"{origin.param}.{rest}" if rest and origin.param.startswith("input[") \
        else origin.param


def responses_error(err: RequestError, origins: list[Origin]) -> dict:
    """A translated chat's error JSON, naming the Responses fields it came from."""
    body = err.body()
    message = err.message
    for chat_name, name in _RENAMED.items():
        if chat_name != "messages":
            message = message.replace(chat_name, name)
    body["error"] |= {"message": message, "param": responses_param(err.param, origins)}
    return body
