"""Gated DeltaNet kernel dispatch: fla's Triton kernels on CUDA, the torch forms elsewhere."""

from __future__ import annotations

import torch

from target.kernels import gdn_torch


def causal_conv(x, conv_state, weight):
    return gdn_torch.causal_conv(x, conv_state, weight)


def gated_delta_rule(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence: q, k [L, H, Dk], v [L, H, Dv], g, beta [L, H], state [H, Dk, Dv]. Long
    inputs (prefill) take the chunked form, short ones (replays, small chunks) the recurrence."""
    if q.is_cuda and _fla() is not None:
        return _fla_recurrent(q, k, v, g, beta, state)
    if q.shape[0] > gdn_torch.CHUNK:
        return gdn_torch.chunk_gated_delta_rule(q, k, v, g, beta, state)
    return gdn_torch.recurrent_gated_delta_rule(q, k, v, g, beta, state)


def gated_delta_rule_many(inputs: list[tuple[torch.Tensor, ...]]
                          ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """gated_delta_rule for each of several sequences, inputs (q, k, v, g, beta, state) each;
    [(o, final state)] in order. Off fla, sequences of one length short enough for the
    token-by-token recurrence run it together (a batch of many short prompts: one loop over
    their tokens, not one per prompt); the results are the same, bit for bit."""
    out: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(inputs)
    groups: dict[int, list[int]] = {}
    for i, (q, *_) in enumerate(inputs):
        if q.is_cuda and _fla() is not None or q.shape[0] > gdn_torch.CHUNK:
            out[i] = gated_delta_rule(*inputs[i])
        else:
            groups.setdefault(q.shape[0], []).append(i)
    for idx in groups.values():
        if len(idx) == 1:
            out[idx[0]] = gated_delta_rule(*inputs[idx[0]])
            continue
        o, final = gdn_torch.recurrent_gated_delta_rule(
            *(torch.stack([inputs[i][j] for i in idx]) for j in range(6)))
        for n, i in enumerate(idx):
            out[i] = (o[n], final[n])
    return out


def recurrence_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype q, k and β reach the recurrence in: the model's on fla (it takes them so),
    fp32 for the torch reference."""
    return x.dtype if x.is_cuda and _fla() is not None else torch.float32


def gated_delta_rule_batched(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    """S sequences of the same L tokens at once: q, k, v [S, L, H, D]; g, beta [S, L, H];
    state [S, H, Dk, Dv]. One fla call on CUDA instead of one per sequence."""
    if q.is_cuda and _fla() is not None:
        return _fla_call(_fla()[1], q, k, v, g, beta, state)
    return gdn_torch.recurrent_gated_delta_rule(q, k, v, g, beta, state)


def replay_state(k, v, g, beta, state) -> torch.Tensor:
    # The state update does not read q; any q gives the same final state.
    _, final = gated_delta_rule(k, k, v, g, beta, state)
    return final


_FLA = None


def has_fla() -> bool:
    """fla's Gated DeltaNet kernels import here (they run on CUDA tensors only)."""
    return _fla() is not None


def _fla():
    global _FLA
    if _FLA is None:
        try:
            from fla.ops.gated_delta_rule import (
                chunk_gated_delta_rule,
                fused_recurrent_gated_delta_rule,
            )
            _FLA = (chunk_gated_delta_rule, fused_recurrent_gated_delta_rule)
        except ImportError:
            _FLA = False
    return _FLA or None


def _fla_recurrent(q, k, v, g, beta, state):
    chunk, recurrent = _fla()
    fn = chunk if q.shape[0] > 64 else recurrent
    o, final = _fla_call(fn, q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0),
                         beta.unsqueeze(0), state.unsqueeze(0))
    return o[0], final[0]


def _fla_call(fn, q, k, v, g, beta, state):
    # fla takes [B, T, H, D]; q is already scaled and L2-normalised: scale=1, no in-kernel norm.
    # g and beta must be keywords: positionally beta lands in `gk` and the output is NaN.
    return fn(q.to(v.dtype), k.to(v.dtype), v, g=g, beta=beta.to(v.dtype), scale=1.0,
              initial_state=state.float().contiguous(), output_final_state=True)
