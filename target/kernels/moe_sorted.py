"""Routed experts with the (token, slot) pairs sorted by expert and each expert's group padded
to whole blocks of BLOCK_M rows, so that a program multiplies up to BLOCK_M of one expert's
pairs by a tile of its weights (tl.dot): each touched expert's weights are read once per block
of its pairs, not once per pair as in pair_experts (moe_triton.py), and without the sort,
scatter and per-expert tile padding of torch._grouped_mm in grouped_experts (moe.py). No host
sync and shapes that depend only on the pair count, so a step captures in a CUDA graph.

  1. align_pairs, two small kernels: the P = T·k pairs grouped by expert, each expert's group
     padded to a multiple of BLOCK_M with the sentinel P: sorted_pairs [max_blocks ·
     BLOCK_M] and block_expert [max_blocks] (-1 past the used blocks), with max_blocks =
     cdiv(P, BLOCK_M) + min(E, P), a bound: each touched expert pads less than one block.
     One program counts the pairs per expert (a histogram), lays the padded groups out (a
     cumulative sum), names each block's expert and fills the sentinel; then one program per
     1024 pairs puts each pair in its group with an atomic cursor. The order inside a group
     is the atomics' (it can change from run to run), which changes nothing: each pair's
     row of a tl.dot is computed alike in any row of any block. Two launches where the
     sort, histogram and scatter in torch took ~25.
  2. gate_up + SwiGLU, grid (max_blocks, cdiv(I, BLOCK_N)): a program gathers its block's x
     rows [BLOCK_M, BLOCK_K] and dots them with the expert's gate and up tiles [BLOCK_K,
     BLOCK_N] (transposed views of gate_up[e]) over H, fp32 accumulate; rounds g and u to x's
     dtype (where a GEMM's output would be) and writes h = silu(g)·u, computed in fp32, in
     x's dtype at each pair's own row of h [P, I] (pair order, not sorted order).
  3. down, grid (max_blocks, cdiv(H, BLOCK_N)): the block's h rows against the expert's down
     tile over I, fp32 accumulate: y [P, H] in x's dtype, again at each pair's row.
  4. fused.weighted_slot_sum(y.view(T, k, H), weights), where pair_experts and
     grouped_experts end too: the three paths agree but for their summation order.

The launch shape is one per model (sorted_blocks), never per step: a pair's row of a tl.dot
does not depend on the other rows of its block, so a token decoded alone and the same token
inside a verify block get the same bits.

Expected to beat grouped_experts from a few dozen tokens up (a 16-token verify at batch 8 is
128 tokens, 1024 pairs) and pair_experts once experts are shared by several pairs; untested
until bench/moe_kernel.py has run on a GPU. Blocks of a lone pair waste BLOCK_M - 1 rows of
MMA work, which costs nothing while the step is bound by reading the weights.

Triton is optional, as in moe_triton.py: without it align_pairs still runs,
`sorted_experts_available` is False. On CPU tensors the kernels run only in Triton's
interpreter (TRITON_INTERPRET=1 set before triton is first imported; moe_triton.py says why),
whose tl.dot multiplies bf16's raw bits: there the tiles go to fp32 first."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from target.kernels import fused, pdl
from target.kernels.moe_triton import expert_sizes

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


@dataclass(frozen=True)
class SortedBlocks:
    """Launch shape of one kernel: BLOCK_N output columns per program, BLOCK_K reduction
    elements per loop step, num_warps and pipeline stages per program (BLOCK_M is fixed)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3


# Pairs per block: tl.dot's smallest M. A lone pair still costs a whole block of MMA rows.
BLOCK_M = 16
# Not tuned: a start for H = 2048, I = 512 on an H200 until bench/moe_kernel.py has swept the
# alternatives there. gate_up holds two [BLOCK_K, BLOCK_N] weight tiles and the x tile per
# stage: 18 KiB in bf16, 72 KiB over four stages; 144 KiB in fp32, still inside the 227 KiB
# of shared memory a program may have (BLOCK_K 128 in fp32 would not be).
_BLOCK_N, _BLOCK_K, _NUM_WARPS, _NUM_STAGES = 64, 64, 4, 4


