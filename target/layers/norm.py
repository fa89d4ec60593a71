from __future__ import annotations

import torch
from torch import nn

from target.kernels import fused
from target.layers.moe import MoEOutput
from target.weights import WeightSource, copy_into, expect_shape


def _replicated_loader(param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
    expect_shape(src, tuple(param.shape))
    copy_into(param.data, src.read(), src)


class RMSNorm(nn.Module):
    """Qwen3.5's zero-centred RMSNorm: x·rsqrt(mean x²+eps)·(1+w), computed in fp32."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim, dtype=dtype), False)
        self.weight.weight_loader = _replicated_loader

    def forward(self, x: torch.Tensor | MoEOutput, residual: torch.Tensor | None = None
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x); with `residual`: the stream residual + x and its norm, in one kernel, x's
        combine too where x is a MoE layer's uncombined output."""
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps)
        if isinstance(x, MoEOutput):
            return fused.moe_combine_add_rms_norm(*x, residual, self.weight, self.eps)
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


class GatedRMSNorm(nn.Module):
    """The Gated DeltaNet output norm: plain weight (not zero-centred), then ·silu(z)."""

    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype), False)
        self.weight.weight_loader = _replicated_loader

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return fused.gated_rms_norm(x, z, self.weight, self.eps)
