"""Gated DeltaNet kernel dispatch: fla's Triton kernels on CUDA, the torch reference elsewhere."""

from __future__ import annotations

import torch

from target.kernels import gdn_torch


def causal_conv(x, conv_state, weight):
    return gdn_torch.causal_conv(x, conv_state, weight)


def gated_delta_rule(q, k, v, g, beta, state) -> tuple[torch.Tensor, torch.Tensor]:
    if q.is_cuda and _fla() is not None:
        return _fla_recurrent(q, k, v, g, beta, state)
    return gdn_torch.recurrent_gated_delta_rule(q, k, v, g, beta, state)


def replay_state(k, v, g, beta, state) -> torch.Tensor:
    # The state update does not read q; any q gives the same final state.
    _, final = gated_delta_rule(k, k, v, g, beta, state)
    return final


_FLA = None


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
    # fla takes [B, T, H, D]; q is already scaled and L2-normalised: scale=1, no in-kernel norm.
    # g and beta must be keywords: positionally beta lands in `gk` and the output is NaN.
    o, final = fn(
        q.unsqueeze(0).to(v.dtype),
        k.unsqueeze(0).to(v.dtype),
        v.unsqueeze(0),
        g=g.unsqueeze(0),
        beta=beta.unsqueeze(0).to(v.dtype),
        scale=1.0,
        initial_state=state.unsqueeze(0).float().contiguous(),
        output_final_state=True,
    )
    return o[0], final[0]
