"""Log-probabilities as the API shows them: legacy completions' `logprobs`, chat's
`logprobs.content`, vLLM's `prompt_logprobs`; tokens named as deploy/token_text.py names
them. And how many one response may hold."""

from __future__ import annotations

from deploy.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    PromptLogprob,
    RequestError,
    TopLogprob,
)
from deploy.token_text import TokenTexts
from workers.logprobs import TokenLogprob

MIN_LOGPROB = -9999.0  # what -inf is reported as (vLLM's value)
# Log-probabilities one response may hold (a token's, or an alternative's): about 200 MB of
# JSON. A response grows with n × max_tokens × alternatives; one request may not ask for
# more than this (a 400 before any work).
MAX_LOGPROB_ENTRIES = 1 << 22


def finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)  # JSON has no -inf


def completion_logprobs(names: TokenTexts, ids: list[int], lps: list[TokenLogprob | None],
                        offset: int, num: int) -> CompletionLogprobs:
    """Legacy completions logprobs of tokens `ids` whose text starts at `offset`, with
    `num` alternatives each (the prompt's may hold more, for prompt_logprobs), keyed by
    token name with none lost (deploy/token_text.py)."""
    out = CompletionLogprobs()
    for tok, lp in zip(ids, lps, strict=True):
        out.tokens.append(names.name(tok))
        out.token_logprobs.append(None if lp is None else finite(lp.logprob))
        out.top_logprobs.append(None if lp is None else names.keyed(
            (t, finite(v)) for t, v in lp.top[:num]))
        out.text_offset.append(offset)
        offset += len(names.text(tok))
    return out


def chat_logprobs(names: TokenTexts, ids: list[int], lps: list[TokenLogprob]) -> ChatLogprobs:
    def entry(tok: int, logprob: float) -> dict:
        return {"token": names.name(tok), "logprob": finite(logprob), "bytes": names.bytes(tok)}

    return ChatLogprobs(content=[
        ChatTokenLogprob(**entry(tok, lp.logprob),
                         top_logprobs=[TopLogprob(**entry(t, v)) for t, v in lp.top])
        for tok, lp in zip(ids, lps, strict=True)])


def prompt_logprobs(names: TokenTexts, prompt_ids: list[int],
                    lps: list[TokenLogprob | None] | None, num: int) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token after the first, {id: {logprob, rank,
    decoded_token}} for the token itself and the `num` most likely."""
    out: list[dict | None] = [None]
    name = names.name
    for tok, lp in zip(prompt_ids[1:], (lps or [None])[1:], strict=True):
        entries = {str(t): PromptLogprob(logprob=finite(v), rank=r, decoded_token=name(t))
                   for r, (t, v) in enumerate(lp.top[:num], start=1)}
        entries[str(tok)] = PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank,
                                          decoded_token=name(tok))
        out.append(entries)
    return out


def echo_logprobs(prompt_ids: list[int], lps: list[TokenLogprob | None] | None
                  ) -> list[TokenLogprob | None]:
    """The echoed prompt's log-probabilities (all None when none were asked for)."""
    return lps or [None] * len(prompt_ids)


def check_response_size(req, prompts: list[list[int]], budgets: list[int]) -> None:
    """Refuses a request whose response would hold more than MAX_LOGPROB_ENTRIES
    log-probabilities (each token's and its alternatives', counted at most: every choice
    running to its max_tokens), before any work is done."""
    k_out, k_prompt = req.logprob_counts()
    n, echo = req.num_choices, bool(getattr(req, "echo", False))
    entries = 0
    for ids, budget in zip(prompts, budgets, strict=True):
        if k_prompt is not None:  # once per prompt, however many choices it has
            entries += len(ids) * (k_prompt + 1)
        if k_out is not None:
            entries += n * (budget + (len(ids) if echo else 0)) * (k_out + 1)
    if entries > MAX_LOGPROB_ENTRIES:
        param = "n" if n > 1 else "logprobs" if k_out is not None else "prompt_logprobs"
        raise RequestError(
            f"the response could hold {entries} log-probabilities (tokens × (1 + "
            f"alternatives) × choices); at most {MAX_LOGPROB_ENTRIES}: lower n, max_tokens "
            f"or the number of alternatives", param)
