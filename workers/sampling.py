"""Sampling distributions and the speculative acceptance rules (greedy and exact rejection
sampling with a one-hot draft), as plain tensor functions.

Legend: K proposed tokens, V vocab.
"""

from __future__ import annotations

import torch

from configs.engine import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits → [N, V] fp32 probabilities after temperature, top-k and top-p."""
    scores = logits.float() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = sorted_p.cumsum(-1) - sorted_p >= params.top_p  # keep the smallest prefix ≥ top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(probs.cpu(), 1, generator=generator).item())


def accept_greedy(draft: torch.Tensor, logits: torch.Tensor) -> tuple[int, int]:
    """draft [K]; logits [K+1, V] of the verify block [anchor, d1..dK].
    Accept the longest prefix where d_i == argmax at i-1; the bonus is the argmax after it."""
    pred = logits.argmax(-1)  # [K+1]
    n = int((draft == pred[: draft.shape[0]]).int().cumprod(0).sum().item())
    return n, int(pred[n].item())


def accept_greedy_batch(drafts: torch.Tensor, logits: torch.Tensor
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_greedy for S blocks of one size, on the device (the caller reads both results
    with one host sync). drafts [S, K]; logits [S, K+1, V] → accepted [S], bonus [S]."""
    pred = logits.argmax(-1)  # [S, K+1]
    n = (drafts == pred[:, :-1]).int().cumprod(1).sum(1)  # [S]
    return n, pred.gather(1, n.unsqueeze(1)).squeeze(1)


def accept_sampling(
    draft: torch.Tensor, logits: torch.Tensor, params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """Rejection sampling with a deterministic (one-hot) draft q = δ(d_i): accept d_i with
    probability p_i(d_i); on the first rejection sample from p_i with d_i removed,
    renormalised; if all K pass, sample the bonus from p_K. Exact in distribution."""
    probs = probs_from_logits(logits, params).cpu()  # [K+1, V]
    k = draft.shape[0]
    draft = draft.cpu()
    p_draft = probs[torch.arange(k), draft]  # [K]
    u = torch.rand(k, generator=generator)
    accepted = (u < p_draft).int().cumprod(0)
    n = int(accepted.sum().item())
    if n == k:
        return n, sample(probs[k], generator)
    residual = probs[n].clone()
    residual[draft[n]] = 0.0
    return n, sample(residual / residual.sum(), generator)
