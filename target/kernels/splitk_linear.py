"""The row-parallel projections of few rows (a decode's tokens, a verify block at batch 1)
as one Triton launch: y = x · Wᵀ for x [M ≤ MAX_ROWS, K] and W [N, K] in bf16 or fp16, K split
across programs and the split partial sums added in the same launch.

Why: the 35B-A3B's output projections (attention's o_proj and the GDN's out_proj, 2048 × 4096,
40 a decode step) are deep and narrow. cuBLAS runs them at one row as a split-K GEMM plus a
reduce kernel: two launches, 8.2 + 1.7 µs on an H100 against a copy floor of 5.6 µs
(docs/BENCHMARKS.md, fifteenth session). A kernel without split-K (one program per 16
columns over all of K: 128 programs) lost to cuBLAS on an H200 in the third session (11.0
against 9.3 µs): too few programs to keep enough loads in flight. Here:

  Grid (cdiv(N, BLOCK_N), SPLITS): program (c, s) multiplies the rows (one MMA tile of
  BLOCK_M = 16, rows past M masked) by columns c·BLOCK_N … over the s-th of SPLITS equal
  slices of K, and stores that fp32 partial tile in a workspace. It then adds one to column
  tile c's arrival counter (acq_rel); the program that arrives last adds the SPLITS partial
  tiles in split order 0, 1, …, rounds once to the output dtype, stores, and sets the
  counter back to 0 for the next launch.

Bits: the sum over a slice runs in a fixed order, and the slices are added in a fixed order
whichever program arrives last, so the result does not depend on scheduling; a row's output
depends on its own row of x only, never on M or the other rows: a decode's token, the same
token in a verify block and in a batch get the same bits (with cuBLAS, a decode and its
verify block run different kernels). The tile and split count are fixed per weight shape
(`tile_for`), so a projection's bits do not change between steps or start-ups.

The counters (one int32 per column tile, a buffer per device kept by this module) are zero
between launches: every launch leaves them as it found them. Launches on one device must not
overlap (one stream, as the engine runs), and a launch that dies midway would leave them
dirty (the process is gone then too).

It is a variant (KernelConfig.row_parallel "triton"; "auto" keeps cuBLAS): the goldens hold
with it, and whether it gains beside programmatic dependent launch (target/kernels/pdl.py) is
not yet settled (docs/BENCHMARKS.md). bench/linear_kernel.py --splitk times it per
projection, bench/engine.py --variants row_parallel=triton per step. Triton is optional, as in
moe_triton.py; on CPU tensors the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1
set before triton is first imported)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from target.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

# Row counts up to one MMA tile's rows: a decode of up to 16 sequences, a verify block of 16
# tokens at batch 1.
MAX_ROWS = 16
DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class Tile:
    """`block_n` output columns a program, `splits` slices of K (each a multiple of
    `block_k`, the K step), `warps`, `stages` (loads in flight)."""

    block_n: int = 16
    block_k: int = 256
    splits: int = 4
    warps: int = 4
    stages: int = 3

    @classmethod
    def parse(cls, text: str) -> Tile:
        """A tile from the bench's --splitk text: the fields in order, comma separated."""
        values = [int(v) for v in text.split(",")]
        if not 1 <= len(values) <= 5:
            raise ValueError(f"a tile takes 1 to 5 fields, {len(values)} given: {text!r}")
        return cls(*values)


