"""Reference Gated DeltaNet kernels in plain PyTorch (CPU, fp32): one sequence, or a batch of
sequences of equal length.

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


def causal_conv_batched(
    x: torch.Tensor, conv_state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """causal_conv for S sequences of L tokens: x [S, L, C], conv_state [S, C, K-1].
    Returns silu(conv) [S, L, C] and [state | x] [S, C, K-1+L] (the caller slices new states
    from it: all L inputs for a prefill, the accepted prefix for a verify)."""
    seq = torch.cat([conv_state.to(x.dtype), x.transpose(1, 2)], dim=-1)  # [S, C, K-1+L]
    # K multiply-adds per output in fp32, not F.conv1d: cuDNN's convolution is kept out of the
    # captured rounds (a batch-32 round failed to capture on the H200 right before this layer's
    # first kernel after it; cuDNN picks plans per shape and alignment).
    windows = seq.unfold(-1, weight.shape[1], 1)  # [S, C, L, K]
    out = (windows.float() * weight.float()[:, None, :]).sum(-1).to(x.dtype)  # [S, C, L]
    return F.silu(out.transpose(1, 2)), seq


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k [..., L, H, Dk] (already L2-normalised, q scaled, key heads expanded to H);
    v [..., L, H, Dv]; g, beta [..., L, H] fp32; state [..., H, Dk, Dv] fp32 (not modified);
    leading dims (a batch of sequences) optional.
    Per token: S = e^g·S;  S += k ⊗ β(v − Sᵀk);  o = Sᵀq.  Returns o [..., L, H, Dv], final S.
    A token with g = β = 0 leaves S exactly as it was (the masked replay relies on it)."""
    s = state.float().clone()
    q, k, v = q.float(), k.float(), v.float()
    out = torch.empty_like(v)
    for t in range(q.shape[-3]):
        s = s * g[..., t, :].exp()[..., None, None]
        kv_mem = torch.einsum("...hkv,...hk->...hv", s, k[..., t, :, :])
        delta = (v[..., t, :, :] - kv_mem) * beta[..., t, :, None]
        s = s + k[..., t, :, :, None] * delta[..., None, :]
        out[..., t, :, :] = torch.einsum("...hkv,...hk->...hv", s, q[..., t, :, :])
    return out, s
