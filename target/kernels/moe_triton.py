"""Routed experts for few tokens (decode, small verify) as one GEMV per (token, slot) pair,
straight against its expert's weights: no sort by expert, no grouped GEMM, no host sync, so a
step's launches depend only on its token count and capture in CUDA graphs.

At T·k ≤ ~128 pairs the step is bound by reading the distinct experts' weights; a grouped GEMM
pads each expert's few rows up to an MMA tile and pays for the sort and the scatter. Here:

  1. gate_up + SwiGLU, grid (P, cdiv(I, BLOCK_N)): a program reads its pair's expert id and
     token row, BLOCK_N gate rows and the matching BLOCK_N up rows, loops over H in BLOCK_K
     chunks (fp32 accumulate), rounds g and u to x's dtype (where a GEMM's output would be)
     and writes h[p, n] = silu(g)·u, computed in fp32, in x's dtype: h [P, I].
  2. down, grid (P, cdiv(H, BLOCK_N)): h[p] against BLOCK_N rows of down[e], fp32 accumulate:
     y [P, H] in x's dtype.
  3. fused.weighted_slot_sum(y.view(T, k, H), weights): the routing weights and the sum over
     the k slots in fp32, rounded once; deterministic, no atomics. The grouped path ends in
     the same function after the same roundings, so the two agree but for summation order.

The launch shape is one per model (pair_blocks), not per step: a pair's result then does not
depend on how many pairs share the launch, so a token decoded alone and the same token inside a
verify block get the same routed output (bf16 greedy stays on the target-only path).

Two pairs routed to one expert read its rows twice; past a few hundred pairs that waste is
what grouped_experts (target/kernels/moe.py, same arguments and result) avoids.

Triton is optional: without it this module imports, defines no kernels and
`pair_experts_available` is False. On CPU tensors the kernels run only in Triton's interpreter,
and only if TRITON_INTERPRET=1 was set before triton was first imported: Triton reads it when
`@triton.jit` decorates, its own tl.zeros / tl.sum included, and torch._dynamo imports triton
early. tests/target/test_moe_triton.py therefore runs them in a child process."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from target.kernels import fused, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


@dataclass(frozen=True)
class PairBlocks:
    """Launch shape of one kernel: BLOCK_N output rows per program, BLOCK_K reduction
    elements per loop step, num_warps per program. `prefetch`: each loop step issues the next
    step's loads before its own multiply-adds (two tiles in flight per program, the same
    summation order and bits)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    prefetch: bool = False


# The launch shape: BLOCK_N 16 rows × BLOCK_K 256, 4 warps, for both kernels. In the sweep of
# bench/moe_kernel.py on an H200 (real sizes, CUDA-graph replay) it is the fastest of five
# shapes at 4, 8, 16 and 32 tokens and within 11 % of the fastest at 1 and 2, and ahead of a
# per-step choice of shape everywhere (28 against 33 µs at 1 token, 39 against 59 at 2, 194
# against 202 at 16). ptxas for sm90 (Triton 3.9, bf16): gate_up 134 registers, no
# spills; 16-byte weight loads. Prefetch keeps the bits and is faster at every token count
# from 1 to 16 (docs/BENCHMARKS.md).
_BLOCK_N, _BLOCK_K, _NUM_WARPS = 16, 256, 4
_PREFETCH = True
# The most (token, slot) pairs FusedExperts sends here rather than to the sorted-pair block
# GEMMs (target/kernels/moe_sorted.py): decode at batch 1 and 2 (8 experts per token on
# Qwen3.5-35B-A3B). bench/moe_kernel.py on an H200 (CUDA graphs, default shapes):
# pairs 70 against sorted 76 µs at 1 token and 87 against 92 at 2, even at 4 and 8, behind
# from 12 on (209 against 203; 251 against 234 at 16); bench/engine.py's decode at batch 1
# takes 4.68-4.71 ms with pairs and 4.99-5.01 with sorted (docs/BENCHMARKS.md).
PAIR_MAX = 16


def pair_blocks(depth: int) -> PairBlocks:
    """The launch shape of a kernel whose reduction is `depth` long (H for gate_up, I for
    down): a function of the model alone, never of the step's pair count (the summation
    order, and so the rounding, of a pair's result stays put). BLOCK_K is 256, or the power of
    two ≥ depth where that is shorter (small models)."""
    return PairBlocks(_BLOCK_N, min(_BLOCK_K, max(16, 1 << (depth - 1).bit_length())),
                      _NUM_WARPS, _PREFETCH)


def pair_experts_available(x: torch.Tensor) -> bool:
    """Triton is importable and x is on CUDA (the kernels accept any float dtype)."""
    return triton is not None and x.is_cuda


