"""The forward's elementwise chains as plain functions of tensors — norms, the Gated DeltaNet
gates and head split, MoE routing, SwiGLU, RoPE, output gates — so that each can run as one
fused kernel instead of 5–25 small ones (the profile of a captured decode step: ~4000 such
kernels, ~8 of its 12.5 ms; docs/BENCHMARKS.md).

Eager, they are the reference math (the layers call them). `enable()` compiles each with
torch.compile (dynamic shapes, one graph, parameters as arguments: one compiled kernel
serves every layer) for CUDA tensors. The worker enables it whenever it captures CUDA graphs
(at batch 1 on the H200: decode 11.5 → 7.1 ms; `bench/engine.py --no-fuse` for the A/B);
tests/target/test_fused.py checks the compiled functions against the eager ones."""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F

from target.kernels import gdn_torch

_enabled = False


def enable(on: bool = True) -> None:
    """Compile the functions below for CUDA tensors from now on (the first call per shape
    family compiles: do it before capturing CUDA graphs, as their warm-up does)."""
    global _enabled
    _enabled = on


def fusable(fn: Callable) -> Callable:
    compiled = None

    @functools.wraps(fn)
    def run(x: torch.Tensor, *args, **kwargs):
        nonlocal compiled
        if _enabled and x.is_cuda:
            if compiled is None:
                compiled = torch.compile(fn, dynamic=True, fullgraph=True)
            return compiled(x, *args, **kwargs)
        return fn(x, *args, **kwargs)

    run.compile = lambda: torch.compile(fn, dynamic=True, fullgraph=True)  # (tests)
    run.eager = fn
    return run


@fusable
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3.5's zero-centred RMSNorm: x·rsqrt(mean x² + eps)·(1 + w), in fp32."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (h * (1.0 + weight.float())).to(x.dtype)


@fusable
def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add folded into the next norm: the stream residual + x (rounded to its
    dtype, as the add alone is) and rms_norm of it."""
    s = residual + x
    h = s.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return s, (h * (1.0 + weight.float())).to(x.dtype)


@fusable
def gated_rms_norm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """The Gated DeltaNet output norm: plain weight, then ·silu(z)."""
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    h = weight * h.to(x.dtype)
    return (h * F.silu(z.float())).to(x.dtype)


@fusable
def gdn_gates(b: torch.Tensor, a: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor,
              beta_dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """β = sigmoid(b) (computed in fp32, returned in beta_dtype: what the recurrence kernel
    takes) and the log-decay g = −exp(A_log)·softplus(a + dt_bias), fp32."""
    beta = b.float().sigmoid()
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias)
    return g, beta.to(beta_dtype)


@fusable
def gdn_split_heads(conv_out: torch.Tensor, key_dim: int, num_k_heads: int, head_k_dim: int,
                    num_v_heads: int, head_v_dim: int, qk_dtype: torch.dtype = torch.float32,
                    expand: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """conv_out [..., 2·key_dim + value_dim] → q, k [..., Hv, Dk] (normalised in fp32, q
    scaled by Dk^−½, key heads repeated to the value heads; with expand False left at the
    key heads [..., Hk, Dk]; returned in qk_dtype: what the recurrence kernel takes), v
    [..., Hv, Dv]."""
    q, k, v = torch.split(conv_out, [key_dim, key_dim, num_v_heads * head_v_dim], dim=-1)
    lead = conv_out.shape[:-1]
    q = q.reshape(*lead, num_k_heads, head_k_dim).float()
    k = k.reshape(*lead, num_k_heads, head_k_dim).float()
    v = v.reshape(*lead, num_v_heads, head_v_dim)
    q = q * torch.rsqrt((q * q).sum(-1, keepdim=True) + 1e-6) * head_k_dim**-0.5
    k = k * torch.rsqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    ratio = num_v_heads // num_k_heads  # value head j reads key head j // ratio
    q, k = q.to(qk_dtype), k.to(qk_dtype)
    if not expand:
        return q, k, v
    return q.repeat_interleave(ratio, -2), k.repeat_interleave(ratio, -2), v


@fusable
def conv_split_heads(x: torch.Tensor, conv_cache: torch.Tensor, slots: torch.Tensor,
                     weight: torch.Tensor, key_dim: int, num_k_heads: int, head_k_dim: int,
                     num_v_heads: int, head_v_dim: int, qk_dtype: torch.dtype,
                     expand: bool) -> tuple[torch.Tensor, ...]:
    """The Gated DeltaNet's causal conv over S sequences of L tokens x [S, L, C]
    (gdn_torch.causal_conv_batched: K multiply-adds per output and the SiLU) from the conv
    states at `slots` of the cache, read in the same graph rather than gathered first, then
    gdn_split_heads of its output: q, k, v [S, L, H, D] and [state | x] [S, C, K-1+L]."""
    conv_out, conv_seq = gdn_torch.causal_conv_batched(x, conv_cache[slots], weight)
    q, k, v = gdn_split_heads.eager(conv_out, key_dim, num_k_heads, head_k_dim, num_v_heads,
                                    head_v_dim, qk_dtype, expand)
    return q, k, v, conv_seq


@fusable
def moe_route(router_logits: torch.Tensor, top_k: int,
              dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax in fp32 → top-k → renormalised weights (in dtype) and expert ids."""
    probs = F.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    return (weights / weights.sum(-1, keepdim=True)).to(dtype), ids


