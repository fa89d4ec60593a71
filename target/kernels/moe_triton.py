"""Routed experts for few tokens (decode, small verify) as one GEMV per (token, slot) pair,
straight against its expert's weights: no sort by expert, no grouped GEMM, no host sync, so a
step's launches depend only on its token count and capture in CUDA graphs.

At T·k ≤ ~128 pairs the step is bound by reading the distinct experts' weights; a grouped GEMM
pads each expert's few rows up to an MMA tile and pays for the sort and the scatter. Here:

  1. gate_up + SwiGLU, grid (P, cdiv(I, BLOCK_N)): a program reads its pair's expert id and
     token row, BLOCK_N gate rows and the matching BLOCK_N up rows, loops over H in BLOCK_K
     chunks (fp32 accumulate) and writes h[p, n] = silu(g)·u in x's dtype: h [P, I].
  2. down, grid (P, cdiv(H, BLOCK_N)): h[p] against BLOCK_N rows of down[e], fp32 accumulate,
     times the pair's routing weight: y [P, H] in fp32, so each token's k-slot sum is rounded
     to x's dtype once (y is P·H·4 bytes, ≤ 1 MiB at 128 pairs: nothing next to the weights).
  3. out = y.view(T, k, H).sum(1): deterministic, no atomics.

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

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


@dataclass(frozen=True)
class PairBlocks:
    """Launch shape of one kernel: BLOCK_N output rows per program, BLOCK_K reduction
    elements per loop step, num_warps per program."""

    block_n: int
    block_k: int
    num_warps: int = 4


# Programs wanted per kernel: 4 per SM of an H100/H200 (132 SMs), so that every SM has
# several programs' loads in flight (the loop issues plain loads, no software pipelining).
# A fixed number, not the device's SM count: the launch shape, and with it the fp32
# summation order, is the same on every device. Unmeasured: bench/moe_kernel.py sweeps it.
_TARGET_PROGRAMS = 4 * 132
# BLOCK_N·BLOCK_K cap: a gate and an up fp32 accumulator of this size take 2·4096/128 = 64
# registers per thread at 4 warps. ptxas for sm90 (Triton 3.9, bf16): gate_up 74 registers at
# 8×256, 134 at 16×256 or 32×128 (3 programs per SM), no spills; 16-byte weight loads.
_TILE_ELEMS = 4096
# Most (token, slot) pairs FusedExperts sends here rather than to the grouped GEMMs: decode up
# to batch 32 and a 16-token verify at batch 1 and 2 (8 experts per token on Qwen3.5-35B-A3B).
# bench/moe_kernel.py on an H200 (2026-12-04, CUDA graphs, this heuristic's shapes): pairs
# 33 µs against grouped 81 at 1 token, 202 against 293 at 16, 364 against 444 at 32.
PAIR_MAX = 256


def pair_blocks(num_pairs: int, rows: int, depth: int) -> PairBlocks:
    """The launch heuristic: BLOCK_N the largest of 32, 16, 8 that still gives _TARGET_PROGRAMS
    programs (num_pairs · cdiv(rows, BLOCK_N)), BLOCK_K the widest power of two ≤ 256 within
    the tile cap and not past `depth`. Decode (8 pairs, I = 512, H = 2048): gate_up 8×256,
    8 · 64 = 512 programs; down 16×256, 8 · 128 = 1024 programs."""
    block_n = 32
    while block_n > 8 and num_pairs * -(-rows // block_n) < _TARGET_PROGRAMS:
        block_n //= 2
    block_k = min(256, _TILE_ELEMS // block_n, max(16, 1 << (depth - 1).bit_length()))
    return PairBlocks(block_n, block_k, 4)


def pair_experts_available(x: torch.Tensor) -> bool:
    """Triton is importable and x is on CUDA (the kernels accept any float dtype)."""
    return triton is not None and x.is_cuda


def pair_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                 topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 gate_up_blocks: PairBlocks | None = None,
                 down_blocks: PairBlocks | None = None) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; topk_ids
    (integer) / topk_weights [T, k]. Returns [T, H] in x's dtype. Any strides. The block
    overrides (benchmarks) replace pair_blocks' choice for each kernel."""
    if triton is None:
        raise RuntimeError("pair_experts needs triton")
    tokens, hidden = x.shape
    num_experts, two_inter, _ = gate_up.shape
    inter, k = two_inter // 2, topk_ids.shape[1]
    assert gate_up.shape == (num_experts, 2 * inter, hidden), gate_up.shape
    assert down.shape == (num_experts, hidden, inter), down.shape
    assert topk_ids.shape == topk_weights.shape == (tokens, k), (topk_ids.shape,
                                                                  topk_weights.shape)
    pairs = tokens * k
    if pairs == 0:
        return torch.zeros_like(x)
    if not x.is_cuda and not _interpreted():
        raise RuntimeError("pair_experts on CPU tensors runs in Triton's interpreter only: set "
                           "TRITON_INTERPRET=1 before anything imports triton")
    gb = gate_up_blocks or pair_blocks(pairs, inter, hidden)
    db = down_blocks or pair_blocks(pairs, hidden, inter)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]; pair p = t·k + j
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)  # [P, H]
    _gate_up_kernel[(pairs, triton.cdiv(inter, gb.block_n))](
        x, gate_up, topk_ids, h, k, inter, hidden,
        x.stride(0), x.stride(1), *gate_up.stride(), *topk_ids.stride(),
        BLOCK_N=gb.block_n, BLOCK_K=gb.block_k, num_warps=gb.num_warps)
    _down_kernel[(pairs, triton.cdiv(hidden, db.block_n))](
        h, down, topk_ids, topk_weights, y, k, hidden, inter,
        *down.stride(), *topk_ids.stride(), *topk_weights.stride(),
        BLOCK_N=db.block_n, BLOCK_K=db.block_k, num_warps=db.num_warps)
    return y.view(tokens, k, hidden).sum(1).to(x.dtype)


