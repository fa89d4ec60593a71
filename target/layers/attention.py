"""Qwen3.5 gated full attention over the paged KV cache, tensor-parallel over heads.

q_proj rows hold per head [query | gate]; output = attn · sigmoid(gate) → o_proj. q_proj,
k_proj and v_proj are row views of one weight (`qkv_proj`): a step runs them as one GEMM.
kv heads are split across ranks when tp ≤ kv heads, replicated (rank r uses kv head
r // (tp / kv_heads)) when tp > kv heads.
"""

from __future__ import annotations

import torch
from torch import nn

from configs.model import TargetConfig
from target.batch import ForwardBatch, TargetCaches
from target.distributed import TPGroup
from target.kernels import attention as attn_kernels
from target.kernels import attention_triton, fused, qk_rope_triton
from target.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    stack_rows,
    stacked_linear,
)
from target.layers.norm import RMSNorm
from target.layers.rotary import RotaryEmbedding


class GatedAttention(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_idx: int, tp: TPGroup, dtype: torch.dtype,
                 rotary: RotaryEmbedding):
        super().__init__()
        # Uniform batches (every sequence queries the same count: rounds). Chosen once per
        # model by set_round_attention (the model's set_kernels: selection.round_attention):
        # "triton" reads the pages in place (target/kernels/attention_triton.py); "gathered"
        # gathers the table's pages for one batched call; both use no host values (CUDA graphs
        # capture them). "reference" loops over sequences with host lengths (eager torch).
        self.round_attention = "reference"
        # the triton rounds' launch shape (selection.ATTENTION_LAUNCH; None: the default)
        self.triton_launch = None
        # the q/k norms, RoPE and cache writes (KernelConfig.attention_prologue): "torch" or
        # "triton" (target/kernels/qk_rope_triton.py)
        self.prologue = "torch"
        self.layer_idx = layer_idx
        self.head_dim = d = cfg.head_dim
        self.num_heads = tp.shard(cfg.num_attention_heads, "num_attention_heads")
        kv = cfg.num_key_value_heads
        kv_shards = min(tp.size, kv)
        kv_rank = tp.rank * kv_shards // tp.size
        self.num_kv_heads = kv // kv_shards
        h = cfg.hidden_size
        self.q_proj = ColumnParallelLinear(h, [cfg.num_attention_heads * d * 2], tp, dtype)
        self.k_proj = ColumnParallelLinear(h, [kv * d], tp, dtype, kv_shards, kv_rank)
        self.v_proj = ColumnParallelLinear(h, [kv * d], tp, dtype, kv_shards, kv_rank)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * d, h, tp, dtype)
        # q, k and v read the same x: their weights are row views of one tensor (each filled
        # by its own loader), and a step runs them as one GEMM.
        qkv_proj, self.qkv_sizes = stack_rows([self.q_proj, self.k_proj, self.v_proj])
        self.register_buffer("qkv_proj", qkv_proj, persistent=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.rotary = rotary
        self.scale = d**-0.5

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: TargetCaches) -> torch.Tensor:
        t = x.shape[0]
        qkv = stacked_linear(x, self.qkv_proj, sum(self.qkv_sizes))
        q, k, v = qkv.split(self.qkv_sizes, dim=-1)
        q, gate = q.view(t, self.num_heads, 2 * self.head_dim).chunk(2, dim=-1)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        cos, sin = self.rotary.cos_sin(batch.positions, batch.attn_meta)
        k_cache, v_cache = caches.kv[self.layer_idx]
        if self.prologue == "triton":  # norms, RoPE and the cache writes in one launch
            q = qk_rope_triton.qk_norm_rope_store(
                q, k, v, self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, cos, sin,
                self.rotary.rotary_dim, k_cache, v_cache, batch.slot_mapping)
        else:
            q, k = fused.qk_norm_rope(q, k, self.q_norm.weight, self.k_norm.weight,
                                      self.q_norm.eps, cos, sin, self.rotary.rotary_dim)
            attn_kernels.store_kv(k, v, k_cache, v_cache, batch.slot_mapping)
        uniform = len(set(batch.query_lens)) == 1 and all(batch.is_verify)  # a round
        if uniform and self.round_attention == "triton":
            meta = batch.attn_meta  # the first query's position and the lengths, int32:
            if "round_lens" not in meta:  # made once per forward, read by every layer
                lens = batch.seq_lens_t.to(torch.int32)
                meta["round_lens"] = (lens - batch.query_lens[0], lens)
            o = attention_triton.paged_attention(q, k_cache, v_cache, batch.block_tables,
                                                 *meta["round_lens"], self.scale,
                                                 launch=self.triton_launch)
        elif uniform and self.round_attention == "gathered":
            o = attn_kernels.paged_attention_gathered(q, k_cache, v_cache, batch.seq_lens_t,
                                                      batch.block_tables, self.scale)
        else:
            o = attn_kernels.paged_attention(q, k_cache, v_cache, batch.query_lens,
                                             batch.seq_lens, batch.block_tables, self.scale)
        # per head, on gate's strided view (a chunk of q_proj's rows): no copy of it
        o = fused.sigmoid_gate(o.reshape(t, self.num_heads, self.head_dim), gate).reshape(t, -1)
        return self.o_proj(o)


ROUND_ATTENTION = ("reference", "gathered", "triton")


def set_round_attention(model: nn.Module, kind: str) -> None:
    """Every GatedAttention of `model` attends its uniform rounds with `kind` (ROUND_ATTENTION)."""
    if kind not in ROUND_ATTENTION:
        raise ValueError(f"round attention must be one of {ROUND_ATTENTION}, got {kind!r}")
    for m in model.modules():
        if isinstance(m, GatedAttention):
            m.round_attention = kind
