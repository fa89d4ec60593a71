"""Incremental detokenisation with stop strings, one `TextStream` per request."""

from __future__ import annotations


class TextStream:
    """Incremental detokenisation and stop strings for one request. Text is released only once
    it cannot change: not ending in an incomplete UTF-8 sequence (decoded as U+FFFD) and not a
    possible start of a stop string. The released pieces concatenate to `decode(all ids)`."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer = tokenizer
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1  # chars a stop string may hide
        self.ids: list[int] = []
        # vLLM's offsets: ids[prefix:read] decoded last time, kept as context for the next
        # window (decoding a window alone can differ at its start, e.g. SentencePiece spaces).
        self.prefix = self.read = 0
        self.text = ""
        self.sent = 0  # chars of text already released
        self.stopped = False

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _advance(self, final: bool) -> None:
        if self.tokenizer is None:
            return
        before = self._decode(self.ids[self.prefix : self.read])
        after = self._decode(self.ids[self.prefix :])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            start = max(0, len(self.text) - self.hold)
            self.text += after[len(before) :]
            self.prefix, self.read = self.read, len(self.ids)
            hits = [i for i in (self.text.find(s, start) for s in self.stop) if i >= 0]
            if hits:
                self.text, self.stopped = self.text[: min(hits)], True

    def add(self, token_ids: list[int]) -> int:
        """Feeds tokens one by one; returns how many were taken (fewer after a stop string)."""
        for i, tok in enumerate(token_ids):
            self.ids.append(tok)
            self._advance(final=False)
            if self.stopped:
                return i + 1
        return len(token_ids)

    def release(self, final: bool) -> str:
        if final and not self.stopped:
            self._advance(final=True)
        end = len(self.text) if final or self.stopped else len(self.text) - self.hold
        if end <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent : end], end
        return delta
