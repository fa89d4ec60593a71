from __future__ import annotations

import torch
from torch import nn

from target.kernels import fused


class RotaryEmbedding(nn.Module):
    """NeoX-style RoPE on the first `rotary_dim` dims of each head (Qwen3.5 rotates 64 of 256).
    For text the three mRoPE rows carry the same position, so this is plain 1-D RoPE. It holds
    the frequencies and makes the cos/sin tables; the attention applies them together with
    its q and k norms (fused.qk_norm_rope)."""

    def __init__(self, rotary_dim: int, theta: float):
        super().__init__()
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: torch.Tensor, cache: dict | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] fp32 of the positions. With `cache` (a forward's
        `ForwardBatch.attn_meta`) they are made once per forward, by the first attention layer,
        and read by the others: every layer rotates the same positions."""
        if cache is not None and "rope" in cache:
            return cache["rope"]
        cos_sin = fused.rope_cos_sin(positions, self.inv_freq.to(positions.device))
        if cache is not None:
            cache["rope"] = cos_sin
        return cos_sin
