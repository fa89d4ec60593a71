"""Dense projections of few rows (a decode's tokens, a small verify block) in one Triton
kernel: y = x · Wᵀ for x [M ≤ MAX_ROWS, K] and W [N, K] in bf16 or fp16, fp32 accumulation.

Why not cuBLAS alone: at one row cuBLAS runs the 35B-A3B's 2048 × 4096 output projections
(40 a decode step) as split-K GEMMs plus a reduce kernel, two launches at about half the
device's copy bandwidth (docs/BENCHMARKS.md). Here one program owns BLOCK_N output columns
across all of K, so there is no reduction between programs and one launch per projection;
the rows ride in one MMA tile of BLOCK_M = 16 (rows past M are masked loads, never stored).

Bits: a row's output depends on its own row of x and on the tile only, never on M or on the
other rows: a decode's token, the same token in a verify block and in a batch get the same
bits (cuBLAS picks another kernel per M, so there they differ). The tile is fixed per weight
shape (`tile_for`), so a projection's bits do not change between steps or between start-ups.

It is a variant (KernelConfig.linear "triton"; "auto" keeps cuBLAS) until it has been timed
on a GPU: bench/linear_kernel.py --tiles per projection, bench/engine.py --variants
linear=triton per step. It has run only in Triton's interpreter so far.

Triton is optional, as in moe_triton.py: without it `available` is False. On CPU tensors the
kernel runs only in Triton's interpreter (TRITON_INTERPRET=1 set before triton is first
imported)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# Row counts up to one MMA tile's rows: a decode of up to 16 sequences, a verify block of 16
# tokens at batch 1. Above it cuBLAS's GEMMs read the weight near the copy bandwidth already.
MAX_ROWS = 16
DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Tile:
    """`block_n` output columns a program, `block_k` of K a step, `warps`, `stages` (loads in
    flight)."""

    block_n: int = 16
    block_k: int = 256
    warps: int = 4
    stages: int = 4

    @classmethod
    def parse(cls, text: str) -> Tile:
        """A tile from the bench's --tiles text: the fields in order, comma separated."""
        values = [int(v) for v in text.split(",")]
        if not 1 <= len(values) <= 4:
            raise ValueError(f"a tile takes 1 to 4 fields, {len(values)} given: {text!r}")
        return cls(*values)


def tile_for(n: int, k: int) -> Tile:
    """The tile of a weight [n, k]: 16 columns a program, so that even the 2048-row output
    projections give 128 programs, about one per SM of an H100/H200; K in 256-wide steps, four
    in flight (32 KiB of weight a program)."""
    return Tile()


def refusal(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why the kernel does not take this product, or None where it does (Triton imported)."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return f"x must be [M, K] with M ≤ {MAX_ROWS}, got shape {tuple(x.shape)}"
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        return f"x and weight must share a dtype of {DTYPES}, got {x.dtype} and {weight.dtype}"
    if weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        return f"weight must be [N, K] with x's K = {x.shape[1]}, got {tuple(weight.shape)}"
    if weight.stride(1) != 1:
        return f"weight's rows must be contiguous, got strides {weight.stride()}"
    if not (x.is_cuda and weight.is_cuda) and not _interpreted():
        return "CPU tensors run only in Triton's interpreter (TRITON_INTERPRET=1)"
    return None


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel takes this product: Triton imports and `refusal` finds nothing."""
    return triton is not None and refusal(x, weight) is None


def skinny_linear(x: torch.Tensor, weight: torch.Tensor, tile: Tile | None = None
                  ) -> torch.Tensor:
    """x [M, K] · weight [N, K]ᵀ → [M, N] in x's dtype (F.linear without bias), M ≤ MAX_ROWS;
    x of any strides, weight's rows contiguous (a row view of a stacked weight is fine)."""
    if triton is None:
        raise RuntimeError("skinny_linear needs triton")
    reason = refusal(x, weight)
    if reason is not None:
        raise ValueError(f"skinny_linear: {reason}")
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    tile = tile or tile_for(n, k)
    _skinny_kernel[(triton.cdiv(n, tile.block_n),)](
        x, weight, out, rows, n, k, x.stride(0), x.stride(1), weight.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        num_warps=tile.warps, num_stages=tile.stages)
    return out


def _interpreted() -> bool:
    return triton is not None and not isinstance(_skinny_kernel, triton.runtime.JITFunction)


if triton is not None:

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, out_ptr, M, N, K, stride_xm, stride_xk, stride_wn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        """Program p: columns p·BLOCK_N … of every row, K in BLOCK_K steps from 0 up (the
        same order for every row and every M)."""
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        ks = tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [K, N] view
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = k0 + ks < K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(xt, wt, acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K
        out_ptrs = out_ptr + rows[:, None] * N + cols[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & col_ok[None, :])
