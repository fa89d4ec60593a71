"""How the API names a token in log-probabilities, and its bytes.

A token's name is its text decoded alone. A byte-level BPE token that holds part of a UTF-8
character has no text of its own (it decodes to U+FFFD, as many others do): it is named by its
bytes instead, as OpenAI does (`\\xe2\\x80`), so distinct tokens keep distinct names. Where two
alternatives of one position still share a name (a tokenizer that maps several tokens to one
text), the later ones are keyed `token_id:<id>` (vLLM's spelling) in the dictionaries that key
alternatives by name, so none is lost. A token's `bytes` (chat log-probabilities) are its own
bytes, not those of its name."""

from __future__ import annotations

from collections.abc import Iterable


def _bytes_to_unicode() -> dict[int, str]:
    """Byte-level BPE's byte → printable character table (GPT-2's)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return table


_BYTE_OF_CHAR = {c: b for b, c in _bytes_to_unicode().items()}


def _is_byte_level(tokenizer) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel"


class TokenTexts:
    """Names and bytes of `tokenizer`'s tokens, cached (at most the vocabulary)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.byte_level = tokenizer is not None and _is_byte_level(tokenizer)
        self.added = set(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self._cache: dict[int, tuple[str, str, bytes]] = {}

    def _entry(self, token_id: int) -> tuple[str, str, bytes]:
        """(name, text, bytes) of one token."""
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = self.tokenizer.decode([token_id])
        raw = text.encode("utf-8")
        if self.byte_level and token_id not in self.added:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if piece is not None and all(c in _BYTE_OF_CHAR for c in piece):
                raw = bytes(_BYTE_OF_CHAR[c] for c in piece)
        try:
            raw.decode("utf-8")
            name = text
        except UnicodeDecodeError:
            name = "".join(f"\\x{b:02x}" for b in raw)
        hit = self._cache[token_id] = (name, text, raw)
        return hit

    def name(self, token_id: int) -> str:
        return self._entry(token_id)[0]

    def text(self, token_id: int) -> str:
        """What the token adds to the decoded text (its length counts in text offsets)."""
        return self._entry(token_id)[1]

    def bytes(self, token_id: int) -> list[int]:
        return list(self._entry(token_id)[2])

    def keyed(self, items: Iterable[tuple[int, float]]) -> dict[str, float]:
        """{name: value} for (token id, value) pairs, every pair kept."""
        out: dict[str, float] = {}
        for token_id, value in items:
            key = self.name(token_id)
            out[key if key not in out else f"token_id:{token_id}"] = value
        return out
