"""A chat output as OpenAI's assistant message, parsed as the text streams in: reasoning
(deploy/reasoning_parser.py), then tool calls in what follows it (deploy/tool_parsers.py), the
rest content. One path for both kinds of response: a stream sends what `feed` and `finish`
return, a whole response feeds the whole output and reads `message()`. Whatever the split of the
text into deltas, the message is the same, and the deltas concatenate to it as the openai SDK
reassembles a stream (tests/deploy/test_chat_parsers.py)."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from deploy.reasoning_parser import END_THINK, ReasoningParser, opens_reasoning
from deploy.tool_parsers import TOOL_CALL, TOOL_PARSER_CLASSES

REASONING_PARSERS = ("qwen3",)  # --reasoning-parser
TOOL_PARSERS = ("qwen3_coder", "hermes")  # --tool-call-parser


def new_call_id() -> str:
    return "call_" + secrets.token_hex(12)


class ChatOutputParser:
    """One choice's output. `tools`: the request's OpenAI tool dicts; without them no call is
    parsed, whatever `tool_parser`. `prompt_text`: the rendered prompt, whose last turn says
    whether the output starts inside reasoning.

    Deltas: {"reasoning_content": s, "reasoning": s} (vLLM's old and new names), {"content": s},
    a call's header {"tool_calls": [{"index", "id", "type": "function",
    "function": {"name", "arguments": ""}}]}, then its argument text
    {"tool_calls": [{"index", "function": {"arguments": s}}]}."""

    def __init__(self, reasoning_parser: str | None, tool_parser: str | None,
                 tools: list[dict] | None, prompt_text: str,
                 new_call_id: Callable[[], str] = new_call_id):
        if reasoning_parser not in (None, *REASONING_PARSERS):
            raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got "
                             f"{reasoning_parser!r}")
        if tool_parser not in (None, *TOOL_PARSERS):
            raise ValueError(f"tool_parser must be one of {TOOL_PARSERS}, got {tool_parser!r}")
        self.tools = (TOOL_PARSER_CLASSES[tool_parser](tools, new_call_id)
                      if tool_parser and tools else None)
        self.reasoning = None
        if reasoning_parser is not None:
            ends = (END_THINK, TOOL_CALL) if self.tools else (END_THINK,)
            self.reasoning = ReasoningParser(opens_reasoning(prompt_text), ends)
        self.empty = True  # no output text yet
        self._reasoning: list[str] = []
        self._content: list[str] = []
        self._calls: list[dict] = []

    def feed(self, text: str) -> list[dict]:
        """The deltas to send now (often none: text is held back until it is known what it
        is)."""
        self.empty = self.empty and not text
        reasoning, rest = self.reasoning.feed(text) if self.reasoning else ("", text)
        return self._deltas(reasoning, rest, final=False)

    def finish(self) -> list[dict]:
        """The deltas held back, at the end of the output (also one cut by max_tokens)."""
        reasoning, rest = self.reasoning.finish() if self.reasoning else ("", "")
        return self._deltas(reasoning, rest, final=True)

    def message(self) -> dict:
        """After `finish`: the whole message. Content is None when there is none, unless the
        output was empty and called nothing ("")."""
        reasoning = "".join(self._reasoning) or None
        return {"content": "".join(self._content) or ("" if self.empty else None),
                "reasoning_content": reasoning, "reasoning": reasoning,
                "tool_calls": [{**c, "function": dict(c["function"])} for c in self._calls]}

    @property
    def tool_called(self) -> bool:
        return bool(self._calls)

    def _deltas(self, reasoning: str, rest: str, final: bool) -> list[dict]:
        deltas = [{"reasoning_content": reasoning, "reasoning": reasoning}] if reasoning else []
        if self.tools is not None:
            deltas += self.tools.feed(rest)
            deltas += self.tools.finish() if final else []
        elif rest:
            deltas.append({"content": rest})
        deltas = _merged(deltas)
        for d in deltas:
            self._record(d)
        return deltas

    def _record(self, delta: dict) -> None:
        if "reasoning" in delta:
            self._reasoning.append(delta["reasoning"])
        elif "content" in delta:
            self._content.append(delta["content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                self._calls.append({"id": call["id"], "type": "function",
                                    "function": {"name": call["function"]["name"],
                                                 "arguments": ""}})
            self._calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]


def _merged(deltas: list[dict]) -> list[dict]:
    """Adjacent deltas of the same text joined (fewer chunks, the same message): reasoning,
    content, or one call's argument text."""
    out: list[dict] = []
    for d in deltas:
        last = out[-1] if out else {}
        if "reasoning" in d and "reasoning" in last:
            last["reasoning"] = last["reasoning_content"] = last["reasoning"] + d["reasoning"]
        elif "content" in d and "content" in last:
            last["content"] += d["content"]
        elif _arguments(d) and _arguments(last) and (
                d["tool_calls"][0]["index"] == last["tool_calls"][0]["index"]):
            last["tool_calls"][0]["function"]["arguments"] += _arguments(d)
        else:
            out.append(d)
    return out


def _arguments(delta: dict) -> str:
    """The argument text of a delta that carries only that; "" otherwise."""
    calls = delta.get("tool_calls")
    return calls[0]["function"]["arguments"] if calls and "id" not in calls[0] else ""
