"""Qwen3's reasoning in a chat output (`--reasoning-parser qwen3`): the text inside
`<think>…</think>`, split from the rest as the output streams in; and the one rule of text
scanning that this parser and the tool parsers (deploy/tool_parsers.py) share, what to hold
back at the end of a delta."""

from __future__ import annotations

THINK, END_THINK = "<think>", "</think>"
TURN_START = "<|im_start|>"


def opens_reasoning(prompt_text: str) -> bool:
    """Whether the output starts inside reasoning: the prompt's last turn is the assistant's
    and opened `<think>` without closing it. Qwen3.5's generation prompt ends with
    `<think>\\n`; with enable_thinking false it writes an empty, closed block. Only the last turn
    is read: a user's text may hold the tags too."""
    start = prompt_text.rfind(TURN_START)
    turn = prompt_text[max(start, 0):]
    if start >= 0 and not turn.startswith(TURN_START + "assistant"):
        return False
    return turn.rfind(THINK) > turn.rfind(END_THINK)


def undecided_from(text: str, tags: tuple[str, ...]) -> int:
    """Where the end of `text` that later text may still change starts: a tag begun but not
    complete (a delta may end inside one, e.g. one spelt by byte tokens), with the whitespace
    before it (whitespace next to a tag is dropped). Everything before it may be sent."""
    longest = max(map(len, tags)) - 1
    partial = next((k for k in range(min(longest, len(text)), 0, -1)
                    if any(tag.startswith(text[-k:]) for tag in tags)), 0)
    return len(text[: len(text) - partial].rstrip())


class ReasoningParser:
    """Splits an output into reasoning and the rest, as text arrives. Reasoning starts with the
    output when the prompt opened it (`starts_inside`), else when the output starts, after
    whitespace, with `<think>`; it ends at the first of `ends`: `</think>`, and `<tool_call>`
    where calls are parsed (a call ends reasoning implicitly and begins the rest). An output that
    ends inside reasoning is all reasoning.

    Whitespace is trimmed as the chat template trims it when it renders the turn back: at both
    ends of the reasoning, and at the start of the rest after `</think>`; trailing whitespace
    is held back until what follows it is known. The rest is otherwise passed on unchanged."""

    def __init__(self, starts_inside: bool, ends: tuple[str, ...] = (END_THINK,)):
        self.ends = ends
        self.state = "reasoning" if starts_inside else "start"  # → "reasoning" → "rest"
        self.buf = ""  # text received, not yet released
        self.reasoned = False  # reasoning released yet: until then its whitespace is leading
        self.strip_rest = False  # the rest follows `</think>`: its leading whitespace goes

    def feed(self, text: str) -> tuple[str, str]:
        """The reasoning and the rest that `text` releases (the reasoning comes first)."""
        self.buf += text
        return self._release(final=False)

    def finish(self) -> tuple[str, str]:
        return self._release(final=True)

    def _release(self, final: bool) -> tuple[str, str]:
        reasoning = rest = ""
        if self.state == "start":
            head = self.buf.lstrip()
            if head.startswith(THINK):
                self.buf, self.state = head[len(THINK):], "reasoning"
            elif final or not THINK.startswith(head):
                self.state = "rest"
            else:  # only whitespace yet, or a `<think>` begun
                return "", ""
        if self.state == "reasoning":
            reasoning = self._reasoning(final)
        if self.state == "rest":
            if self.strip_rest:
                self.buf = self.buf.lstrip()
                self.strip_rest = not self.buf
            rest, self.buf = self.buf, ""
        return reasoning, rest

    def _reasoning(self, final: bool) -> str:
        hits = [(i, tag) for tag in self.ends if (i := self.buf.find(tag)) >= 0]
        if hits:
            i, tag = min(hits)
            text, self.buf = self.buf[:i].rstrip(), self.buf[i:]
            if tag == END_THINK:
                self.buf, self.strip_rest = self.buf[len(tag):], True
            self.state = "rest"
        else:
            end = len(self.buf.rstrip()) if final else undecided_from(self.buf, self.ends)
            text, self.buf = self.buf[:end], self.buf[end:]
        if not self.reasoned:
            text = text.lstrip()
            self.reasoned = bool(text)
        return text
