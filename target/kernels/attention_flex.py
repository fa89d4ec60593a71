"""Paged attention through FlexAttention: one call over the cache in place — no per-sequence
loop, no gathered copy of the context. The BlockMask lists each sequence's pages (block-sparse
over the physical cache, page = KV block) and its mask_mod maps a physical slot back to the
sequence's logical position, for causality and windows. Used for the target's uniform rounds
and the draft's blocks (draft/attention.py).

Opt-in (`GatedAttention.round_attention = "flex"`, `bench/engine.py --attention flex`): on
CUDA the call is compiled (the fused Triton kernel), on CPU it runs eagerly (it materialises
scores: correctness only). Equal to the reference on CPU; on the H200 (torch 2.11, 2026-12-03)
the compiled kernel failed its test and hit an illegal memory access inside the model, so
captured rounds use the gathered path instead (target/kernels/attention.py)."""

from __future__ import annotations

import warnings

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

_compiled = None


def _flex(device: torch.device):
    global _compiled
    if device.type != "cuda":
        return flex_attention
    if _compiled is None:
        # One compiled kernel per (batch bucket, query width, cache size) for the target and
        # the draft: more than dynamo's default of 8 recompiles per function.
        for knob in ("cache_size_limit", "recompile_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(getattr(torch._dynamo.config, knob), 128))
        _compiled = torch.compile(flex_attention, dynamic=False)
    return _compiled


def round_block_mask(seq_lens: torch.Tensor, block_tables: torch.Tensor, num_blocks: int,
                     page: int, width: int) -> BlockMask:
    """The mask of a uniform round: each sequence's last `width` positions (its queries) see
    its keys causally. seq_lens [S] include the round's tokens. Built once per forward and
    shared by every attention layer."""
    first_q = seq_lens - width  # [S] position of each sequence's first query

    def visible(b, q_idx, key_pos):
        return key_pos <= first_q[b] + q_idx

    return paged_block_mask(block_tables, seq_lens, visible, width, num_blocks, page)


def paged_attention_round(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          mask: BlockMask, scale: float) -> torch.Tensor:
    """q [S·B, Hq, D], the last B positions of each sequence (their K/V already stored);
    k_cache/v_cache [NB, page, Hkv, D]; mask from round_block_mask. Returns [S·B, Hq, D]."""
    n_seqs = mask.kv_num_blocks.shape[0]
    block, heads, dim = q.shape[0] // n_seqs, q.shape[1], q.shape[2]
    qq = q.view(n_seqs, block, heads, dim).transpose(1, 2)  # [S, Hq, B, D]
    out = paged_flex_with_mask(qq, k_cache, v_cache, mask, scale)
    return out.transpose(1, 2).reshape(n_seqs * block, heads, dim)


def paged_block_mask(block_tables: torch.Tensor, num_keys: torch.Tensor, visible, q_len: int,
                     num_blocks: int, page: int) -> BlockMask:
    """Sequence s's queries (q_len of them) over its first num_keys[s] cached positions (its
    pages in block_tables [S, P]), where `visible(b, q_idx, key_pos)` also holds (causality,
    windows); kv indices are physical slots of a cache of num_blocks pages."""
    n_seqs, width = block_tables.shape
    dev = block_tables.device
    n_pages = (num_keys + page - 1) // page  # [S]
    valid = torch.arange(width, device=dev)[None, :] < n_pages[:, None]  # [S, P]
    # physical page → its logical index in sequence s, −1 where not s's (column NB: a sink for
    # the unused table entries, which may hold any page id)
    phys = torch.where(valid, block_tables.long(), num_blocks)
    logical = torch.full((n_seqs, num_blocks + 1), -1, dtype=torch.long, device=dev)
    logical.scatter_(1, phys, torch.arange(width, device=dev).expand(n_seqs, width).clone())
    logical[:, num_blocks] = -1

    def mask_mod(b, h, q_idx, kv_idx):
        lp = logical[b, kv_idx // page]
        key_pos = lp * page + kv_idx % page
        return (lp >= 0) & (key_pos < num_keys[b]) & visible(b, q_idx, key_pos)

    indices = torch.zeros(n_seqs, num_blocks, dtype=torch.int32, device=dev)
    indices[:, :width] = block_tables
    return BlockMask.from_kv_blocks(n_pages.int()[:, None, None], indices[:, None, None],
                                    BLOCK_SIZE=(128, page), mask_mod=mask_mod,
                                    seq_lengths=(q_len, num_blocks * page),
                                    compute_q_blocks=False)  # forward only


def paged_flex(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               block_tables: torch.Tensor, num_keys: torch.Tensor, visible,
               scale: float) -> torch.Tensor:
    """q [S, Hq, Q, D] over each sequence's first num_keys[s] cached positions (its pages in
    block_tables [S, P]), where `visible(b, q_idx, key_pos)` also holds (causality, windows).
    The cache [NB, page, Hkv, D] is read in place. Returns [S, Hq, Q, D]."""
    mask = paged_block_mask(block_tables, num_keys, visible, q.shape[2], k_cache.shape[0],
                            k_cache.shape[1])
    return paged_flex_with_mask(q, k_cache, v_cache, mask, scale)


def paged_flex_with_mask(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         mask: BlockMask, scale: float) -> torch.Tensor:
    num_blocks, page, kv_heads, dim = k_cache.shape
    k = k_cache.view(1, num_blocks * page, kv_heads, dim).transpose(1, 2)  # [1, Hkv, NB·page, D]
    v = v_cache.view(1, num_blocks * page, kv_heads, dim).transpose(1, 2)
    with warnings.catch_warnings():  # eager (CPU) flex warns that it is unfused: we know
        warnings.simplefilter("ignore", UserWarning)
        # The compiled kernel skips tile configs whose BLOCK_N does not divide the sparse KV
        # block (a page): with pages under 64 tokens, ask for page-wide tiles.
        options = {"BLOCK_N": page} if q.device.type == "cuda" and page < 64 else None
        return _flex(q.device)(q, k.to(q.dtype), v.to(q.dtype), block_mask=mask, scale=scale,
                               enable_gqa=True, kernel_options=options)
