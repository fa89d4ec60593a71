"""The MoE router of few tokens in one Triton launch: the router's GEMV (with the shared-expert
gate's row after the experts') and the top-k of its logits, for x [T ≤ MAX_ROWS, H].

Why: at decode the router runs as a cuBLAS GEMV over its E + 1 rows (3.0 µs on an H100)
followed by moe_route.py's top-k kernel (3.2 µs), 40 layers a step, while its weight (257 ×
2048 in bf16, 1 MiB) takes 0.35 µs to read (docs/BENCHMARKS.md, fifteenth session's
profile). Both are fixed cost; one launch pays it once.

  Grid (cdiv(N, BLOCK_N), SPLITS), N = E + 1: program (c, s) multiplies the tokens (one MMA
  tile of BLOCK_M = 16 rows, rows past T masked) by weight rows c·BLOCK_N … over the s-th of
  SPLITS equal slices of H, and stores that fp32 partial tile in a workspace. It then adds
  one to a single arrival counter (acq_rel); the program that arrives last adds each
  column's SPLITS partials in split order 0, 1, …, rounds them once to x's dtype (the
  logits, as F.linear gives them, stored: their column E is the shared-expert gate), and
  takes each token's top-k of the E expert logits: the k largest, the lowest index among
  equal values first, their softmax in fp32 (the full softmax's denominator cancels in the
  renormalisation), largest first, as moe_route.py does (over a power of two ≥ T rows:
  a decode reduces one). It sets the counter back to 0.

Bits: a token's logits depend on its own row of x only, summed in a fixed order whichever
program arrives last: a decode's token and the same token in a verify block or a batch get
the same bits (cuBLAS runs a GEMV at one row and another kernel at 16). The routing of
given logits is moe_route.py's, so its weights and ids equal route_topk's on those logits.

The counter (one int32 a device, its own buffer) is zero between launches: every launch
leaves it as it found it. Launches on one device must not overlap (one stream, as the engine
runs). Triton is optional, as in moe_triton.py; on CPU tensors the kernel runs only in
Triton's interpreter (TRITON_INTERPRET=1 set before triton is first imported)."""

from __future__ import annotations

import torch

from target.kernels import pdl
from target.kernels.splitk_linear import Tile

try:
    import triton
    import triton.language as tl

    from target.kernels.splitk_linear import _partial
except ImportError:  # CPU-only installs
    triton = None

MAX_ROWS = 16  # a decode of up to 16 sequences, a verify block of 16 tokens at batch 1
DTYPES = (torch.bfloat16, torch.float16)


