"""Tool calls in a chat output (`--tool-call-parser`), parsed as the text arrives, into OpenAI
delta dicts: `qwen3_coder`, the XML form Qwen3.5's chat template asks for
(`<tool_call>\\n<function=NAME>\\n<parameter=KEY>\\nVALUE\\n</parameter>\\n</function>\\n</tool_call>`),
and `hermes`, Qwen3's JSON form (`<tool_call>\\n{"name": …, "arguments": {…}}\\n</tool_call>`).

What is not a call is content, in order. The decisions, the same for both forms:
- Whitespace next to a call is dropped (the template writes it back when rendering the turn);
  the whitespace before the calls survives only to join text before them to text after them.
- Text after the calls (the template asks for none) is content, after the text before them.
- A `<tool_call>` block that is not a call is content, as written: qwen3_coder, no
  `<function=NAME>` before `</tool_call>` or the end of the output (so a cut before the name is
  complete shows the tag as text, like any cut text); hermes, no JSON object with a "name" and
  an object of "arguments".
- An output cut inside a call (max_tokens) closes it: qwen3_coder sends the parameters complete
  by then and `}`, dropping one whose value was cut; hermes takes the block if its JSON is
  complete, else it is content.
- A parameter's value ends at `</parameter>` only: a value may hold the other tags as text.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

from deploy.reasoning_parser import undecided_from

TOOL_CALL, END_TOOL_CALL = "<tool_call>", "</tool_call>"
END_PARAMETER = "</parameter>"
_HEAD = re.compile(r"<function=[ \t]*([^<>\s]+)[ \t]*>|</tool_call>")
_BODY = re.compile(r"<parameter=([^<>\n]+)>|</function>|</tool_call>")
_TAIL = re.compile(r"</?tool_call>")  # a missing `</tool_call>`: the next call ends this one


class ToolCallParser:
    """The text around the calls; a subclass's `_call` reads each call."""

    def __init__(self, tools: list[dict], new_call_id: Callable[[], str]):
        self.functions = {f["name"]: f for t in tools
                          if isinstance(f := t.get("function"), dict) and "name" in f}
        self.new_call_id = new_call_id
        self.buf = ""  # text received, not yet released
        self.in_call = False  # buf starts after a `<tool_call>`
        self.after_call = False  # buf starts after a call: its leading whitespace goes
        self.sep = ""  # the whitespace before the calls
        self.has_content = False
        self.calls = 0  # headers sent; the call being read is calls - 1

    def feed(self, text: str) -> list[dict]:
        self.buf += text
        return self._release(final=False)

    def finish(self) -> list[dict]:
        return self._release(final=True)

    def _release(self, final: bool) -> list[dict]:
        out: list[dict] = []
        while True:
            if self.in_call:
                was_call = self._call(out, final)
                if was_call is None:  # the call goes on past buf
                    break
                self.in_call, self.after_call = False, was_call
                continue
            if self.after_call:
                self.buf = self.buf.lstrip()
                if not self.buf:
                    break
                self.after_call = False
            i = self.buf.find(TOOL_CALL)
            if i < 0:
                end = len(self.buf) if final else undecided_from(self.buf, (TOOL_CALL,))
                self._content(out, self.buf[:end])
                self.buf = self.buf[end:]
                break
            text = self.buf[:i].rstrip()
            self._content(out, text)
            self.sep += self.buf[len(text):i]
            self.buf, self.in_call = self.buf[i + len(TOOL_CALL):], True
        return out

    def _call(self, out: list[dict], final: bool) -> bool | None:
        """Reads the call at the start of buf (after its `<tool_call>`), sending its deltas to
        `out`: True once the call is over, False once the block proved to be text (sent as
        content), None while it goes on past buf."""
        raise NotImplementedError

    def _content(self, out: list[dict], text: str) -> None:
        if not text:
            return
        if self.has_content:
            text = self.sep + text
        self.sep, self.has_content = "", True
        out.append({"content": text})

    def _text_block(self, out: list[dict], end: int) -> bool:
        """The block up to `end` of buf is no call: content, with its tag."""
        self._content(out, TOOL_CALL + self.buf[:end])
        self.buf = self.buf[end:]
        return False

    def _header(self, out: list[dict], name: str) -> None:
        self.calls += 1
        out.append({"tool_calls": [{"index": self.calls - 1, "id": self.new_call_id(),
                                    "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})

    def _arguments(self, out: list[dict], text: str) -> None:
        out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": text}}]})


class Qwen3CoderToolParser(ToolCallParser):
    """The XML form. The header goes as soon as `<function=NAME>` is complete; then each
    parameter as it completes (`{"key": value`, then `, "key": value`), typed by the tool's
    schema (`typed_value`), and `}` at `</function>`."""

    def __init__(self, tools: list[dict], new_call_id: Callable[[], str]):
        super().__init__(tools, new_call_id)
        self.phase = "head"  # → "body" after `<function=NAME>` → "tail" after `</function>`
        self.properties: dict[str, Any] = {}  # the called tool's parameters' schemas
        self.key: str | None = None  # the parameter whose value is being read
        self.sent = 0  # parameters sent of this call

    def _call(self, out: list[dict], final: bool) -> bool | None:
        while True:
            if self.phase == "head":
                m = _HEAD.search(self.buf)
                if m is None and not final:
                    return None
                if m is None or m.group(1) is None:
                    return self._text_block(out, len(self.buf) if m is None else m.end())
                name = m.group(1)
                self._header(out, name)
                self.buf, self.phase, self.sent = self.buf[m.end():], "body", 0
                self.properties = _properties(self.functions.get(name))
            elif self.key is not None:  # inside a value
                end = self.buf.find(END_PARAMETER)
                if end < 0 and not final:
                    return None
                if end >= 0:
                    self._parameter(out, self.key, self.buf[:end])
                self.buf = self.buf[end + len(END_PARAMETER):] if end >= 0 else ""
                self.key = None
            elif self.phase == "body":
                m = _BODY.search(self.buf)
                if m is None and not final:
                    return None
                self.buf = self.buf[m.end():] if m else ""
                if m and m.group(1) is not None:
                    self.key = m.group(1).strip()
                    continue
                self._arguments(out, "}" if self.sent else "{}")
                if m is None or m.group() == END_TOOL_CALL:
                    return self._over()
                self.phase = "tail"
            else:
                m = _TAIL.search(self.buf)
                if m is None and not final:
                    return None
                self.buf = "" if m is None else self.buf[
                    m.end() if m.group() == END_TOOL_CALL else m.start():]
                return self._over()

    def _over(self) -> bool:
        self.phase, self.key = "head", None
        return True

    def _parameter(self, out: list[dict], key: str, raw: str) -> None:
        # the template writes a newline after `<parameter=KEY>` and before `</parameter>`
        raw = raw.removeprefix("\n").removesuffix("\n")
        value = typed_value(raw, self.properties.get(key))
        text = (json.dumps(key, ensure_ascii=False) + ": "
                + json.dumps(value, ensure_ascii=False))
        self._arguments(out, ("{" if self.sent == 0 else ", ") + text)
        self.sent += 1


class HermesToolParser(ToolCallParser):
    """The JSON form. A call's header and its arguments (the object, as json.dumps writes it)
    go together at `</tool_call>`: only then is the block known to be a call, and a block that
    is not is content."""

    def _call(self, out: list[dict], final: bool) -> bool | None:
        end = self.buf.find(END_TOOL_CALL)
        if end < 0 and not final:
            return None
        block_end = end + len(END_TOOL_CALL) if end >= 0 else len(self.buf)
        call = _hermes_call(self.buf[:end] if end >= 0 else self.buf)
        if call is None:
            return self._text_block(out, block_end)
        self._header(out, call[0])
        self._arguments(out, call[1])
        self.buf = self.buf[block_end:]
        return True


TOOL_PARSER_CLASSES: dict[str, type[ToolCallParser]] = {
    "qwen3_coder": Qwen3CoderToolParser, "hermes": HermesToolParser}


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as JSON) of a hermes block's text; None when it is no call."""
    call = _loads(body)
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        arguments = _loads(arguments)
    if not isinstance(arguments, dict):
        return None
    return call["name"], json.dumps(arguments, ensure_ascii=False)


def _properties(function: dict | None) -> dict[str, Any]:
    parameters = (function or {}).get("parameters")
    properties = parameters.get("properties") if isinstance(parameters, dict) else None
    return properties if isinstance(properties, dict) else {}


_NOT_JSON = object()
_PYTHON_TYPES = {bool: "boolean", int: "integer", float: "number", str: "string",
                 type(None): "null", list: "array", dict: "object"}
# Tried in this order, before the text itself: in a union with "string", text that parses as
# another allowed type is taken as that type.
_NON_STRING = ("null", "boolean", "integer", "number", "object", "array")


def typed_value(raw: str, schema: Any) -> Any:
    """A qwen3_coder parameter's text as the JSON value its schema types: the first of the
    schema's non-string types (in `_NON_STRING`'s order) the text parses as; else the text
    itself (a string parameter, an unknown one or one of an unknown tool, a schema with no type,
    text that fits none of the types). Booleans and null also read as the template writes
    Python's (`True`, `None`)."""
    types = schema_types(schema)
    for t in _NON_STRING:
        if t in types and (value := _parse_as(raw.strip(), t)) is not _NOT_JSON:
            return value
    return raw


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema allows: its `type` (one or a list), its anyOf/oneOf branches',
    or those of its enum/const values; empty when it says nothing."""
    if not isinstance(schema, dict):
        return set()
    t = schema.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    types: set[str] = set()
    for key in ("anyOf", "oneOf"):
        if isinstance(branches := schema.get(key), list):
            for branch in branches:
                types |= schema_types(branch)
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else []
    values = [*values, schema["const"]] if "const" in schema else values
    return types | {_PYTHON_TYPES.get(type(v), "string") for v in values}


def _parse_as(word: str, t: str) -> Any:
    if t == "null":
        return None if word in ("null", "None") else _NOT_JSON
    if t == "boolean":
        return {"true": True, "false": False}.get(word.lower(), _NOT_JSON)
    value = _loads(word)
    if t == "integer" and type(value) is float and value.is_integer():
        value = int(value)
    wanted = {"integer": (int,), "number": (int, float), "object": (dict,), "array": (list,)}
    return value if type(value) in wanted[t] else _NOT_JSON


def _loads(text: str) -> Any:
    """JSON that json.dumps writes back as JSON (no NaN or infinities); _NOT_JSON otherwise."""
    try:
        return json.loads(text, parse_float=_finite, parse_constant=_no_constant)
    except (ValueError, RecursionError):  # RecursionError: nested past Python's stack
        return _NOT_JSON


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} is not a finite number")
    return value


def _no_constant(text: str) -> float:
    raise ValueError(f"{text} is not JSON")