def _interpreted() -> bool:
    return triton is not None and not isinstance(_gate_up_kernel, triton.runtime.JITFunction)


if triton is not None:

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, ids_ptr, h_ptr, top_k, inter, hidden,
                        stride_xt, stride_xh, stride_we, stride_wn, stride_wh,
                        stride_it, stride_ik,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)
        token, slot = pair // top_k, pair % top_k
        # int64: expert · stride_we passes 2^31 elements on larger models.
        expert = tl.load(ids_ptr + token * stride_it + slot * stride_ik).to(tl.int64)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of I
        row_ok = rows < inter
        cols = tl.arange(0, BLOCK_K)
        gate = w_ptr + expert * stride_we + rows[:, None] * stride_wn  # [BLOCK_N, 1]
        up = gate + inter * stride_wn  # the matching up rows
        x_row = x_ptr + token * stride_xt
        # Elementwise accumulators, reduced once after the loop (not one reduction per step).
        acc_g = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + cols
            k_ok = kk < hidden
            xk = tl.load(x_row + kk * stride_xh, mask=k_ok, other=0.0).to(tl.float32)
            m = row_ok[:, None] & k_ok[None, :]
            off = kk[None, :] * stride_wh
            acc_g += tl.load(gate + off, mask=m, other=0.0).to(tl.float32) * xk[None, :]
            acc_u += tl.load(up + off, mask=m, other=0.0).to(tl.float32) * xk[None, :]
        g = tl.sum(acc_g, axis=1)
        u = tl.sum(acc_u, axis=1)
        h = g * tl.sigmoid(g) * u  # SwiGLU in fp32, rounded once on the store
        tl.store(h_ptr + pair * inter + rows, h.to(h_ptr.dtype.element_ty), mask=row_ok)

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, ids_ptr, wts_ptr, y_ptr, top_k, hidden, inter,
                     stride_we, stride_wn, stride_wi, stride_it, stride_ik,
                     stride_rt, stride_rk,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pair = tl.program_id(0)
        token, slot = pair // top_k, pair % top_k
        expert = tl.load(ids_ptr + token * stride_it + slot * stride_ik).to(tl.int64)
        weight = tl.load(wts_ptr + token * stride_rt + slot * stride_rk).to(tl.float32)
        rows = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of H
        row_ok = rows < hidden
        cols = tl.arange(0, BLOCK_K)
        w = w_ptr + expert * stride_we + rows[:, None] * stride_wn  # [BLOCK_N, 1]
        h_row = h_ptr + pair * inter
        acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + cols
            k_ok = kk < inter
            hk = tl.load(h_row + kk, mask=k_ok, other=0.0).to(tl.float32)
            m = row_ok[:, None] & k_ok[None, :]
            acc += tl.load(w + kk[None, :] * stride_wi, mask=m, other=0.0).to(tl.float32) \
                * hk[None, :]
        y = tl.sum(acc, axis=1) * weight
        tl.store(y_ptr + pair * hidden + rows, y, mask=row_ok)