def tile_for(k: int) -> Tile:
    """The tile (splitk_linear's fields: block_n, block_k, splits, warps, stages) for a
    hidden size k: 16 rows a program and H in up to eight 256-wide slices (2048: 17 × 8 = 136
    programs of 8 KiB of weight each for the 35B-A3B's 257 rows), 2 stages."""
    return Tile(splits=max(1, min(8, k // 256)), stages=2)


def refusal(x: torch.Tensor, weight: torch.Tensor, experts: int, top_k: int) -> str | None:
    """Why the kernel does not take this router, or None where it does (Triton imported)."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS:
        return f"x must be [T, H] with T ≤ {MAX_ROWS}, got shape {tuple(x.shape)}"
    if x.dtype not in DTYPES or weight.dtype != x.dtype:
        return f"x and weight must share a dtype of {DTYPES}, got {x.dtype} and {weight.dtype}"
    if weight.dim() != 2 or weight.shape[1] != x.shape[1] or weight.shape[0] < experts:
        return (f"weight must be [N ≥ {experts}, H] with x's H = {x.shape[1]}, got "
                f"{tuple(weight.shape)}")
    if weight.stride(1) != 1:
        return f"weight's rows must be contiguous, got strides {weight.stride()}"
    if not 1 <= top_k <= experts:
        return f"top_k must be in [1, {experts}], got {top_k}"
    if x.device != weight.device:
        return f"x is on {x.device}, weight on {weight.device}"
    if not x.is_cuda and not _interpreted():
        return "CPU tensors run only in Triton's interpreter (TRITON_INTERPRET=1)"
    return None


def available(x: torch.Tensor, weight: torch.Tensor, experts: int, top_k: int) -> bool:
    """The kernel takes this router: Triton imports and `refusal` finds nothing."""
    return triton is not None and refusal(x, weight, experts, top_k) is None


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The device's arrival counter, zero (made on the first use: the engine's warm-up runs
    every step shape before CUDA graphs capture)."""
    counter = _COUNTERS.get(device)
    if counter is None:
        counter = _COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def router_topk(x: torch.Tensor, weight: torch.Tensor, experts: int, top_k: int,
                tile: Tile | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [T, H] · weight [N, H]ᵀ (N ≥ experts: the router's rows first, then e.g. the
    shared-expert gate's) → (logits [T, N] in x's dtype, as F.linear gives them; weights
    [T, k] in x's dtype, the softmax of each token's k largest expert logits, largest first;
    their expert ids [T, k] int64), as F.linear followed by moe_route.route_topk on
    logits[:, :experts] return them."""
    if triton is None:
        raise RuntimeError("router_topk needs triton")
    reason = refusal(x, weight, experts, top_k)
    if reason is not None:
        raise ValueError(f"router_topk: {reason}")
    tokens, k = x.shape
    n = weight.shape[0]
    logits = torch.empty(tokens, n, dtype=x.dtype, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=x.dtype, device=x.device)
    ids = torch.empty(tokens, top_k, dtype=torch.long, device=x.device)
    if tokens == 0:
        return logits, weights, ids
    tile = tile or tile_for(k)
    if tile.splits < 1 or tile.block_n < 16 or tile.block_k < 16:
        raise ValueError(f"a tile needs splits ≥ 1 and block_n, block_k ≥ 16, got {tile}")
    slice_k = triton.cdiv(triton.cdiv(k, tile.splits), tile.block_k) * tile.block_k
    partials = torch.empty(tile.splits, MAX_ROWS, n, dtype=torch.float32, device=x.device)
    tiles = triton.cdiv(n, tile.block_n)
    _router_kernel[(tiles, tile.splits)](
        x, weight, logits, weights, ids, partials, _counter(x.device), tokens, n, experts, k,
        slice_k, x.stride(0), x.stride(1), weight.stride(0),
        TOP_K=top_k, BLOCK_M=MAX_ROWS, BLOCK_N=tile.block_n, BLOCK_K=tile.block_k,
        SPLITS=tile.splits, BLOCK_E=triton.next_power_of_2(n),
        BLOCK_TK=triton.next_power_of_2(top_k), TOPK_ROWS=triton.next_power_of_2(tokens),
        num_warps=tile.warps, num_stages=tile.stages, **pdl.options(x))
    return logits, weights, ids


def _interpreted() -> bool:
    return triton is not None and not isinstance(_router_kernel, triton.runtime.JITFunction)


if triton is not None:
    from target.kernels.pdl import await_prior

    @triton.jit
    def _router_kernel(x_ptr, w_ptr, logits_ptr, weights_ptr, ids_ptr, part_ptr, count_ptr,
                       M, N, E, K, slice_k, stride_xm, stride_xk, stride_wn,
                       TOP_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, SPLITS: tl.constexpr, BLOCK_E: tl.constexpr,
                       BLOCK_TK: tl.constexpr, TOPK_ROWS: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        _partial(x_ptr, w_ptr, part_ptr, M, N, K, slice_k, stride_xm, stride_xk, stride_wn,
                 tl.program_id(0), tl.program_id(1), BLOCK_M, BLOCK_N, BLOCK_K)
        arrived = tl.atomic_add(count_ptr, 1, sem="acq_rel")
        if arrived == tl.num_programs(0) * SPLITS - 1:
            # the tokens' rows only (a power of two ≥ T: a decode's one row is not reduced
            # as sixteen); each row reduces alone, so the bits do not depend on T
            tokens = tl.arange(0, TOPK_ROWS)
            token_ok = tokens < M
            offs = tl.arange(0, BLOCK_E)
            at = tokens[:, None] * N + offs[None, :]
            ok = token_ok[:, None] & (offs < N)[None, :]
            total = tl.zeros((TOPK_ROWS, BLOCK_E), dtype=tl.float32)
            for s in tl.static_range(SPLITS):  # split order, whoever arrived last
                total += tl.load(part_ptr + s * BLOCK_M * N + at, mask=ok, other=0.0,
                                 cache_modifier=".cg")
            logits = total.to(logits_ptr.dtype.element_ty)
            tl.store(logits_ptr + at, logits, mask=ok)
            # the top-k of the rounded expert logits, moe_route.py's rule, a row per token
            vals = tl.where((offs < E)[None, :], logits.to(tl.float32), float("-inf"))
            slots = tl.arange(0, BLOCK_TK)
            top = tl.full([TOPK_ROWS, BLOCK_TK], float("-inf"), tl.float32)
            picked = tl.zeros([TOPK_ROWS, BLOCK_TK], dtype=tl.int64)
            for j in tl.static_range(TOP_K):
                best = tl.max(vals, axis=1)
                # the lowest index holding the largest value (a row of NaNs picks none:
                # E - 1 keeps the id in range)
                idx = tl.min(tl.where(vals == best[:, None], offs[None, :], BLOCK_E), axis=1)
                idx = tl.minimum(idx, E - 1)
                top = tl.where(slots[None, :] == j, best[:, None], top)
                picked = tl.where(slots[None, :] == j, idx[:, None].to(tl.int64), picked)
                vals = tl.where(offs[None, :] == idx[:, None], float("-inf"), vals)
            # softmax over the k picked (column 0 holds the largest); slots past k add 0
            e = tl.exp(top - tl.max(top, axis=1)[:, None])
            w = e / tl.sum(e, axis=1)[:, None]
            out_at = tokens[:, None] * TOP_K + slots[None, :]
            out_ok = token_ok[:, None] & (slots < TOP_K)[None, :]
            tl.store(weights_ptr + out_at, w.to(weights_ptr.dtype.element_ty), mask=out_ok)
            tl.store(ids_ptr + out_at, picked, mask=out_ok)
            tl.atomic_xchg(count_ptr, 0)
