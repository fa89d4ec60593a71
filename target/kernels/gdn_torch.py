"""Gated DeltaNet kernels in plain PyTorch (CPU, fp32): the recurrence token by token (one
sequence, or a batch of sequences of equal length), and its chunked form for long inputs.

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


# Tokens per chunk of the chunked form: its triangular solve and intra-chunk products are
# C×C per head; longer inputs than this take the chunked form.
CHUNK = 64


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence of `recurrent_gated_delta_rule` for one sequence (q, k [L, H, Dk], v
    [L, H, Dv], g, beta [L, H], state [H, Dk, Dv]) in chunks of CHUNK tokens: the work of a
    chunk is a few matrix products, only the state crosses from one chunk to the next.

    Within a chunk, with γ_t = exp(g_1 + … + g_t) and S₀ the state before it, the rule
    unrolls to S_t = γ_t S₀ + Σ_{j≤t} (γ_t/γ_j) k_j u_jᵀ, where the updates u solve the
    unit lower-triangular system (I + A) u = β(v − γ S₀ᵀk), A_tj = β_t (γ_t/γ_j) k_t·k_j
    (j < t). So u = U₀ − W S₀ with U₀ = T βv, W = T βγk, T = (I + A)⁻¹, and
        o_t = γ_t S₀ᵀq_t + Σ_{j≤t} (γ_t/γ_j)(q_t·k_j) u_j,   S_C = γ_C S₀ + Σ_j (γ_C/γ_j) k_j u_jᵀ.
    Everything but the state is computed for all chunks at once. fp32 throughout."""
    length, heads, dk = q.shape
    dv = v.shape[-1]
    n = -(-length // CHUNK)
    pad = n * CHUNK - length

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [L, H, ...] → [N, H, C, ...], zero-padded
        x = F.pad(x.float(), (0, 0) * (x.dim() - 2) + (0, 0, 0, pad))
        return x.view(n, CHUNK, heads, *x.shape[2:]).transpose(1, 2)

    q, k, v = chunks(q), chunks(k), chunks(v)  # [N, H, C, D]
    beta, g = chunks(beta), chunks(g)  # [N, H, C] (padding: g = β = 0 leaves S as it is)
    cum = g.cumsum(-1)  # log γ_t
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    # γ_t/γ_j where j ≤ t (exp of differences: no overflow), 0 above the diagonal
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    kk = k @ k.transpose(-1, -2)
    a = (beta[..., None] * decay * kk).tril(-1)  # strictly lower
    eye = torch.eye(CHUNK, device=q.device)
    lhs = a + eye
    u0 = torch.linalg.solve_triangular(lhs, beta[..., None] * v, upper=False,
                                       unitriangular=True)
    w = torch.linalg.solve_triangular(lhs, (beta * cum.exp())[..., None] * k, upper=False,
                                      unitriangular=True)
    qk = (q @ k.transpose(-1, -2)) * decay  # [N, H, C, C], j ≤ t
    q_gamma = q * cum.exp()[..., None]  # γ_t q_t
    k_tail = k * (cum[..., -1:] - cum).exp()[..., None]  # (γ_C/γ_j) k_j
    gamma_c = cum[..., -1].exp()[..., None, None]  # [N, H, 1, 1]
    s = state.float().clone()
    out = torch.empty(n, heads, CHUNK, dv, dtype=torch.float32, device=q.device)
    for i in range(n):
        u = u0[i] - w[i] @ s
        out[i] = q_gamma[i] @ s + qk[i] @ u
        s = gamma_c[i] * s + k_tail[i].transpose(-1, -2) @ u
    return out.transpose(1, 2).reshape(n * CHUNK, heads, dv)[:length], s
