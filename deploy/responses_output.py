"""A response's output, written from the chat parser's deltas: the output items (reasoning a
`reasoning` item, content a `message`, each tool call a `function_call`; `OutputItems`), the
streaming events that build them, serialized as server-sent events (`sse_event`), and the
usage (`response_usage`).

Decisions:
- `reasoning.summary` is accepted; no summary is written (`summary: []`), the reasoning itself
  is the item's `content` (with --reasoning-parser).
- usage: `reasoning_tokens` counts the output up to `</think>` when the server parses
  reasoning (else 0); `cached_tokens` is 0.
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable

from deploy.generation import Generation
from deploy.reasoning_parser import END_THINK
from deploy.tool_parsers import TOOL_CALL


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(24)}"


class OutputItems:
    """A response's output items made from the parser's deltas as they come: deltas of one
    kind in a row make one item (reasoning a `reasoning` item, content a `message`, a call's
    header and arguments a `function_call`), closed when another begins. `emit` gets each
    streaming event (without its sequence number) as the item changes; the items are the
    same whichever way the text was split."""

    def __init__(self, emit: Callable[[dict], None]):
        self.items: list[dict] = []
        self.emit = emit
        self._calls: dict[int, int] = {}  # the parser's call index → its output index

    def add(self, delta: dict) -> None:
        if delta.get("reasoning_content"):
            self._text("reasoning", delta["reasoning_content"])
        elif delta.get("content"):
            self._text("message", delta["content"])
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                self._close()
                self._open({"id": _item_id("fc"), "type": "function_call",
                            "status": "in_progress", "call_id": call["id"],
                            "name": call["function"]["name"], "arguments": ""})
                self._calls[call["index"]] = len(self.items) - 1
            text = call["function"].get("arguments") or ""
            if text:
                i = self._calls[call["index"]]
                self.items[i]["arguments"] += text
                self.emit({"type": "response.function_call_arguments.delta",
                           "item_id": self.items[i]["id"], "output_index": i, "delta": text})

    def finish(self, status: str) -> None:
        """The last item closed with `status` (completed, incomplete); an output of nothing
        is an empty message."""
        if not self.items:
            self._text("message", "")
        self._close(status)

    @property
    def reasoning(self) -> bool:
        return any(item["type"] == "reasoning" for item in self.items)

    def _open(self, item: dict) -> None:
        self.items.append(item)
        self.emit({"type": "response.output_item.added", "output_index": len(self.items) - 1,
                   "item": item})

    def _text(self, kind: str, text: str) -> None:
        last = self.items[-1] if self.items else None
        if last is None or last["type"] != kind or last["status"] != "in_progress":
            self._close()
            part = {"type": "output_text", "text": "", "annotations": []} \
                if kind == "message" else {"type": "reasoning_text", "text": ""}
            self._open({"id": _item_id("msg"), "type": "message", "status": "in_progress",
                        "role": "assistant", "content": []} if kind == "message" else
                       {"id": _item_id("rs"), "type": "reasoning", "status": "in_progress",
                        "summary": [], "content": []})
            self.emit({**self._where(), "type": "response.content_part.added", "part": part})
            self.items[-1]["content"].append(part)
        self.items[-1]["content"][0]["text"] += text
        if text:
            name = "output_text" if kind == "message" else "reasoning_text"
            self.emit({**self._where(), "type": f"response.{name}.delta", "delta": text,
                       **({"logprobs": []} if kind == "message" else {})})

    def _where(self) -> dict:
        return {"item_id": self.items[-1]["id"], "output_index": len(self.items) - 1,
                "content_index": 0}

    def _close(self, status: str = "completed") -> None:
        item = self.items[-1] if self.items else None
        if item is None or item["status"] != "in_progress":
            return
        item["status"] = status
        if item["type"] == "function_call":
            self.emit({"type": "response.function_call_arguments.done", "item_id": item["id"],
                       "output_index": len(self.items) - 1, "arguments": item["arguments"]})
        else:
            part = item["content"][0]
            name = "output_text" if item["type"] == "message" else "reasoning_text"
            self.emit({**self._where(), "type": f"response.{name}.done", "text": part["text"],
                       **({"logprobs": []} if item["type"] == "message" else {})})
            self.emit({**self._where(), "type": "response.content_part.done", "part": part})
        self.emit({"type": "response.output_item.done", "output_index": len(self.items) - 1,
                   "item": item})


def sse_event(payload: dict) -> str:
    return f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"


def reasoning_end_ids(tokenizer) -> dict[int, int]:
    """The tokens that end reasoning, each with whether it counts as reasoning: `</think>`
    does, a `<tool_call>` (which ends it implicitly) does not. Tags the tokenizer splits are
    left out."""
    if tokenizer is None:
        return {}
    out = {}
    for tag, counts in ((END_THINK, 1), (TOOL_CALL, 0)):
        ids = tokenizer.encode(tag, add_special_tokens=False)
        if len(ids) == 1:
            out[ids[0]] = counts
    return out


def response_usage(gen: Generation, reasoning: bool, reasoning_ends: dict[int, int]) -> dict:
    """The usage of a finished output; its reasoning tokens are those up to where its
    reasoning ends (0 without a reasoning item)."""
    n, m = len(gen.prompt_ids), gen.completion_tokens
    thought = 0 if not reasoning else next(
        (i + reasoning_ends[t] for i, t in enumerate(gen.token_ids) if t in reasoning_ends), m)
    return {"input_tokens": n, "output_tokens": m, "total_tokens": n + m,
            "input_tokens_details": {"cached_tokens": gen.cached_tokens,
                                     "cache_write_tokens": 0},
            "output_tokens_details": {"reasoning_tokens": thought}}