def expert_sizes(name: str, interpreted: bool, x: torch.Tensor, gate_up: torch.Tensor,
                 down: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
                 ) -> tuple[int, int, int, int]:
    """The checks every Triton expert path (`name`) makes of its arguments; (T, H, I, k).
    Triton must import, the shapes agree, and CPU tensors run only in the interpreter
    (`interpreted`: that module's kernels are the interpreter's)."""
    if triton is None:
        raise RuntimeError(f"{name} needs triton")
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter, k = two_inter // 2, topk_ids.shape[1]
    assert gate_up.shape == (num_experts, 2 * inter, hidden), gate_up.shape
    assert down.shape == (num_experts, hidden, inter), down.shape
    assert topk_ids.shape == topk_weights.shape == (tokens, k), (topk_ids.shape,
                                                                  topk_weights.shape)
    if tokens * k and not x.is_cuda and not interpreted:
        raise RuntimeError(f"{name} on CPU tensors runs in Triton's interpreter only: set "
                           "TRITON_INTERPRET=1 before anything imports triton")
    return tokens, hidden, inter, k


def pair_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 gate_up_blocks: PairBlocks | None = None,
                 down_blocks: PairBlocks | None = None, reduce: bool = True,
                 shared: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; topk_ids
    (integer) / topk_weights [T, k]. Returns [T, H] in x's dtype (reduce False: each slot's
    row, [T, k, H], as grouped_experts gives it). Any strides. The block overrides
    (benchmarks) replace pair_blocks' choice for each kernel.

    `shared`: a shared expert's (gate_up [2I, H], down [H, I]), strided as one expert of
    gate_up and down, run as one more slot of each token in the same two launches (no
    launches of its own): rows [T, k + 1, H], the shared expert's last, as its own GEMMs
    would round it (reduce must be False)."""
    if shared is not None:
        assert not reduce, "the shared expert's row is the caller's to combine"
        shared_gate_up, shared_down = shared
        for name, weight, routed in (("gate_up", shared_gate_up, gate_up),
                                     ("down", shared_down, down)):
            assert weight.shape == routed.shape[1:] and weight.stride() == routed.stride()[1:], (
                f"the shared {name} {tuple(weight.shape)} (strides {weight.stride()}) is not "
                f"shaped and strided as one routed expert's {tuple(routed.shape[1:])} "
                f"({routed.stride()[1:]})")
    else:  # not read (SHARED off): any pointer of the right type will do
        shared_gate_up, shared_down = gate_up, down
    tokens, hidden, inter, k = expert_sizes("pair_experts", _interpreted(), x, gate_up, down,
                                            topk_ids, topk_weights)
    slots = k + (shared is not None)
    pairs = tokens * slots
    if pairs == 0:
        return torch.zeros_like(x) if reduce else x.new_zeros(tokens, slots, hidden)
    gb = gate_up_blocks or pair_blocks(hidden)
    db = down_blocks or pair_blocks(inter)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]; p = t·slots + j
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)  # [P, H]
    _gate_up_kernel[(pairs, triton.cdiv(inter, gb.block_n))](
        x, gate_up, shared_gate_up, topk_ids, h, k, inter, hidden,
        x.stride(0), x.stride(1), *gate_up.stride(), *topk_ids.stride(),
        BLOCK_N=gb.block_n, BLOCK_K=gb.block_k, PREFETCH=gb.prefetch,
        SHARED=shared is not None, num_warps=gb.num_warps, **pdl.options(x))
    _down_kernel[(pairs, triton.cdiv(hidden, db.block_n))](
        h, down, shared_down, topk_ids, y, k, hidden, inter,
        *down.stride(), *topk_ids.stride(),
        BLOCK_N=db.block_n, BLOCK_K=db.block_k, PREFETCH=db.prefetch,
        SHARED=shared is not None, num_warps=db.num_warps, **pdl.options(h))
    y = y.view(tokens, slots, hidden)
    return fused.weighted_slot_sum(y, topk_weights) if reduce else y


def _interpreted() -> bool:
    return triton is not None and not isinstance(_gate_up_kernel, triton.runtime.JITFunction)


if triton is not None:
    from target.kernels.pdl import await_prior

    @triton.jit
    def _gate_up_tiles(x_row, gate, up, k0, cols, row_ok, hidden, stride_xh, stride_wh):
        """x's BLOCK_K elements from k0 (fp32) and the gate and up tiles beside them."""
        kk = k0 + cols
        k_ok = kk < hidden
        xk = tl.load(x_row + kk * stride_xh, mask=k_ok, other=0.0).to(tl.float32)
        m = row_ok[:, None] & k_ok[None, :]
        off = kk[None, :] * stride_wh
        return xk, tl.load(gate + off, mask=m, other=0.0), tl.load(up + off, mask=m, other=0.0)

    @triton.jit
    def _expert_weights(w_ptr, shared_ptr, ids_ptr, token, slot, top_k, stride_we,
                        stride_it, stride_ik, SHARED: tl.constexpr):
        """The weights of a pair's expert: its routed expert's, or past the k routed slots
        (SHARED) the shared expert's."""
        # int64: expert · stride_we passes 2^31 elements on larger models.
        expert = tl.load(ids_ptr + token * stride_it + slot * stride_ik, mask=slot < top_k,
                         other=0).to(tl.int64)
        w = w_ptr + expert * stride_we
        if SHARED:
            if slot == top_k:
                w = shared_ptr
        return w

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, shared_ptr, ids_ptr, h_ptr, top_k, inter, hidden,
                        stride_xt, stride_xh, stride_we, stride_wn, stride_wh,
                        stride_it, stride_ik,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                        SHARED: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        pair = tl.program_id(0)
        slots = top_k + SHARED
        token, slot = pair // slots, pair % slots
        w = _expert_weights(w_ptr, shared_ptr, ids_ptr, token, slot, top_k, stride_we,
                            stride_it, stride_ik, SHARED)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of I
        row_ok = rows < inter
        cols = tl.arange(0, BLOCK_K)
        gate = w + rows[:, None] * stride_wn  # [BLOCK_N, 1]
        up = gate + inter * stride_wn  # the matching up rows
        x_row = x_ptr + token * stride_xt
        # Elementwise accumulators, reduced once after the loop (not one reduction per step).
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PREFETCH:  # step k0 adds the tiles loaded the step before; its own loads go first
            xk, g_t, u_t = _gate_up_tiles(x_row, gate, up, 0, cols, row_ok, hidden, stride_xh,
                                          stride_wh)
            for k0 in range(BLOCK_K, hidden + BLOCK_K, BLOCK_K):  # the last loads: masked off
                x_n, g_n, u_n = _gate_up_tiles(x_row, gate, up, k0, cols, row_ok, hidden,
                                               stride_xh, stride_wh)
                acc_g += g_t.to(tl.float32) * xk[None, :]
                acc_u += u_t.to(tl.float32) * xk[None, :]
                xk, g_t, u_t = x_n, g_n, u_n
        else:
            for k0 in range(0, hidden, BLOCK_K):
                xk, g_t, u_t = _gate_up_tiles(x_row, gate, up, k0, cols, row_ok, hidden,
                                              stride_xh, stride_wh)
                acc_g += g_t.to(tl.float32) * xk[None, :]
                acc_u += u_t.to(tl.float32) * xk[None, :]
        # Rounded as a GEMM's output would be, then SwiGLU in fp32, rounded once on the store.
        g = tl.sum(acc_g, axis=1).to(h_ptr.dtype.element_ty).to(tl.float32)
        u = tl.sum(acc_u, axis=1).to(h_ptr.dtype.element_ty).to(tl.float32)
        h = g * tl.sigmoid(g) * u
        tl.store(h_ptr + pair * inter + rows, h.to(h_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _down_tiles(h_row, w, k0, cols, row_ok, inter, stride_wi):
        """h's BLOCK_K elements from k0 (fp32) and the weight tile beside them."""
        kk = k0 + cols
        k_ok = kk < inter
        hk = tl.load(h_row + kk, mask=k_ok, other=0.0).to(tl.float32)
        m = row_ok[:, None] & k_ok[None, :]
        return hk, tl.load(w + kk[None, :] * stride_wi, mask=m, other=0.0)

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, shared_ptr, ids_ptr, y_ptr, top_k, hidden, inter,
                     stride_we, stride_wn, stride_wi, stride_it, stride_ik,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PREFETCH: tl.constexpr,
                     SHARED: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        pair = tl.program_id(0)
        slots = top_k + SHARED
        token, slot = pair // slots, pair % slots
        w = _expert_weights(w_ptr, shared_ptr, ids_ptr, token, slot, top_k, stride_we,
                            stride_it, stride_ik, SHARED)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of H
        row_ok = rows < hidden
        cols = tl.arange(0, BLOCK_K)
        w = w + rows[:, None] * stride_wn  # [BLOCK_N, 1]
        h_row = h_ptr + pair * inter
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        if PREFETCH:  # as in _gate_up_kernel
            hk, w_t = _down_tiles(h_row, w, 0, cols, row_ok, inter, stride_wi)
            for k0 in range(BLOCK_K, inter + BLOCK_K, BLOCK_K):
                h_n, w_n = _down_tiles(h_row, w, k0, cols, row_ok, inter, stride_wi)
                acc += w_t.to(tl.float32) * hk[None, :]
                hk, w_t = h_n, w_n
        else:
            for k0 in range(0, inter, BLOCK_K):
                hk, w_t = _down_tiles(h_row, w, k0, cols, row_ok, inter, stride_wi)
                acc += w_t.to(tl.float32) * hk[None, :]
        y = tl.sum(acc, axis=1)
        tl.store(y_ptr + pair * hidden + rows, y.to(y_ptr.dtype.element_ty), mask=row_ok)
