"""Dense projections of few rows (decode, a small verify) as one Triton kernel: y = x @ w.T
for x [M, K] with M ≤ SMALL_LINEAR_MAX_ROWS, w [N, K]. Opt-in (target/layers/linear.py
`dense(kernel="small")`, `bench/engine.py --dense small`); the engine uses F.linear.

Why it exists, and why it is not the default. The profile of a batch-1 decode step on the H200
put ~2 ms in cuBLAS for ~2.8 GB of per-layer dense weights, about a third of the bandwidth.
bench/linear_kernel.py (2026-12-04, docs/BENCHMARKS.md) then showed that cuBLAS reads the large
projections at 73–80 % of the copy bandwidth even at one row. The rest is the sum of many
small, latency-bound GEMMs (router, k/v, the shared expert: 4–6 µs each), plus one poor pick
(the shared expert's 1024 × 2048 gate_up: 12.7 µs at one row against 5.8 µs at 16). This
kernel's best shapes win on some of these and lose on the large ones, so no single launch shape
beats F.linear over a whole step. It stays for measurement and for per-shape tuning later.

Grid (cdiv(N, BLOCK_N),): a program owns BLOCK_N rows of w and loops over K in BLOCK_K chunks
(masked tails), loading each [BLOCK_N, BLOCK_K] tile of w once and applying it to every row of
x, into an fp32 accumulator [16, BLOCK_N]. The M valid rows are rounded once to x's dtype on
the store. Two reductions (LinearBlocks.mma):

  - MMA (default): tl.dot(x_tile [16, BLOCK_K], w_tileᵀ), with x padded to 16 rows of zeros.
    Tensor cores, the same cost at any M. On the H200 a row's bits do not depend on its
    position or on the other rows (the GPU test). Triton's interpreter computes tl.dot with
    numpy's BLAS, which groups rows, so there a row's fp32 bits change with its position.
  - per row: for r < M, tl.sum(w_tile · x[r], axis=1), the same instructions for every row.
    Position-independent by construction, and the CPU tests' check of that property. It costs
    M·BLOCK_N·BLOCK_K FMAs per tile on the CUDA cores: at 16 rows it ran 5–10× slower than
    MMA on the H200.

The launch shape is a function of the weight's shape alone (linear_blocks), never of M, and
the row count is not a compile-time specialization. Every M runs the same binary, and a row's
summation order does not depend on the other rows. Its bits are therefore the same computed
alone or among up to 15 others, so a token decoded alone and the same token inside a 16-token
verify block get the same projection.

Triton is optional: without it this module imports, defines no kernel and
`small_linear_available` is False. On CPU tensors the kernel runs only in Triton's
interpreter, and only if TRITON_INTERPRET=1 was set before triton was first imported (see
target/kernels/moe_triton.py); tests/target/test_linear_triton.py runs it in a child process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

SMALL_LINEAR_MAX_ROWS = 16  # the x block's rows, padded: tl.dot's smallest M


@dataclass(frozen=True)
class LinearBlocks:
    """Launch shape: BLOCK_N weight rows (outputs) per program, BLOCK_K reduction elements per
    loop step, num_warps per program, num_stages of software pipelining over K; mma: reduce
    with tl.dot on a 16-row x block instead of one tl.sum per row (module docstring)."""

    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    mma: bool = False


def linear_blocks(n: int, k: int) -> LinearBlocks:
    """The launch shape for a weight [n, k]: a function of the weight alone, never of the row
    count (the summation order, and so the rounding, of a row's result stays put). MMA, 16 ×
    256, 4 warps, 3 stages: of the 11 shapes bench/linear_kernel.py swept on the H200 it was
    the one closest to F.linear across every projection of Qwen3.5-35B-A3B and every row count
    1–16. BLOCK_K is the power of two ≥ k where that is shorter (small models), at least 16
    (tl.dot's smallest K)."""
    return LinearBlocks(16, min(256, max(16, 1 << (k - 1).bit_length())), 4, 3, mma=True)


def small_linear_available(x: torch.Tensor) -> bool:
    """Triton is importable and x is on CUDA."""
    return triton is not None and x.is_cuda


def small_linear(x: torch.Tensor, w: torch.Tensor, *,
                 blocks: LinearBlocks | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K].T → [M, N] in x's dtype, for 1 ≤ M ≤ SMALL_LINEAR_MAX_ROWS; any
    strides; fp32 accumulation rounded once. `blocks` (benchmarks, tests) replaces
    linear_blocks' choice."""
    if triton is None:
        raise RuntimeError("small_linear needs triton")
    rows, k = x.shape
    n = w.shape[0]
    if w.shape != (n, k):
        raise ValueError(f"x {tuple(x.shape)} and w {tuple(w.shape)} do not share K")
    if w.dtype != x.dtype:
        raise ValueError(f"x is {x.dtype} but w is {w.dtype}: cast one")
    if rows > SMALL_LINEAR_MAX_ROWS:
        raise ValueError(f"small_linear takes at most {SMALL_LINEAR_MAX_ROWS} rows, got {rows} "
                         "rows: use F.linear")
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)  # [M, N]
    if rows == 0 or n == 0:
        return y
    if not x.is_cuda and not _interpreted():
        raise RuntimeError("small_linear on CPU tensors runs in Triton's interpreter only: set "
                           "TRITON_INTERPRET=1 before anything imports triton")
    b = blocks or linear_blocks(n, k)
    # fp32 operands: IEEE products, not TF32 (16-bit operands are exact in any precision).
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    _small_linear_kernel[(triton.cdiv(n, b.block_n),)](
        x, w, y, rows, n, k, *x.stride(), *w.stride(),
        BLOCK_M=SMALL_LINEAR_MAX_ROWS, BLOCK_N=b.block_n, BLOCK_K=b.block_k,
        MMA=b.mma, PRECISION=precision, num_warps=b.num_warps, num_stages=b.num_stages)
    return y


def _interpreted() -> bool:
    return triton is not None and not isinstance(_small_linear_kernel, triton.runtime.JITFunction)


if triton is not None:

    # `rows` is not specialized (Triton would compile M == 1 apart): one binary for every M.
    @triton.jit(do_not_specialize=["rows"])
    def _small_linear_kernel(x_ptr, w_ptr, y_ptr, rows, n, k,
                             stride_xm, stride_xk, stride_wn, stride_wk,
                             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_K: tl.constexpr, MMA: tl.constexpr, PRECISION: tl.constexpr):
        m = tl.arange(0, BLOCK_M)  # [BLOCK_M] rows of x, those ≥ rows padding
        cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] of N
        m_ok = m < rows
        n_ok = cols < n
        kk = tl.arange(0, BLOCK_K)
        # int64: row · stride_wn passes 2^31 elements on vocabulary-sized weights.
        w_rows = w_ptr + cols[:, None].to(tl.int64) * stride_wn  # [BLOCK_N, 1]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, k, BLOCK_K):
            ks = k0 + kk
            k_ok = ks < k
            wt = tl.load(w_rows + ks[None, :] * stride_wk, mask=n_ok[:, None] & k_ok[None, :],
                         other=0.0)  # [BLOCK_N, BLOCK_K]
            if MMA:
                xt = tl.load(x_ptr + m[:, None] * stride_xm + ks[None, :] * stride_xk,
                             mask=m_ok[:, None] & k_ok[None, :], other=0.0)  # [BM, BK]
                acc = tl.dot(xt, tl.trans(wt), acc, input_precision=PRECISION)
            else:
                # The same instructions for every row, wherever it sits in x: a row's bits
                # cannot depend on the others.
                wf = wt.to(tl.float32)
                for r in range(0, rows):
                    xr = tl.load(x_ptr + r * stride_xm + ks * stride_xk, mask=k_ok, other=0.0)
                    part = tl.sum(wf * xr.to(tl.float32)[None, :], axis=1)  # [BLOCK_N]
                    acc = tl.where(m[:, None] == r, acc + part[None, :], acc)
        y_ptrs = y_ptr + m[:, None] * n + cols[None, :]  # y is contiguous [rows, n]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
