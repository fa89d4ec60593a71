"""Reference Gated DeltaNet kernels in plain PyTorch (CPU, fp32), one sequence at a time.

Shapes: L tokens, C conv channels, K conv kernel, H value heads, Dk/Dv head dims.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def causal_conv(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [L, C] pre-conv inputs, conv_state [C, K-1] the previous inputs, weight [C, K].
    Returns silu(conv) [L, C] and the new state (last K-1 inputs of [state | x])."""
    seq = torch.cat([conv_state.to(x.dtype), x.t()], dim=-1)  # [C, K-1+L]
    out = F.conv1d(seq.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]  # [C, L]
    return F.silu(out.t()), seq[:, seq.shape[1] - conv_state.shape[1] :]


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [L, H, Dk] (already L2-normalised, q scaled, key heads expanded to H);
    v [L, H, Dv]; g, beta [L, H] fp32; state [H, Dk, Dv] fp32 (not modified).
    Per token: S = e^g·S;  S += k ⊗ β(v − Sᵀk);  o = Sᵀq.  Returns o [L, H, Dv], final S."""
    s = state.float().clone()
    q, k, v = q.float(), k.float(), v.float()
    out = torch.empty_like(v)
    for t in range(q.shape[0]):
        s = s * g[t].exp()[:, None, None]
        kv_mem = torch.einsum("hkv,hk->hv", s, k[t])
        delta = (v[t] - kv_mem) * beta[t][:, None]
        s = s + k[t][:, :, None] * delta[:, None, :]
        out[t] = torch.einsum("hkv,hk->hv", s, q[t])
    return out, s
