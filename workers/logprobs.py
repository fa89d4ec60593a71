"""The target's log-probabilities of chosen tokens, with their most likely alternatives, from
logits the forward already computed: a verify round's rows for the tokens it commits (so they
are the target's own, exactly as plain decoding gives them), a prefill's rows for the prompt.

They are the log-softmax of the raw logits, before temperature, top-k and top-p (what vLLM
returns by default), computed in slices of rows so a long prompt never holds [T, V] at once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

ROWS_PER_SLICE = 256  # [256, V] fp32 at a time: 254 MB for a 248k vocabulary


@dataclass(frozen=True)
class TokenLogprob:
    """One token's log-probability, its rank in the vocabulary (1: the most likely), and the
    `n` most likely tokens at its position, best first, as (token id, log-probability)."""

    logprob: float
    rank: int = 1
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor | list[int],
                   num_top: int) -> list[TokenLogprob]:
    """logits [N, V] (row i is the distribution token i was drawn from); tokens [N]."""
    if isinstance(tokens, list):
        tokens = torch.tensor(tokens, dtype=torch.long, device=logits.device)
    chosen, ranks, top_lp, top_id = [], [], [], []
    for lo in range(0, logits.shape[0], ROWS_PER_SLICE):
        lp = torch.log_softmax(logits[lo : lo + ROWS_PER_SLICE].float(), dim=-1)
        mine = lp.gather(1, tokens[lo : lo + ROWS_PER_SLICE, None].to(lp.device))  # [n, 1]
        chosen.append(mine[:, 0])
        ranks.append((lp > mine).sum(-1) + 1)
        if num_top:
            values, ids = lp.topk(num_top, dim=-1)
            top_lp.append(values)
            top_id.append(ids)
    if not chosen:
        return []
    chosen_l, ranks_l = torch.cat(chosen).tolist(), torch.cat(ranks).tolist()
    if not num_top:
        return [TokenLogprob(c, r) for c, r in zip(chosen_l, ranks_l, strict=True)]
    ids_l, lps_l = torch.cat(top_id).tolist(), torch.cat(top_lp).tolist()
    return [TokenLogprob(c, r, tuple(zip(i, v, strict=True)))
            for c, r, i, v in zip(chosen_l, ranks_l, ids_l, lps_l, strict=True)]


def rows_logprobs(compute_logits: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                  tokens: list[int], num_top: int) -> list[TokenLogprob]:
    """token_logprobs of hidden states [N, H] through the LM head a slice at a time (a prompt's
    rows: never [N, V] logits at once)."""
    out: list[TokenLogprob] = []
    for lo in range(0, len(tokens), ROWS_PER_SLICE):
        out += token_logprobs(compute_logits(hidden[lo : lo + ROWS_PER_SLICE]),
                              tokens[lo : lo + ROWS_PER_SLICE], num_top)
    return out


def split_rows(logprobs: list[TokenLogprob], counts: list[int],
               num_tops: list[int]) -> list[list[TokenLogprob]]:
    """One list computed for several sequences (with the largest `num_top` among them) back
    into each one's `counts[i]` tokens, each keeping its own `num_tops[i]` alternatives."""
    out, lo = [], 0
    for n, k in zip(counts, num_tops, strict=True):
        out.append([TokenLogprob(t.logprob, t.rank, t.top[:k])
                    for t in logprobs[lo : lo + n]])
        lo += n
    return out
