"""The draft's elementwise chains as fusable functions (target/kernels/fused.py's `fusable`:
each compiled into one graph for CUDA tensors whenever the target's are, eager elsewhere):
Qwen3's RMSNorm (plain weight) alone and with the residual add folded in, a head norm with
RoPE, SwiGLU in the model dtype, the RoPE tables. Eager each is exactly the math of
dflash's DFlashDraftModel (tests/draft compare against it); compiled, the draft's proposal
runs a few kernels per layer instead of dozens of elementwise ones."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from draft import attention
from target.kernels.fused import fusable


@fusable
def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Qwen3's RMSNorm: statistics in fp32, then the plain weight in x's dtype."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


@fusable
def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor, eps: float
                 ) -> tuple[Tensor, Tensor]:
    """The residual add folded into the next norm: residual + x, and rms_norm of it."""
    s = residual + x
    return s, rms_norm.eager(s, weight, eps)


@fusable
def norm_rope(x: Tensor, weight: Tensor, eps: float, cos: Tensor, sin: Tensor) -> Tensor:
    """A head's q or k norm, then RoPE (x [..., heads, D]; cos/sin [..., D])."""
    return attention.apply_rope(rms_norm.eager(x, weight, eps), cos, sin)


@fusable
def silu_mul(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU as the draft computes it: in the model dtype."""
    return F.silu(gate) * up


@fusable
def rope_cos_sin(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype
                 ) -> tuple[Tensor, Tensor]:
    """attention.rope_cos_sin with positions first (the tensor fusable dispatches on)."""
    return attention.rope_cos_sin(inv_freq, positions, dtype)
