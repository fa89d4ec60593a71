"""Paged attention (any device): gather each sequence's pages, flash attention over them.

k_cache/v_cache [num_pages, page_size, kv_heads, D]; slot = page_id·page_size + offset.
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
    page_size = cache.shape[1]
    n_pages = -(-length // page_size)
    pages = cache[block_table[:n_pages].long()]  # [n, page_size, kv_heads, D]
    return pages.reshape(-1, *cache.shape[2:])[:length]


def backend_name(device: str, dtype: torch.dtype, rounds: str) -> str:
    """What runs the attention on this device and dtype, rounds being the resolved
    EngineConfig.attention_backend ("triton" or "torch"); reported at start-up."""
    if not device.startswith("cuda"):
        chunks = "PyTorch's fused flash attention for CPU"
    else:
        kernel = "FlashAttention-2" if dtype in (torch.float16, torch.bfloat16) \
            else "memory-efficient attention"
        chunks = f"PyTorch's {kernel} (CUDA)"
    few = ("the Triton split-keys kernel over the pages in place" if rounds == "triton"
           else "gathered pages, batched matmuls / SDPA")
    return f"prefill chunks: {chunks}; decode, rounds and draft blocks: {few}"


def attention_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                  scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention that never holds the score matrix, with its log-sum-exp: q [H, Lq, D], k, v
    [H, Lk, D] (as many heads) → out [H, Lq, D] in q's dtype, lse [H, Lq] fp32 (natural log).
    causal: query i sees keys 0..i (Lq == Lk). PyTorch's own flash kernels: FlashAttention-2
    on CUDA for half precision, the memory-efficient kernel for fp32 there, the fused flash
    kernel on CPU; each returns the log-sum-exp that `merge_partials` combines."""
    q4, k4, v4 = q[None], k[None], v[None]
    if q.is_cuda:
        if q.dtype in (torch.float16, torch.bfloat16):
            out = torch.ops.aten._scaled_dot_product_flash_attention(
                q4, k4, v4, 0.0, causal, False, scale=scale)
            return out[0][0], out[1][0]
        out = torch.ops.aten._scaled_dot_product_efficient_attention(
            q4, k4, v4, None, True, 0.0, causal, scale=scale)
        return out[0][0], out[1][0, :, : q.shape[1]]  # its lse rows are padded
    out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q4, k4, v4, 0.0, causal, scale=scale)
    return out[0][0], out[1][0]


def merge_partials(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                   lse2: torch.Tensor) -> torch.Tensor:
    """Softmax attention over two disjoint key sets from each one's output and log-sum-exp
    ([H, L, D], [H, L]): the weights exp(lse_i − lse) in fp32."""
    lse = torch.logaddexp(lse1, lse2)
    w1, w2 = (lse1 - lse).exp()[..., None], (lse2 - lse).exp()[..., None]
    return (o1.float() * w1 + o2.float() * w2).to(o1.dtype)


def chunk_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    scale: float) -> torch.Tensor:
    """One sequence's chunk of queries over its context: q [n_q, Hq, D] at the last n_q of
    the n_k positions whose keys are k, v [n_k, Hkv, D]. The keys before the chunk (its
    prefix) are visible to every query: the query heads sharing a kv head go as one stack of
    rows against them, unrepeated K/V; the chunk's own keys are causal: one square causal
    call, K/V repeated per query head (n_q rows only). Memory O((n_q + n_k)·heads·D)."""
    n_q, heads, dim = q.shape
    n_k, kv_heads = k.shape[0], k.shape[1]
    group, prefix = heads // kv_heads, n_k - n_q
    qh = q.transpose(0, 1)  # [Hq, n_q, D]
    k_self = k[prefix:].transpose(0, 1).repeat_interleave(group, 0)
    v_self = v[prefix:].transpose(0, 1).repeat_interleave(group, 0)
    o, lse = attention_lse(qh, k_self, v_self, True, scale)
    if prefix:
        # [n_q, Hkv, G, D] → [Hkv, G·n_q, D]: row g·n_q + i is query i of head kv·G + g
        stacked = q.view(n_q, kv_heads, group, dim).permute(1, 2, 0, 3).reshape(
            kv_heads, group * n_q, dim)
        op, lsep = attention_lse(stacked, k[:prefix].transpose(0, 1),
                                 v[:prefix].transpose(0, 1), False, scale)
        o = merge_partials(o, lse, op.reshape(heads, n_q, dim), lsep.reshape(heads, n_q))
    return o.transpose(0, 1)


