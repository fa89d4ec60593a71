"""Paged attention, reference path (any device): gather each sequence's pages, causal SDPA.

k_cache/v_cache [num_blocks, block_size, kv_heads, D]; slot = block_id·block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# Masked SDPA backends for the captured steps: cuDNN's attention was slow here (~60 µs per
# call on the H200 at batch 1) and is kept out of CUDA graphs; the memory-efficient kernel
# takes the boolean mask, math is the fallback (and the CPU path).
_MASKED_BACKENDS = [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


# Up to this many score elements (S·Hkv·rows·keys) GQA attention runs as two batched matmuls
# around one masked softmax, scores materialised in fp32: at round sizes the memory-efficient
# SDPA kernel took ~55 µs per call on the H200 at batch 1 for ~1 MB of K/V (profile in
# docs/BENCHMARKS.md). Larger calls keep SDPA (scores would not fit comfortably).
EXPLICIT_MAX_SCORES = 1 << 24
_bmm_out_dtype: bool | None = None  # CUDA bmm with bf16 inputs → fp32 output (probed once)


def gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                  scale: float) -> torch.Tensor:
    """Masked GQA attention with each kv head's query heads stacked as rows, so K/V are read
    once per kv head instead of repeated per query head (query head h reads kv head h // G).
    q [S, W, Hq, D]; k, v [S, Hkv, K, D]; mask [S, W, K] bool (True = attend; every row must
    see at least one key). Returns [S, W, Hq, D]."""
    n_seqs, width, heads, dim = q.shape
    kv_heads, keys = k.shape[1], k.shape[2]
    group = heads // kv_heads
    # [S, W, Hkv, G, D] → [S, Hkv, G·W, D]: row g·W + w is query w of head kv·G + g
    qq = q.reshape(n_seqs, width, kv_heads, group, dim).permute(0, 2, 3, 1, 4)
    qq = qq.reshape(n_seqs, kv_heads, group * width, dim)
    rows_mask = mask.repeat(1, group, 1)[:, None]  # [S, 1, G·W, K]
    if n_seqs * kv_heads * group * width * keys <= EXPLICIT_MAX_SCORES:
        scores = _scores_fp32(qq, k) * scale  # [S, Hkv, G·W, K]
        probs = scores.masked_fill(~rows_mask, float("-inf")).softmax(-1)
        o = torch.matmul(probs.to(v.dtype), v)
    else:
        with sdpa_kernel(_MASKED_BACKENDS):
            o = F.scaled_dot_product_attention(qq, k, v, attn_mask=rows_mask, scale=scale)
    o = o.view(n_seqs, kv_heads, group, width, dim).permute(0, 3, 1, 2, 4)
    return o.reshape(n_seqs, width, heads, dim)


def _scores_fp32(qq: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """qq @ kᵀ in fp32: half-precision inputs accumulate and land in fp32 (CUDA's bmm with
    out_dtype), not rounded to bf16 scores."""
    global _bmm_out_dtype
    kt = k.transpose(-1, -2)
    if qq.dtype == torch.float32:
        return torch.matmul(qq, kt)
    if qq.is_cuda and _bmm_out_dtype is not False:
        lead = qq.shape[:-2]
        try:  # raises at dispatch (before any launch) where the overload is missing
            out = torch.bmm(qq.flatten(0, -3), kt.flatten(0, -3), out_dtype=torch.float32)
            _bmm_out_dtype = True
            return out.view(*lead, *out.shape[-2:])
        except (RuntimeError, NotImplementedError, TypeError):
            _bmm_out_dtype = False
    return torch.matmul(qq.float(), kt.float())


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    # k, v [T, kv_heads, D]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_pages(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    block_size = cache.shape[1]
    n_blocks = -(-length // block_size)
    pages = cache[block_table[:n_blocks].long()]  # [n, block_size, kv_heads, D]
    return pages.reshape(-1, *cache.shape[2:])[:length]


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    query_lens: list[int],
    seq_lens: list[int],
    block_tables: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D] for the last query_lens[s] positions of each sequence, whose keys
    0..seq_lens[s]-1 are all in the cache (the new ones already stored). Causal."""
    out = torch.empty_like(q)
    group = q.shape[1] // k_cache.shape[2]
    lo = 0
    for s, (n_q, n_k) in enumerate(zip(query_lens, seq_lens, strict=True)):
        k = gather_pages(k_cache, block_tables[s], n_k).transpose(0, 1)  # [Hkv, n_k, D]
        v = gather_pages(v_cache, block_tables[s], n_k).transpose(0, 1)
        k = k.repeat_interleave(group, 0)
        v = v.repeat_interleave(group, 0)
        qs = q[lo : lo + n_q].transpose(0, 1)  # [Hq, n_q, D]
        q_pos = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
        mask = torch.arange(n_k, device=q.device)[None, :] <= q_pos  # [n_q, n_k]
        o = F.scaled_dot_product_attention(qs, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           scale=scale)
        out[lo : lo + n_q] = o.transpose(0, 1)
        lo += n_q
    return out


def paged_attention_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             seq_lens: torch.Tensor, block_tables: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """A uniform round without host values (CUDA-graph capturable): q [S·W, Hq, D], the last W
    positions of each sequence (seq_lens [S] include them, their K/V stored); all of
    block_tables [S, P] is gathered (P·page keys; positions the query may not see, stale
    pages past a sequence's end included, are masked)."""
    n_seqs, n_pages = block_tables.shape
    _, page, kv_heads, dim = k_cache.shape
    width, keys = q.shape[0] // n_seqs, n_pages * page
    pages = block_tables.long()
    k = k_cache[pages].view(n_seqs, keys, kv_heads, dim).transpose(1, 2)  # [S, Hkv, C, D]
    v = v_cache[pages].view(n_seqs, keys, kv_heads, dim).transpose(1, 2)
    q_pos = seq_lens[:, None] - width + torch.arange(width, device=q.device)  # [S, W]
    mask = torch.arange(keys, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [S, W, C]
    o = gqa_attention(q.view(n_seqs, width, *q.shape[1:]), k.to(q.dtype), v.to(q.dtype), mask,
                      scale)
    return o.reshape(q.shape)
