from __future__ import annotations

import torch
from torch import nn

from target.kernels import fused


class RotaryEmbedding(nn.Module):
    """NeoX-style RoPE on the first `rotary_dim` dims of each head (Qwen3.5 rotates 64 of 256).
    For text the three mRoPE rows carry the same position, so this is plain 1-D RoPE."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # positions [T]; each x [T, heads, head_dim]
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]
        cos = torch.cat([freqs.cos(), freqs.cos()], -1)[:, None, :]  # [T, 1, rotary_dim]
        sin = torch.cat([freqs.sin(), freqs.sin()], -1)[:, None, :]
        return tuple(self._apply(x, cos, sin) for x in xs)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return fused.rope(x, cos, sin, self.rotary_dim)