def sorted_blocks(width: int, depth: int) -> SortedBlocks:
    """The launch shape of a kernel with `width` output columns and a reduction `depth` long
    (gate_up: I and H; down: H and I): a function of the model alone, never of the step's pair
    count. Each block is the default, or the power of two ≥ 16 that covers the size where that
    is smaller (small models)."""
    def fit(size: int, block: int) -> int:
        return min(block, max(16, 1 << (size - 1).bit_length()))

    return SortedBlocks(fit(width, _BLOCK_N), fit(depth, _BLOCK_K), _NUM_WARPS, _NUM_STAGES)


def align_pairs(topk_ids: torch.Tensor, num_experts: int,
                block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """topk_ids [T, k] (integer, any strides) → sorted_pairs [max_blocks · block_m] int32
    (pair p = t·k + j, grouped by expert, each group padded with the sentinel P to whole
    blocks; the order inside a group is not fixed) and block_expert [max_blocks] int32 (each
    block's expert, -1 past the used blocks), where max_blocks = cdiv(P, block_m) + min(E, P).
    No host sync: the shapes depend on (P, E, block_m) only."""
    tokens, k = topk_ids.shape
    pairs, device = tokens * k, topk_ids.device
    max_blocks = -(-pairs // block_m) + min(num_experts, pairs)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    if pairs == 0:
        return sorted_pairs, block_expert
    block_e = triton.next_power_of_2(num_experts)
    starts = torch.empty(block_e, dtype=torch.int32, device=device)  # each group's first slot
    cursor = torch.empty(block_e, dtype=torch.int32, device=device)  # (zeroed by the first)
    _groups_kernel[(1,)](topk_ids, pairs, k, *topk_ids.stride(), starts, cursor, sorted_pairs,
                         block_expert, max_blocks, BLOCK_M=block_m, BLOCK_E=block_e,
                         CHUNK=_ALIGN_CHUNK, BLOCK_B=_ALIGN_BLOCKS, **pdl.options(topk_ids))
    _place_kernel[(triton.cdiv(pairs, _ALIGN_CHUNK),)](
        topk_ids, pairs, k, *topk_ids.stride(), starts, cursor, sorted_pairs,
        BLOCK=_ALIGN_CHUNK, **pdl.options(topk_ids))
    return sorted_pairs, block_expert


# align_pairs' tiles: pairs per program step, blocks per step of the block-expert search.
_ALIGN_CHUNK, _ALIGN_BLOCKS = 1024, 64


# The most (token, slot) pairs FusedExperts sends here; grouped GEMMs above (large prefill
# chunks). bench/moe_kernel.py on an H200 (CUDA graphs): sorted 561 against grouped
# 762 µs at 512 tokens, 776 against 908 at 1024, 980 against 1051 at 1536, behind at 2048
# (1240 against 1175) and 8192 (4370 against 3213).
SORTED_MAX = 1536 * 8


def sorted_experts_available(x: torch.Tensor) -> bool:
    """Triton is importable and x is on CUDA (fp32, fp16 and bf16)."""
    return triton is not None and x.is_cuda


def sorted_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                   topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                   gate_up_blocks: SortedBlocks | None = None,
                   down_blocks: SortedBlocks | None = None, reduce: bool = True) -> torch.Tensor:
    """x [T, H]; gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; topk_ids
    (integer) / topk_weights [T, k]. Returns [T, H] in x's dtype (reduce False: each slot's
    row, [T, k, H]). Any strides. The block overrides (benchmarks) replace sorted_blocks'
    choice for each kernel."""
    tokens, hidden, inter, k = expert_sizes("sorted_experts", _interpreted(), x, gate_up,
                                            down, topk_ids, topk_weights)
    num_experts, pairs = gate_up.shape[0], tokens * k
    if pairs == 0:
        return torch.zeros_like(x) if reduce else x.new_zeros(tokens, k, hidden)
    gb = gate_up_blocks or sorted_blocks(inter, hidden)
    db = down_blocks or sorted_blocks(hidden, inter)
    sorted_pairs, block_expert = align_pairs(topk_ids, num_experts, BLOCK_M)
    blocks = block_expert.shape[0]
    # fp32 must not drop to TF32; the interpreter's dot reads bf16 as integers (see above).
    upcast = not x.is_cuda and x.dtype == torch.bfloat16
    precision = "ieee" if x.dtype == torch.float32 or upcast else "tf32"
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)  # [P, I]; pair p = t·k + j
    y = torch.empty(pairs, hidden, dtype=x.dtype, device=x.device)  # [P, H]
    _gate_up_kernel[(blocks, triton.cdiv(inter, gb.block_n))](
        x, gate_up, sorted_pairs, block_expert, h, pairs, k, inter, hidden,
        x.stride(0), x.stride(1), *gate_up.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=gb.block_n, BLOCK_K=gb.block_k, UPCAST=upcast,
        PRECISION=precision, num_warps=gb.num_warps, num_stages=gb.num_stages, **pdl.options(x))
    _down_kernel[(blocks, triton.cdiv(hidden, db.block_n))](
        h, down, sorted_pairs, block_expert, y, pairs, hidden, inter, *down.stride(),
        BLOCK_M=BLOCK_M, BLOCK_N=db.block_n, BLOCK_K=db.block_k, UPCAST=upcast,
        PRECISION=precision, num_warps=db.num_warps, num_stages=db.num_stages, **pdl.options(h))
    y = y.view(tokens, k, hidden)
    return fused.weighted_slot_sum(y, topk_weights) if reduce else y