def tile_for(n: int, k: int) -> Tile:
    """The tile of a weight [n, k]: 16 columns a program and K in four slices, so that the
    2048 × 4096 output projections give 512 programs of 1024-deep slices (four 256-wide steps,
    32 KiB of weight each); fewer slices where K is short (at least one K step each)."""
    splits = max(1, min(4, k // 256))
    return Tile(splits=splits)


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
    if x.device != weight.device:
        return f"x is on {x.device}, weight on {weight.device}"
    if not x.is_cuda and not _interpreted():
        return "CPU tensors run only in Triton's interpreter (TRITON_INTERPRET=1)"
    return None


def available(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The kernel takes this product: Triton imports and `refusal` finds nothing."""
    return triton is not None and refusal(x, weight) is None


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    """The device's arrival counters, at least `tiles` of them, zero. Grown (a new zeroed
    buffer) only on a first use or a wider weight: the engine's warm-up meets every weight
    before CUDA graphs capture."""
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < tiles:
        counters = torch.zeros(max(tiles, 1024), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters


def splitk_linear(x: torch.Tensor, weight: torch.Tensor, tile: Tile | None = None
                  ) -> torch.Tensor:
    """x [M, K] · weight [N, K]ᵀ → [M, N] in x's dtype (F.linear without bias), M ≤ MAX_ROWS;
    x of any strides, weight's rows contiguous."""
    if triton is None:
        raise RuntimeError("splitk_linear needs triton")
    reason = refusal(x, weight)
    if reason is not None:
        raise ValueError(f"splitk_linear: {reason}")
    rows, k = x.shape
    n = weight.shape[0]
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    if rows == 0 or n == 0:
        return out
    tile = tile or tile_for(n, k)
    if tile.splits < 1 or tile.block_n < 16 or tile.block_k < 16:
        raise ValueError(f"a tile needs splits ≥ 1 and block_n, block_k ≥ 16, got {tile}")
    tiles = triton.cdiv(n, tile.block_n)
    # each slice a whole number of K steps; the last may end past K (masked)
    slice_k = triton.cdiv(triton.cdiv(k, tile.splits), tile.block_k) * tile.block_k
    partials = torch.empty(tile.splits, MAX_ROWS, n, dtype=torch.float32, device=x.device)
    _splitk_kernel[(tiles, tile.splits)](
        x, weight, out, partials, _counters(x.device, tiles), rows, n, k, slice_k,
        x.stride(0), x.stride(1), weight.stride(0),
        BLOCK_M=MAX_ROWS, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k, SPLITS=tile.splits,
        num_warps=tile.warps, num_stages=tile.stages, **pdl.options(x))
    return out


def _interpreted() -> bool:
    return triton is not None and not isinstance(_splitk_kernel, triton.runtime.JITFunction)


if triton is not None:
    from target.kernels.pdl import await_prior

    @triton.jit
    def _splitk_kernel(x_ptr, w_ptr, out_ptr, part_ptr, count_ptr, M, N, K, slice_k,
                       stride_xm, stride_xk, stride_wn,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       SPLITS: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        tile = tl.program_id(0)
        split = tl.program_id(1)
        cols = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = tl.arange(0, BLOCK_M)
        start = split * slice_k
        ks = start + tl.arange(0, BLOCK_K)
        row_ok = rows < M
        col_ok = cols < N
        x_ptrs = x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xk
        w_ptrs = w_ptr + cols[None, :].to(tl.int64) * stride_wn + ks[:, None]  # [K, N] view
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        # The same trip count for every split (steps past K load nothing). Compiled for sm90
        # (tools/triton_aot.py), the loop's loads are cp.async, `stages` deep, into mma.sync.
        for k0 in range(0, slice_k, BLOCK_K):
            k_ok = ks + k0 < K
            xt = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            wt = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
            acc = tl.dot(xt, wt, acc)
            x_ptrs += BLOCK_K * stride_xk
            w_ptrs += BLOCK_K
        tile_at = rows[:, None] * N + cols[None, :]  # [BLOCK_M, BLOCK_N] of one split's plane
        ok = row_ok[:, None] & col_ok[None, :]
        tl.store(part_ptr + split * BLOCK_M * N + tile_at, acc, mask=ok)
        # Every thread's stores of the partial before the one atomic of the program (a scalar
        # atomic is one thread's); acq_rel: the partial is visible before its arrival counts,
        # and the last to arrive sees every partial stored before the others arrived (read
        # through L2, .cg, where no stale L1 line can serve them).
        tl.debug_barrier()
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLITS - 1:
            total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for s in tl.static_range(SPLITS):  # split order, whoever arrived last
                total += tl.load(part_ptr + s * BLOCK_M * N + tile_at, mask=ok, other=0.0,
                                 cache_modifier=".cg")
            tl.store(out_ptr + tile_at, total.to(out_ptr.dtype.element_ty), mask=ok)
            tl.atomic_xchg(count_ptr + tile, 0)
