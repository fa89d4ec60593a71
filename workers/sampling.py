"""Sampling distributions and the speculative acceptance rules (greedy and exact rejection
sampling with a one-hot draft), as plain tensor functions.

Legend: K proposed tokens, V vocab.
"""

from __future__ import annotations

import torch

from configs.engine import SamplingParams


def probs_from_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """[N, V] logits → [N, V] fp32 probabilities after temperature, min-p, top-k and top-p
    (vLLM's order)."""
    scores = logits.float() / params.temperature
    if params.min_p > 0:  # drop tokens below min_p × the most likely one's probability
        probs = torch.softmax(scores, dim=-1)
        floor = params.min_p * probs.amax(dim=-1, keepdim=True)
        scores = scores.masked_fill(probs < floor, float("-inf"))
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
    if drafts.shape[1] == 0:  # a decode step: nothing to accept, the bonus is the argmax
        bonus = logits[:, 0].argmax(-1)
        return torch.zeros_like(bonus), bonus
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


# ---- batched on the device: one host sync per step, uniforms from per-request generators ----


def sample_from(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling on probs' device: row i gives token j with probability
    probs[i, j] / Σ probs[i] (rows need not be normalised); u [N] uniforms in [0, 1).
    Zero-probability tokens are never returned. → [N] long."""
    cdf = probs.float().cumsum(-1)  # [N, V]
    x = u.to(cdf) * cdf[:, -1]
    idx = torch.searchsorted(cdf, x.unsqueeze(-1), right=True).squeeze(-1)  # first cdf > x
    # rounding can put x on the total: fall back to the last token with mass
    last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(-1)
    return torch.minimum(idx, last)


def accept_sampling_batch(drafts: torch.Tensor, probs: torch.Tensor,
                          u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """accept_sampling for S blocks at once. drafts [S, K]; probs [S, K+1, V] (each sequence's
    own temperature/top-k/top-p applied); u [S, K+1] uniforms: K for the accept tests, one for
    the residual or bonus sample. → accepted [S], emitted token [S]."""
    n_seqs, k = drafts.shape
    p_draft = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [S, K]
    n = (u[:, :k] < p_draft).int().cumprod(1).sum(1)  # [S]
    row = probs[torch.arange(n_seqs, device=probs.device), n]  # [S, V] p at the stop
    if k > 0:  # rejected at n < K: the residual is p_n with the draft token removed
        d_n = drafts.gather(1, n.clamp(max=k - 1).unsqueeze(1))  # [S, 1]
        keep = (n == k).unsqueeze(1).to(row.dtype)
        row = row.scatter(1, d_n, row.gather(1, d_n) * keep)
    return n, sample_from(row, u[:, k])
