"""What the server does with a request's sampling controls before the engine sees them: a
structured output's grammar is compiled here (off the event loop; a spec that does not compile
is a 400 naming the field) and bad_words become token ids the way vLLM spells them (the
server then checks every token id against the vocabulary: SamplingParams.check_vocab). The
workers compile the same spec again in their own processes (workers/controls.py);
xgrammar's cache makes repeats free in each."""

from __future__ import annotations

import asyncio

from deploy.protocol import RequestError
from workers.grammar import GrammarError, Grammars


def bad_words_token_ids(tokenizer, words: str | list[str]) -> tuple[tuple[int, ...], ...]:
    """vLLM's spelling of bad_words: each word as it starts the text and, where the tokenizer
    spells it differently after a space (a new first token, the same length), that way too.
    ValueError for a blank word."""
    out: list[tuple[int, ...]] = []
    for word in [words] if isinstance(words, str) else words:
        if not word.strip():
            raise ValueError("bad_words must not hold empty or blank words")
        bare = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        out.append(bare)
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced[0] != bare[0] and len(spaced) == len(bare):
            out.append(spaced)
    return tuple(out)


class GrammarCheck:
    """The server's compiler: built on first use (reading the tokenizer's vocabulary takes a
    moment on a 248k vocabulary), then one compile per distinct spec."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self._grammars: Grammars | None = None
        self._lock = asyncio.Lock()

    async def check(self, req) -> None:
        found = req.grammar_spec()
        if found is None:
            return
        spec, field = found
        if self.tokenizer is None:
            raise RequestError("structured outputs need the model's tokenizer; this model "
                               "has none", field)
        async with self._lock:
            if self._grammars is None:
                self._grammars = await asyncio.to_thread(Grammars, self.tokenizer,
                                                         self.vocab_size)
        try:
            await asyncio.to_thread(self._grammars.compile, spec)
        except GrammarError as e:
            raise RequestError(str(e), field) from None