@fusable
def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU over a fused [gate | up] projection, in fp32, rounded once (as compiled and as
    the pair kernels compute it)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return (F.silu(gate.float()) * up.float()).to(gate_up.dtype)


@fusable
def weighted_slot_sum(y: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """The routed experts' outputs y [T, k, H] (each rounded to the model dtype, as a GEMM
    leaves it) weighted by their routing weights [T, k] and summed over the k slots in fp32,
    slot 0 first, rounded once: the one combine every expert kernel shares, so that the paths
    differ only where their GEMMs do. A running sum, not .sum(1): compiled, each output is one
    thread's loop whatever T is, so a token's result does not depend on its batch."""
    w = weights.float()
    out = y[:, 0].float() * w[:, :1]
    for j in range(1, y.shape[1]):
        out = out + y[:, j].float() * w[:, j : j + 1]
    return out.to(y.dtype)


@fusable
def shared_expert_combine(routed: torch.Tensor, shared: torch.Tensor,
                          gate_logit: torch.Tensor) -> torch.Tensor:
    return routed + shared * torch.sigmoid(gate_logit)


@fusable
def moe_combine(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor,
                gate_logit: torch.Tensor) -> torch.Tensor:
    """weighted_slot_sum of the routed rows y [T, k, H], then shared_expert_combine: the
    MoE's output in one compiled graph instead of two."""
    return shared_expert_combine.eager(weighted_slot_sum.eager(y, weights), shared, gate_logit)


@fusable
def moe_combine_add_rms_norm(y: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor,
                             gate_logit: torch.Tensor, residual: torch.Tensor,
                             weight: torch.Tensor, eps: float
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """moe_combine, then add_rms_norm of its output onto the stream: a layer's MoE output
    folded into the next norm, one compiled graph instead of two (TP 1, where no all-reduce
    comes between them). Eager, the bits of the two run apart."""
    return add_rms_norm.eager(moe_combine.eager(y, weights, shared, gate_logit), residual,
                              weight, eps)


@fusable
def sigmoid_gate(o: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    return o * torch.sigmoid(gate)


@fusable
def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 1, rotary_dim] fp32 for positions [T] (NeoX layout: the frequencies twice),
    computed in fp32."""
    freqs = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], -1)[:, None, :]
    return emb.cos(), emb.sin()


@fusable
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
         rotary_dim: int) -> torch.Tensor:
    """NeoX RoPE on the first rotary_dim dims of each head; x [T, heads, D], cos/sin
    [T, 1, rotary_dim] fp32."""
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat([-rot[..., half:], rot[..., :half]], dim=-1)
    out = rot * cos.to(x.dtype) + rotated * sin.to(x.dtype)
    return torch.cat([out, rest], dim=-1)


@fusable
def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor,
                 k_weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
                 rotary_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Full attention's per-head q and k norms (zero-centred RMSNorm), then RoPE on both: the
    math of rms_norm and rope, in one compiled graph instead of four."""
    q = rope.eager(rms_norm.eager(q, q_weight, eps), cos, sin, rotary_dim)
    k = rope.eager(rms_norm.eager(k, k_weight, eps), cos, sin, rotary_dim)
    return q, k