# Queries per sequence up to which a sequence's attention is one masked call (decode, verify
# rounds, short chunks); longer chunks take `chunk_attention`. A round's rows must come out
# bit for bit as the decode step's would (speculative = target-only, token for token, in
# bf16 too): one softmax over all of a row's keys in one call, whatever the block size,
# where splitting the keys at the block's start would round differently per block size.
MASKED_MAX_QUERIES = 64


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """`chunk_attention`'s contract as one SDPA call with a boolean mask: memory O(n_q·n_k)
    for the mask and K/V repeated per query head, for few queries."""
    n_q, n_k = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kk = k.transpose(0, 1).repeat_interleave(group, 0)  # [Hq, n_k, D]
    vv = v.transpose(0, 1).repeat_interleave(group, 0)
    q_pos = torch.arange(n_k - n_q, n_k, device=q.device)[:, None]
    mask = torch.arange(n_k, device=q.device)[None, :] <= q_pos  # [n_q, n_k]
    o = F.scaled_dot_product_attention(q.transpose(0, 1), kk, vv, attn_mask=mask, scale=scale)
    return o.transpose(0, 1)


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
    0..seq_lens[s]-1 are all in the cache (the new ones already stored). Causal. Each
    sequence's pages are gathered (O(context) memory); a prefill chunk is attended by
    `chunk_attention` (no queries × keys tensor at any context length), a round or a decode
    by `masked_attention`."""
    out = torch.empty_like(q)
    lo = 0
    for s, (n_q, n_k) in enumerate(zip(query_lens, seq_lens, strict=True)):
        k = gather_pages(k_cache, block_tables[s], n_k).to(q.dtype)  # [n_k, Hkv, D]
        v = gather_pages(v_cache, block_tables[s], n_k).to(q.dtype)
        attend = chunk_attention if n_q > MASKED_MAX_QUERIES else masked_attention
        out[lo : lo + n_q] = attend(q[lo : lo + n_q], k, v, scale)
        lo += n_q
    return out


def paged_attention_gathered(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                             seq_lens: torch.Tensor, block_tables: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """A uniform round without host values (CUDA-graph capturable): q [S·W, Hq, D], the last W
    positions of each sequence (seq_lens [S] include them, their K/V stored); all of
    block_tables [S, P] is gathered (P·page_size keys; positions the query may not see, stale
    pages past a sequence's end included, are masked)."""
    n_seqs, n_pages = block_tables.shape
    _, page_size, kv_heads, dim = k_cache.shape
    width, keys = q.shape[0] // n_seqs, n_pages * page_size
    pages = block_tables.long()
    k = k_cache[pages].view(n_seqs, keys, kv_heads, dim).transpose(1, 2)  # [S, Hkv, C, D]
    v = v_cache[pages].view(n_seqs, keys, kv_heads, dim).transpose(1, 2)
    q_pos = seq_lens[:, None] - width + torch.arange(width, device=q.device)  # [S, W]
    mask = torch.arange(keys, device=q.device)[None, None, :] <= q_pos[:, :, None]  # [S, W, C]
    o = gqa_attention(q.view(n_seqs, width, *q.shape[1:]), k.to(q.dtype), v.to(q.dtype), mask,
                      scale)
    return o.reshape(q.shape)
