"""The MoE router's top-k in one Triton kernel: softmax → top-k → renormalise, which is the
softmax of the k largest logits (the full softmax's denominator cancels in the
renormalisation). One program per token holds the token's E logits, picks the k largest
one by one (the lowest index among equal values first) and writes their weights in
descending order with their expert ids.

It replaces `fused.moe_route` on CUDA when KernelConfig.moe_routing is "triton" or "auto"
(the default). Compiled, that function still leaves torch.topk's own kernels beside the
softmax's: in the H200 decode profile (docs/BENCHMARKS.md) routing took ~0.4 ms of a 6 ms
step over 40 layers, 4–5 launches of 1–6 µs per layer. Against it, this kernel is faster
at the decode at batch 1 and 8 and at the batch-1 verify on an H200 (docs/BENCHMARKS.md,
Decisions).

Each token's result depends on its own row only, so a token alone and inside a batch get the
same bits. Against fused.moe_route the weights agree to fp32 rounding (the sums run in
another order) and the ids equal torch.topk's wherever the logits have no ties.

Triton is optional, as in moe_triton.py: without it `route_topk_available` is False. On CPU
tensors the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1 set before triton
is first imported; moe_triton.py says why)."""

from __future__ import annotations

import torch

from target.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def route_topk_available(x: torch.Tensor) -> bool:
    """Triton is importable and x is on CUDA."""
    return triton is not None and x.is_cuda


def route_topk(logits: torch.Tensor, top_k: int,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (any float dtype, any strides) → weights [T, k] in dtype (the softmax of
    the k largest logits, in fp32, largest first) and their expert ids [T, k] (int64), as
    fused.moe_route returns them."""
    if triton is None:
        raise RuntimeError("route_topk needs triton")
    tokens, experts = logits.shape
    if not 1 <= top_k <= experts:
        raise ValueError(f"top_k must be in [1, {experts}], got {top_k}")
    weights = torch.empty(tokens, top_k, dtype=dtype, device=logits.device)
    ids = torch.empty(tokens, top_k, dtype=torch.long, device=logits.device)
    if tokens == 0:
        return weights, ids
    if not logits.is_cuda and not _interpreted():
        raise RuntimeError("route_topk on CPU tensors runs in Triton's interpreter only: set "
                           "TRITON_INTERPRET=1 before anything imports triton")
    _route_kernel[(tokens,)](
        logits, weights, ids, experts, logits.stride(0), logits.stride(1), TOP_K=top_k,
        BLOCK_E=triton.next_power_of_2(experts), BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4 if experts > 128 else 1, **pdl.options(logits))
    return weights, ids


def _interpreted() -> bool:
    return triton is not None and not isinstance(_route_kernel, triton.runtime.JITFunction)


if triton is not None:
    from target.kernels.pdl import await_prior

    @triton.jit
    def _route_kernel(logits_ptr, weights_ptr, ids_ptr, experts, stride_t, stride_e,
                      TOP_K: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                      PDL: tl.constexpr):
        await_prior(PDL)
        token = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, BLOCK_E)
        vals = tl.load(logits_ptr + token * stride_t + offs * stride_e, mask=offs < experts,
                       other=float("-inf")).to(tl.float32)
        slots = tl.arange(0, BLOCK_K)
        top = tl.full([BLOCK_K], float("-inf"), tl.float32)
        picked = tl.zeros([BLOCK_K], dtype=tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(vals, axis=0)
            # the lowest index holding the largest value
            idx = tl.min(tl.where(vals == best, offs, BLOCK_E), axis=0)
            top = tl.where(slots == j, best, top)
            picked = tl.where(slots == j, idx.to(tl.int64), picked)
            vals = tl.where(offs == idx, float("-inf"), vals)
        # softmax over the k picked (top[0] is their largest); slots past k add exp(-inf) = 0
        e = tl.exp(top - tl.max(top, axis=0))
        w = e / tl.sum(e, axis=0)
        ok = slots < TOP_K
        tl.store(weights_ptr + token * TOP_K + slots, w.to(weights_ptr.dtype.element_ty),
                 mask=ok)
        tl.store(ids_ptr + token * TOP_K + slots, picked, mask=ok)
