"""Dense projections at decode / small-verify row counts: small_linear
(target/kernels/linear_triton.py) at its default launch shape, and with --sweep at a few
others, against F.linear (cuBLAS), as µs per call, GB/s of weight bytes read and the share of a
device copy's bandwidth measured in the same run; then the per-decode-step total of the
Qwen3.5-35B-A3B dense projections (each shape times its count per step).

    python -m bench.linear_kernel --device cuda --out linear_kernel.json [--sweep]
    python -m bench.linear_kernel --device cpu   # smoke check: tiny sizes, Triton interpreter

Real sizes, bf16, rows M in ROWS. A shape's weight exists in enough copies (ROTATE_BYTES
together, about 5× the 50 MB L2, at most MAX_COPIES) that consecutive calls read different
copies and the L2 does not serve them; the smallest weights (router, shared-expert gate) stay
L2-resident all the same (`l2_fits` in the rows). A sample replays one CUDA graph of
max(copies, MIN_CALLS) calls cycling over the copies, timed with CUDA events (device time,
inter-kernel gaps included, no host launch cost: how the engine runs a step); µs = sample /
calls, median over --iters samples. x is one tensor per M (activations are L2-hot)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from bench.timing import graphed

# name: (N, K, calls per decode step). Qwen3.5-35B-A3B: 30 GDN layers, 10 attention layers,
# 40 MoE layers (each with a shared expert, its sigmoid gate and the router).
REAL = {
    "gdn_in_proj": (12352, 2048, 30),
    "gdn_out_proj": (2048, 4096, 30),
    "q_proj": (8192, 2048, 10),
    "k_proj": (512, 2048, 10),
    "v_proj": (512, 2048, 10),
    "o_proj": (2048, 4096, 10),
    "shared_gate_up": (1024, 2048, 40),
    "shared_down": (2048, 512, 40),
    "router": (256, 2048, 40),
    "shared_gate": (1, 2048, 40),
}
SMALL = {"a": (40, 48, 1), "b": (96, 200, 2)}
ROWS = {"cuda": [1, 2, 4, 8, 16], "cpu": [1, 3]}
# (BLOCK_N, BLOCK_K, num_warps, num_stages, mma) tried by --sweep besides the default.
SWEEP = [(16, 128, 4, 4, False), (16, 256, 2, 3, False), (16, 256, 4, 3, False),
         (32, 256, 4, 3, False), (64, 128, 4, 3, False), (16, 512, 4, 2, False),
         (8, 256, 4, 3, False), (8, 512, 4, 2, False),
         (16, 256, 4, 3, True), (32, 128, 4, 3, True), (64, 128, 4, 3, True)]
ROTATE_BYTES = 256 << 20
L2_BYTES = 50 << 20
MAX_COPIES = 64
MIN_CALLS = 32


def us_per_call(calls: list[Callable], device: torch.device, iters: int) -> float:
    """Median µs per call: CUDA-graph replay timed by events on CUDA, eager on CPU."""
    if device.type == "cuda":
        replay = graphed(calls)
        replay()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(iters)]
        for start, end in events:
            start.record()
            replay()
            end.record()
        torch.cuda.synchronize(device)
        samples = [start.elapsed_time(end) * 1e3 for start, end in events]
    else:
        samples = []
        for _ in range(iters):
            t = time.perf_counter()
            for call in calls:
                call()
            samples.append((time.perf_counter() - t) * 1e6)
    return statistics.median(samples) / len(calls)


def bench_shape(n: int, k: int, rows: list[int], configs: list, device: torch.device,
                dtype: torch.dtype, iters: int) -> list[dict]:
    from target.kernels.linear_triton import LinearBlocks, linear_blocks, small_linear

    nbytes = n * k * dtype.itemsize
    if device.type == "cuda":
        copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // nbytes)))
        num_calls = max(copies, MIN_CALLS)
    else:
        copies = num_calls = 2
    weights = [torch.randn(n, k, device=device, dtype=dtype) * k**-0.5 for _ in range(copies)]
    default = linear_blocks(n, k)
    methods = [("F.linear", "-", lambda x, w: F.linear(x, w)),
               ("small", "default", lambda x, w: small_linear(x, w))]
    for cfg in configs:
        blocks = LinearBlocks(*cfg)
        if blocks != default:
            name = "x".join(map(str, cfg[:4])) + ("/mma" if blocks.mma else "")
            methods.append(("small", name, lambda x, w, b=blocks: small_linear(x, w, blocks=b)))
    out = []
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=dtype)
        want = F.linear(x, weights[0]).double()
        for method, config, fn in methods:
            got = fn(x, weights[0]).double()
            err = ((got - want).norm() / want.norm().clamp_min(1e-30)).item()
            calls = [lambda fn=fn, x=x, w=weights[i % copies]: fn(x, w) for i in range(num_calls)]
            us = us_per_call(calls, device, iters)
            out.append({"n": n, "k": k, "rows": m, "method": method, "config": config,
                        "blocks": dataclasses.asdict(default) if config == "default" else None,
                        "copies": copies,
                        "l2_fits": device.type == "cuda" and copies * nbytes <= L2_BYTES,
                        "us": round(us, 2), "gb_s": round(nbytes / us / 1e3, 1),
                        "rel_err": float(f"{err:.2e}")})
    del weights
    return out


def per_step(shapes: dict, rows: list[dict], copy_gb_s: float) -> list[dict]:
    """Per M: µs of all dense projections of one decode step, each shape × its count."""
    out = []
    for m in sorted({r["rows"] for r in rows}):
        total = {"rows": m, "F.linear": 0.0, "small_default": 0.0, "small_best": 0.0,
                 "copy_floor": 0.0}
        for n, k, count in shapes.values():
            mine = [r for r in rows if (r["n"], r["k"], r["rows"]) == (n, k, m)]
            small = [r["us"] for r in mine if r["method"] == "small"]
            total["F.linear"] += count * next(r["us"] for r in mine if r["method"] == "F.linear")
            total["small_default"] += count * next(r["us"] for r in mine
                                                   if r["config"] == "default")
            total["small_best"] += count * min(small)
            total["copy_floor"] += count * n * k * 2 / copy_gb_s / 1e3
        out.append({key: round(v, 1) if isinstance(v, float) else v
                    for key, v in total.items()})
    return out


def table(shapes: dict, rows: list[dict], steps: list[dict], copy_gb_s: float) -> str:
    names = {}
    for name, (n, k, _) in shapes.items():
        names.setdefault((n, k), []).append(name)
    lines = [f"device copy: {copy_gb_s:.0f} GB/s (read + write)", "",
             "| shape | N×K | M | method | config (NxKxWxS) | µs | GB/s | % copy | rel err |",
             "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {'+'.join(names[r['n'], r['k']])}{' (L2)' if r['l2_fits'] else ''} "
                     f"| {r['n']}×{r['k']} | {r['rows']} | {r['method']} | {r['config']} | "
                     f"{r['us']} | {r['gb_s']} | {100 * r['gb_s'] / copy_gb_s:.0f} | "
                     f"{r['rel_err']:.1e} |")
    lines += ["", "per decode step (µs, each shape × its count):", "",
              "| M | F.linear | small default | small best | copy floor |", "|---|---|---|---|---|"]
    for s in steps:
        lines.append(f"| {s['rows']} | {s['F.linear']} | {s['small_default']} | "
                     f"{s['small_best']} | {s['copy_floor']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: real sizes; cpu: tiny sizes in Triton's interpreter (smoke)")
    p.add_argument("--iters", type=int, default=20, help="timed samples per measurement")
    p.add_argument("--sweep", action="store_true", help="also the launch shapes of SWEEP")
    p.add_argument("--out", help="JSON file for the results")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device (use --device cpu for the smoke "
                "check)")
    if device.type == "cpu":
        # Triton reads this when first imported (bench.floors imports the model, the model
        # the kernel): small_linear then runs in its interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
    from bench.floors import measure_bandwidth

    shapes = REAL if device.type == "cuda" else SMALL
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters = args.iters if device.type == "cuda" else min(args.iters, 2)
    copy_gb_s = measure_bandwidth(device, (2 << 30) if device.type == "cuda" else (64 << 20))
    copy_gb_s /= 1e9
    rows = []
    for n, k in dict.fromkeys((n, k) for n, k, _ in shapes.values()):
        rows += bench_shape(n, k, ROWS[device.type], SWEEP if args.sweep else [], device, dtype,
                            iters)
        print(f"{n}×{k} done", flush=True)
    steps = per_step(shapes, rows, copy_gb_s)
    print(table(shapes, rows, steps, copy_gb_s))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                       else "cpu", "dtype": str(dtype), "shapes": shapes,
                       "copy_gb_s": round(copy_gb_s, 1), "rows": rows, "per_step": steps},
                      f, indent=1)


if __name__ == "__main__":
    main()
