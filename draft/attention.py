"""Pure-torch RoPE and paged block attention for the DFlash draft.

Legend: S sequences, B block length, N committed tokens, C gathered context length,
Hq query heads, Hkv kv heads, D head_dim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from target.kernels.attention import gqa_attention


def rope_inv_freq(head_dim: int, theta: float) -> Tensor:
    # the same expression as transformers' default RoPE, on CPU in fp32
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (theta**exponent)


def rope_cos_sin(inv_freq: Tensor, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    # positions [...] -> cos, sin [..., D]; computed in fp32, then cast (as transformers does)
    freqs = positions[..., None].float() * inv_freq.to(positions.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # x [..., heads, D]; cos/sin [..., D] broadcast over heads; rotate_half (NeoX) layout
    cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def write_kv(k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor, slot_mapping: Tensor) -> None:
    # k, v [N, Hkv, D] -> caches [num_pages, page_size, Hkv, D] at flat slots [N]
    kv_shape = k_cache.shape[-2:]
    k_cache.view(-1, *kv_shape).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(-1, *kv_shape).index_copy_(0, slot_mapping, v.to(v_cache.dtype))


def gather_context(
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    window: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Context K/V [S, C, Hkv, D], their positions [S, C] and validity [S, C].

    With a window only the last `window - 1` context positions can be seen by any block query
    (query p >= L sees key k only if p - k < window), so older pages are never read.
    """
    page_size = k_cache.shape[1]
    lens = context_lens.long()
    start = (lens - (window - 1)).clamp(min=0) if window is not None else torch.zeros_like(lens)
    span = lens - start
    # An upper bound of span.max() known on the host (no device sync): the table's width in
    # positions, or the window. Callers pass tables cut to the pages in use (DraftRunner).
    width = block_tables.shape[1] * page_size
    if window is not None:
        width = min(width, window - 1)
    offs = torch.arange(width, device=lens.device)
    valid = offs[None, :] < span[:, None]  # [S, C]
    pos = torch.where(valid, start[:, None] + offs[None, :], 0)
    # unused block-table entries may hold anything: only index them where valid
    page_idx = torch.where(valid, pos // page_size, 0)
    blocks = block_tables.long().gather(1, page_idx)
    slots = torch.where(valid, blocks * page_size + pos % page_size, 0)
    kv_shape = k_cache.shape[-2:]
    keep = valid[..., None, None]
    k = torch.where(keep, k_cache.view(-1, *kv_shape)[slots], 0)  # zeros: no NaN from stale
    v = torch.where(keep, v_cache.view(-1, *kv_shape)[slots], 0)
    return k, v, pos, valid


def block_mask(
    query_pos: Tensor,
    key_pos: Tensor,
    key_valid: Tensor,
    is_causal: bool,
    window: int | None,
) -> Tensor:
    # query_pos [S, B], key_pos/key_valid [S, K] -> bool [S, B, K] (True = attend);
    # the rule of the reference's `_attention_mask`, on absolute positions
    p, k = query_pos[:, :, None], key_pos[:, None, :]
    return key_valid[:, None, :] & key_visible(p, k, is_causal, window)


def key_visible(q_pos: Tensor, key_pos: Tensor, is_causal: bool, window: int | None) -> Tensor:
    """Whether a query at q_pos sees a valid key at key_pos (elementwise, broadcasting): causal
    layers see no later key, windowed ones none `window` or more away."""
    ok = key_pos <= q_pos if is_causal else torch.ones_like(key_pos - q_pos, dtype=torch.bool)
    if window is not None:
        ok = ok & (q_pos - key_pos < window)
        if not is_causal:
            ok = ok & (key_pos - q_pos < window)
    return ok


def paged_block_attention(
    q: Tensor,
    k_block: Tensor,
    v_block: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    *,
    is_causal: bool,
    window: int | None,
    scale: float,
    meta: dict | None = None,
    launch=None,
) -> Tensor:
    """Block queries over [paged context KV ; block KV]; q [S, B, Hq, D] -> [S, B, Hq, D].
    (`meta`, `launch`: as paged_block_attention_triton takes them; this form keeps nothing in
    `meta` and has no launch shape.)

    Sequence s has context at positions 0..L_s-1 and its block at L_s..L_s+B-1. Sequences are
    padded to the longest gathered context; padded keys are masked out.
    """
    num_seqs, block_len = q.shape[:2]
    k_ctx, v_ctx, ctx_pos, ctx_valid = gather_context(
        k_cache, v_cache, block_tables, context_lens, window
    )
    block_pos = context_lens.long()[:, None] + torch.arange(block_len, device=q.device)
    key_pos = torch.cat([ctx_pos, block_pos], dim=1)  # [S, K]
    key_valid = torch.cat([ctx_valid, torch.ones_like(block_pos, dtype=torch.bool)], dim=1)
    mask = block_mask(block_pos, key_pos, key_valid, is_causal, window)

    k = torch.cat([k_ctx.to(k_block.dtype), k_block], dim=1).transpose(1, 2)  # [S, Hkv, K, D]
    v = torch.cat([v_ctx.to(v_block.dtype), v_block], dim=1).transpose(1, 2)
    return gqa_attention(q, k, v, mask, scale)


def block_slots(block_tables: Tensor, context_lens: Tensor, block_len: int,
                page_size: int) -> Tensor:
    """[S·B] the cache slots of each sequence's block positions L_s … L_s+B−1."""
    pos = context_lens.long()[:, None] + torch.arange(block_len, device=context_lens.device)
    return (block_tables.long().gather(1, pos // page_size) * page_size
            + pos % page_size).flatten()


def write_block_kv(k_block: Tensor, v_block: Tensor, k_cache: Tensor, v_cache: Tensor,
                   slots: Tensor) -> None:
    """The block's K/V [S, B, Hkv, D] into each sequence's own slots (block_slots): the
    draft pages there are rewritten by the context write of whatever gets committed and are
    never read as context before, so context and block become one paged key range."""
    write_kv(k_block.flatten(0, 1), v_block.flatten(0, 1), k_cache, v_cache, slots)


def paged_block_attention_triton(
    q: Tensor,
    k_block: Tensor,
    v_block: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    context_lens: Tensor,
    *,
    is_causal: bool,
    window: int | None,
    scale: float,
    meta: dict | None = None,
    launch=None,
) -> Tensor:
    """paged_block_attention with the pages read in place by the Triton split-keys kernel
    (target/kernels/attention_triton.py): the block's K/V written to its own slots first
    (write_block_kv), then its queries over keys 0 … L_s+B−1. q [S, B, Hq, D] -> same.
    `meta`: a forward's dict, where the block's slots and int32 lengths are made once and
    read by every layer (they depend only on the tables and context lengths). `launch`: the
    kernel's launch shape (attention_triton.Launch; None: its default)."""
    from target.kernels.attention_triton import paged_attention

    meta = {} if meta is None else meta
    if "block" not in meta:
        lens = context_lens.to(torch.int32)
        meta["block"] = (block_slots(block_tables, context_lens, q.shape[1], k_cache.shape[1]),
                         lens, lens + q.shape[1])
    slots, first, last = meta["block"]
    write_block_kv(k_block, v_block, k_cache, v_cache, slots)
    out = paged_attention(q.flatten(0, 1), k_cache, v_cache, block_tables, first, last, scale,
                          causal=is_causal, window=window, launch=launch)
    return out.view(q.shape)
