"""Paged attention, reference path (any device): gather each sequence's pages, causal SDPA.

k_cache/v_cache [num_blocks, block_size, kv_heads, D]; slot = block_id·block_size + offset.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
