"""Routed-expert kernels at decode / verify token counts: the pair GEMVs
(target/kernels/moe_triton.py) and the sorted-pair block GEMMs (target/kernels/moe_sorted.py),
each at its default launch shape and a few overrides, against the grouped GEMMs
(target/kernels/moe.py), as µs per call, bytes of distinct expert weights read and the GB/s
that makes, next to a device copy's bandwidth measured in the same run. Up to 128 tokens: a
16-token verify at batch 8, where grouped runs today.

    python -m bench.moe_kernel --device cuda --out moe_kernel.json
    python -m bench.moe_kernel --device cpu --small   # smoke check (Triton interpreter)

Real sizes: H = 2048, I = 512, E = 256, k = 8, bf16; each token routed to k distinct random
experts. A sample runs one call per routing of a pool of POOL routings (its own x, ids and
weights each), so that consecutive calls read mostly different experts and the L2 (50 MB,
about 8 experts) does not serve them; µs = sample / POOL, median over --iters samples.
`graph_us` replays the pool's calls captured in one CUDA graph (how the engine runs a step:
device time, inter-kernel gaps included); `eager_us` launches them from Python (host launch
cost included: the kernels are shorter than their launches). Each call is what the MoE layer
runs of it: the kernels up to each slot's row (reduce=False). The weighted sum over the slots
is left out: the layer compiles it with the shared expert's add (fused.moe_combine), where
eager here it would be ~25 one-slot launches, the same for every method."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable

import torch

from bench.timing import graphed, median_p90, sample_times

REAL = dict(hidden=2048, inter=512, experts=256, k=8, tokens=[1, 2, 4, 8, 16, 32, 64, 128])
SMALL = dict(hidden=64, inter=32, experts=16, k=4, tokens=[1, 2])
# (gate_up, down) block overrides as (BLOCK_N, BLOCK_K, num_warps[, prefetch]); None: the
# heuristic. The prefetching shapes keep two loop steps' loads in flight per program.
CONFIGS = [None, ((8, 256, 4), (16, 256, 4)), ((16, 256, 4), (16, 256, 4)),
           ((32, 128, 4), (32, 128, 4)), ((8, 512, 4), (8, 512, 4)),
           ((16, 256, 8), (32, 256, 8)), ((16, 256, 4, True), (16, 256, 4, True)),
           ((8, 256, 4, True), (8, 256, 4, True)), ((16, 128, 4, True), (16, 128, 4, True))]
# The same for the sorted-pair kernels, as (BLOCK_N, BLOCK_K, num_warps, num_stages).
# (BLOCK_N 16 and 32: more programs at decode, where 8 pairs give only 9 blocks.)
SORTED_CONFIGS = [None, ((16, 128, 4, 3), (16, 128, 4, 3)), ((32, 64, 4, 4), (32, 64, 4, 4)),
                  ((64, 128, 4, 3), (64, 128, 4, 3)), ((128, 64, 8, 3), (128, 128, 8, 3))]
POOL = 16


def make_calls(fn: Callable, pool: list[tuple], gate_up: torch.Tensor,
               down: torch.Tensor, **kw) -> list[Callable[[], torch.Tensor]]:
    return [lambda p=p: fn(p[0], gate_up, down, p[1], p[2], reduce=False, **kw) for p in pool]


def time_calls(calls: list[Callable], device: torch.device, iters: int) -> dict[str, float]:
    """Median µs per call, eager and (CUDA) from one graph of all calls."""
    from bench.floors import sync  # late: see main

    def run_all():
        for call in calls:
            call()

    warmup = 3 if device.type == "cuda" else 1
    per_call = lambda fn: median_p90(sample_times(fn, iters, warmup, lambda: sync(device))[0],
                                     "us", 2)["median_us"] / len(calls)
    row = {"eager_us": round(per_call(run_all), 2)}
    if device.type == "cuda":
        row["graph_us"] = round(per_call(graphed(calls)), 2)
    return row


def bench_tokens(tokens: int, sizes: dict, weights: tuple, device: torch.device,
                 dtype: torch.dtype, iters: int, pool_size: int,
                 kinds: tuple[str, ...] = ("pair", "sorted", "grouped"),
                 default_shapes: bool = False) -> list[dict]:
    from target.kernels import fused
    from target.kernels.moe import grouped_experts, grouped_mm_available
    from target.kernels.moe_sorted import SortedBlocks, sorted_experts
    from target.kernels.moe_triton import PairBlocks, pair_experts

    hidden, inter, experts, k = (sizes[n] for n in ("hidden", "inter", "experts", "k"))
    gate_up, down = weights
    g = torch.Generator().manual_seed(tokens)
    pool = []
    for _ in range(pool_size):
        ids = torch.stack([torch.randperm(experts, generator=g)[:k] for _ in range(tokens)])
        w = torch.rand(tokens, k, generator=g)
        x = torch.randn(tokens, hidden, generator=g)
        pool.append((x.to(device, dtype), ids.to(device), (w / w.sum(-1, True)).to(device, dtype)))
    distinct = sum(p[1].unique().numel() for p in pool) / pool_size
    nbytes = distinct * 3 * inter * hidden * gate_up.element_size()

    methods = []
    configs = [None] if default_shapes else CONFIGS
    sorted_configs = [None] if default_shapes else SORTED_CONFIGS
    for cfg in configs if "pair" in kinds else []:
        kw = {} if cfg is None else dict(gate_up_blocks=PairBlocks(*cfg[0]),
                                         down_blocks=PairBlocks(*cfg[1]))
        name = "auto" if cfg is None else "/".join(
            "x".join(map(str, c[:3])) + ("p" if c[3:] == (True,) else "") for c in cfg)
        methods.append(("pair", name, make_calls(pair_experts, pool, gate_up, down, **kw)))
    for cfg in sorted_configs if "sorted" in kinds else []:
        kw = {} if cfg is None else dict(gate_up_blocks=SortedBlocks(*cfg[0]),
                                         down_blocks=SortedBlocks(*cfg[1]))
        name = "auto" if cfg is None else "/".join("x".join(map(str, c)) for c in cfg)
        methods.append(("sorted", name, make_calls(sorted_experts, pool, gate_up, down, **kw)))
    if "grouped" in kinds and (grouped_mm_available(pool[0][0]) or device.type == "cpu"):
        methods.append(("grouped", "-", make_calls(grouped_experts, pool, gate_up, down)))

    def combined(calls):  # the first routing's output, reduced over the slots
        return fused.weighted_slot_sum(calls[0](), pool[0][2]).double()

    want = combined(methods[-1][2])  # grouped where it runs, else the last sorted config
    rows = []
    for method, config, calls in methods:
        err = ((combined(calls) - want).norm() / want.norm()).item()
        row = {"tokens": tokens, "method": method, "config": config,
               "distinct_experts": distinct, "mb": round(nbytes / 1e6, 1),
               "rel_err": float(f"{err:.2e}"), **time_calls(calls, device, iters)}
        us = row.get("graph_us", row["eager_us"])
        row["gb_s"] = round(nbytes / us / 1e3, 1)
        rows.append(row)
    return rows


def table(rows: list[dict], copy_gb_s: float) -> str:
    lines = [f"device copy: {copy_gb_s:.0f} GB/s (read + write)", "",
             "| T | method | config (gate_up/down NxKxW[xS]) | experts | MB | eager µs "
             "| graph µs | GB/s | % copy | rel err |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['method']} | {r['config']} | "
                     f"{r['distinct_experts']:.1f} | {r['mb']} | {r['eager_us']} | "
                     f"{r.get('graph_us', '-')} | {r['gb_s']} | "
                     f"{100 * r['gb_s'] / copy_gb_s:.0f} | {r['rel_err']:.1e} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke check)")
    p.add_argument("--tokens", type=int, nargs="+", help="token counts (default per size)")
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--kinds", nargs="+", choices=["pair", "sorted", "grouped"],
                   default=["pair", "sorted", "grouped"], help="the kernels to time")
    p.add_argument("--default-shapes", action="store_true",
                   help="each kernel at its default launch shape only")
    p.add_argument("--out", help="JSON file for the results (rewritten after each count)")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cpu":
        # Triton reads this when it is imported: the kernels then run in its interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
    # Only now: bench.floors imports the model, and with it triton.
    from bench.floors import measure_bandwidth

    sizes = SMALL if args.small else REAL
    tokens = args.tokens or sizes["tokens"]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters, pool = (args.iters, POOL) if device.type == "cuda" else (min(args.iters, 2), 2)

    copy_bytes = (2 << 30) if device.type == "cuda" else (64 << 20)
    copy_gb_s = measure_bandwidth(device, copy_bytes) / 1e9
    e, h, i = sizes["experts"], sizes["hidden"], sizes["inter"]
    weights = (torch.randn(e, 2 * i, h, device=device, dtype=dtype) * h**-0.5,
               torch.randn(e, h, i, device=device, dtype=dtype) * i**-0.5)
    rows = []
    for t in tokens:
        rows += bench_tokens(t, sizes, weights, device, dtype, iters, pool, tuple(args.kinds),
                             args.default_shapes)
        print(f"T={t} done", flush=True)
        if args.out:
            with open(args.out, "w") as f:
                json.dump({"device": torch.cuda.get_device_name(device)
                           if device.type == "cuda" else "cpu", "dtype": str(dtype),
                           "sizes": sizes, "pool": pool, "copy_gb_s": round(copy_gb_s, 1),
                           "rows": rows}, f, indent=1)
    print(table(rows, copy_gb_s))


if __name__ == "__main__":
    main()
