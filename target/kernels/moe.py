"""Routed experts as two grouped GEMMs (`torch._grouped_mm`): token-expert pairs sorted by
expert, one GEMM over all groups for gate_up, one for down, the rows put back in (token,
slot) order. No Python loop over experts and no host sync (the group offsets stay on the
device), so the shapes a step sees depend only on its token count: CUDA-graph friendly. Every
path here and in moe_triton.py rounds where a GEMM does (gate/up, down output) and ends in the
same `fused.weighted_slot_sum`, so a token's routed output is the same whichever path a step's
size picks, up to the GEMMs' own summation order.

The per-expert loop in target/layers/moe.py stays the reference (and the CPU default);
tests/target/test_moe_kernel.py compares the three."""

from __future__ import annotations

import torch

from target.kernels import fused


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                    reduce: bool = True) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I];
    topk_ids / topk_weights [T, k]. Returns [T, H] in x's dtype; with reduce False each slot's
    row unweighted, [T, k, H] (the caller weights and sums them: FusedExperts)."""
    num_experts, k = gate_up.shape[0], topk_ids.shape[1]
    flat = topk_ids.flatten()  # [T·k] expert of each (token, slot) pair
    order = flat.argsort(stable=True)  # pairs grouped by expert
    token_of = order // k  # [T·k] token of each sorted pair
    # [E] pairs per expert. Not bincount: on CUDA it reads the max back to size its output.
    counts = torch.zeros(num_experts, dtype=torch.long, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    offs = counts.cumsum(0, dtype=torch.int32)  # [E] end of each expert's group
    # [E, 2I, H] → [E, H, 2I] view: the K-major operand the grouped GEMM takes as is.
    gu = torch._grouped_mm(x[token_of], gate_up.transpose(1, 2), offs=offs)  # [T·k, 2I]
    y = torch._grouped_mm(fused.silu_mul(gu), down.transpose(1, 2), offs=offs)  # [T·k, H]
    # Back to (token, slot) order (a permutation: no atomics), then the shared fp32 combine.
    y = torch.empty(y.shape, dtype=y.dtype, device=y.device).index_copy_(0, order, y)
    y = y.view(*topk_ids.shape, -1).to(x.dtype)
    return fused.weighted_slot_sum(y, topk_weights) if reduce else y


def gathered_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                     reduce: bool = True) -> torch.Tensor:
    """The same without grouped GEMMs and without a host sync: each (token, slot) pair's
    expert weights gathered, one batched matmul per projection. Moves T·k copies of an
    expert: for CUDA where torch._grouped_mm does not run (fp32 checks on small models) so
    that rounds can still be captured in CUDA graphs. Same arguments as grouped_experts."""
    tokens, k = topk_ids.shape
    flat = topk_ids.flatten()  # [T·k]
    xs = x.repeat_interleave(k, dim=0)  # [T·k, H]; pair p is token p // k
    gu = torch.bmm(gate_up[flat], xs[:, :, None])[..., 0]  # [T·k, 2I]
    y = torch.bmm(down[flat], fused.silu_mul(gu)[:, :, None])[..., 0]  # [T·k, H]
    y = y.view(tokens, k, -1).to(x.dtype)
    return fused.weighted_slot_sum(y, topk_weights) if reduce else y


def grouped_mm_available(x: torch.Tensor) -> bool:
    """CUDA needs sm90+ and bf16 for torch._grouped_mm; elsewhere keep the reference."""
    if not hasattr(torch, "_grouped_mm") or x.device.type != "cuda":
        return False
    return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device)[0] >= 9