def _interpreted() -> bool:
    return triton is not None and not isinstance(_gate_up_kernel, triton.runtime.JITFunction)


if triton is not None:
    from target.kernels.pdl import await_prior

    @triton.jit
    def _gate_up_kernel(x_ptr, w_ptr, pairs_ptr, experts_ptr, h_ptr, num_pairs, top_k, inter,
                        hidden, stride_xt, stride_xh, stride_we, stride_wn, stride_wh,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        block = tl.program_id(0)
        # int64: expert · stride_we passes 2^31 elements on larger models.
        expert = tl.load(experts_ptr + block).to(tl.int64)
        if expert < 0:  # past the used blocks
            return
        pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
        pair_ok = pair < num_pairs  # padding holds num_pairs
        token = pair // top_k
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of I
        col_ok = cols < inter
        kk0 = tl.arange(0, BLOCK_K)
        x_rows = x_ptr + token[:, None] * stride_xt  # [BLOCK_M, 1]
        # gate[e] [I, H] read as its transpose: [BLOCK_K, BLOCK_N] tiles, H contiguous.
        gate = w_ptr + expert * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N]
        up = gate + inter * stride_wn  # the matching up rows
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            kk = k0 + kk0
            k_ok = kk < hidden
            a = tl.load(x_rows + kk[None, :] * stride_xh, mask=pair_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            m = k_ok[:, None] & col_ok[None, :]
            off = kk[:, None] * stride_wh
            bg = tl.load(gate + off, mask=m, other=0.0)  # [BLOCK_K, BLOCK_N]
            bu = tl.load(up + off, mask=m, other=0.0)
            if UPCAST:
                a, bg, bu = a.to(tl.float32), bg.to(tl.float32), bu.to(tl.float32)
            acc_g = tl.dot(a, bg, acc_g, input_precision=PRECISION)
            acc_u = tl.dot(a, bu, acc_u, input_precision=PRECISION)
        # Rounded as a GEMM's output would be, then SwiGLU in fp32, rounded once on the store.
        g = acc_g.to(h_ptr.dtype.element_ty).to(tl.float32)
        u = acc_u.to(h_ptr.dtype.element_ty).to(tl.float32)
        h = g * tl.sigmoid(g) * u
        tl.store(h_ptr + pair[:, None] * inter + cols[None, :], h.to(h_ptr.dtype.element_ty),
                 mask=pair_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _down_kernel(h_ptr, w_ptr, pairs_ptr, experts_ptr, y_ptr, num_pairs, hidden, inter,
                     stride_we, stride_wn, stride_wi,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     UPCAST: tl.constexpr, PRECISION: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        block = tl.program_id(0)
        expert = tl.load(experts_ptr + block).to(tl.int64)
        if expert < 0:
            return
        pair = tl.load(pairs_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
        pair_ok = pair < num_pairs
        cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of H
        col_ok = cols < hidden
        kk0 = tl.arange(0, BLOCK_K)
        h_rows = h_ptr + pair[:, None] * inter  # [BLOCK_M, 1]
        w = w_ptr + expert * stride_we + cols[None, :] * stride_wn  # [1, BLOCK_N]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter, BLOCK_K):
            kk = k0 + kk0
            k_ok = kk < inter
            a = tl.load(h_rows + kk[None, :], mask=pair_ok[:, None] & k_ok[None, :],
                        other=0.0)  # [BLOCK_M, BLOCK_K]
            b = tl.load(w + kk[:, None] * stride_wi, mask=k_ok[:, None] & col_ok[None, :],
                        other=0.0)  # [BLOCK_K, BLOCK_N]
            if UPCAST:
                a, b = a.to(tl.float32), b.to(tl.float32)
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        tl.store(y_ptr + pair[:, None] * hidden + cols[None, :], acc.to(y_ptr.dtype.element_ty),
                 mask=pair_ok[:, None] & col_ok[None, :])

    @triton.jit
    def _groups_kernel(ids_ptr, pairs, top_k, stride_it, stride_ik, starts_ptr, cursor_ptr,
                       sorted_ptr, block_expert_ptr, max_blocks, BLOCK_M: tl.constexpr,
                       BLOCK_E: tl.constexpr, CHUNK: tl.constexpr, BLOCK_B: tl.constexpr,
                       PDL: tl.constexpr):
        await_prior(PDL)
        # One program: pairs per expert, the padded groups' layout, each block's expert, the
        # sentinel everywhere (the second kernel writes the pairs over it), zeroed cursors.
        offs = tl.arange(0, CHUNK)
        counts = tl.zeros([BLOCK_E], dtype=tl.int32)
        for p0 in range(0, pairs, CHUNK):
            p = p0 + offs
            ok = p < pairs
            e = tl.load(ids_ptr + (p // top_k) * stride_it + (p % top_k) * stride_ik, mask=ok,
                        other=0).to(tl.int32)
            counts += tl.histogram(e, BLOCK_E, mask=ok)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)  # [BLOCK_E] each group's end
        experts = tl.arange(0, BLOCK_E)
        tl.store(starts_ptr + experts, ends - padded)
        tl.store(cursor_ptr + experts, tl.zeros([BLOCK_E], dtype=tl.int32))
        total = tl.sum(padded, axis=0)
        slots = max_blocks * BLOCK_M
        for i0 in range(0, slots, CHUNK):
            i = i0 + offs
            tl.store(sorted_ptr + i, tl.full([CHUNK], 0, tl.int32) + pairs, mask=i < slots)
        # Block b's expert: the groups that end at or before its first slot (empty groups end
        # where they start, so they are passed over); -1 past the last group.
        blocks = tl.arange(0, BLOCK_B)
        for b0 in range(0, max_blocks, BLOCK_B):
            b = b0 + blocks
            first = b * BLOCK_M
            expert = tl.sum((ends[None, :] <= first[:, None]).to(tl.int32), axis=1)
            tl.store(block_expert_ptr + b, tl.where(first < total, expert, -1),
                     mask=b < max_blocks)

    @triton.jit
    def _place_kernel(ids_ptr, pairs, top_k, stride_it, stride_ik, starts_ptr, cursor_ptr,
                      sorted_ptr, BLOCK: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        # Each pair into the next free slot of its expert's group.
        p = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = p < pairs
        e = tl.load(ids_ptr + (p // top_k) * stride_it + (p % top_k) * stride_ik, mask=ok,
                    other=0).to(tl.int32)
        rank = tl.atomic_add(cursor_ptr + e, 1, mask=ok)
        start = tl.load(starts_ptr + e, mask=ok, other=0)
        tl.store(sorted_ptr + start + rank, p.to(tl.int32), mask=ok)

