"""Dense projections at decode / small-verify row counts through F.linear (cuBLAS): each
projection alone, and the groups that read the same input as one GEMM over their stacked
weights (attention's q/k/v; the MoE's router, shared-expert gate/up and shared-expert gate:
the model's, its rows padded to a multiple of 8, and unpadded), as
µs per call, GB/s of weight bytes read and the share of a device copy's bandwidth measured in
the same run; then per decode step (each shape times its count): every projection alone, and
with each group as one GEMM, as the model runs them.

    python -m bench.linear_kernel --device cuda --out linear_kernel.json
    python -m bench.linear_kernel --device cpu   # smoke check: tiny sizes
    python -m bench.linear_kernel --device cuda --layouts nk kn   # and each weight transposed

Real sizes, bf16, rows M in ROWS. A shape's weight exists in enough copies (ROTATE_BYTES
together, about 5× the 50 MB L2, at most MAX_COPIES) that consecutive calls read different
copies and the L2 does not serve them; the smallest weights (router, shared-expert gate) stay
L2-resident all the same (`l2_fits` in the rows). A sample replays one CUDA graph of
max(copies, MIN_CALLS) calls cycling over the copies, timed with CUDA events (device time,
inter-kernel gaps included, no host launch cost: how the engine runs a step); µs = sample /
calls, median over --iters samples. x is one tensor per M (activations are L2-hot)."""

from __future__ import annotations

import argparse
import json
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
SMALL = {"a": (40, 48, 1), "b": (96, 200, 2), "c": (8, 48, 1)}
# Projections that read the same input: one GEMM over their stacked weights can replace them.
GROUPS = {"cuda": {"attention_qkv": ("q_proj", "k_proj", "v_proj"),
                   "moe_inputs": ("router", "shared_gate", "shared_gate_up")},
          "cpu": {"ac": ("a", "c")}}
ROWS = {"cuda": [1, 2, 4, 8, 16], "cpu": [1, 3]}
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


# How a weight is stored: "nk" as the model stores it ([N, K], F.linear(x, w)); "kn" as its
# transpose ([K, N] contiguous, x @ w: cuBLAS takes the other operand layout and may pick
# another kernel, e.g. none of the split-K ones it takes for 2048 × 4096 at one row).
LAYOUTS = ("nk", "kn")


def bench_shape(n: int, k: int, rows: list[int], device: torch.device, dtype: torch.dtype,
                iters: int, layout: str = "nk") -> list[dict]:
    """F.linear with an N × K weight at each M (`layout` "kn": x @ a [K, N] weight)."""
    nbytes = n * k * dtype.itemsize
    if device.type == "cuda":
        copies = max(1, min(MAX_COPIES, -(-ROTATE_BYTES // nbytes)))
        num_calls = max(copies, MIN_CALLS)
    else:
        copies = num_calls = 2
    shape = (k, n) if layout == "kn" else (n, k)
    weights = [torch.randn(*shape, device=device, dtype=dtype) * k**-0.5 for _ in range(copies)]
    out = []
    for m in rows:
        x = torch.randn(m, k, device=device, dtype=dtype)
        if layout == "nk":
            calls = [lambda x=x, w=weights[i % copies]: F.linear(x, w) for i in range(num_calls)]
        else:
            calls = [lambda x=x, w=weights[i % copies]: x @ w for i in range(num_calls)]
        us = us_per_call(calls, device, iters)
        out.append({"n": n, "k": k, "rows": m, "layout": layout, "copies": copies,
                    "l2_fits": device.type == "cuda" and copies * nbytes <= L2_BYTES,
                    "us": round(us, 2), "gb_s": round(nbytes / us / 1e3, 1)})
    del weights
    return out


def fused_shape(shapes: dict, members: tuple[str, ...], align: int = 8) -> tuple[int, int]:
    """N × K of a group's stacked weight (its members read the same K-wide input), N rounded
    up to `align` rows as the model stacks them (target/layers/linear.py stack_rows)."""
    (k,) = {shapes[p][1] for p in members}
    return -(-sum(shapes[p][0] for p in members) // align) * align, k


def per_step(shapes: dict, groups: dict, rows: list[dict], copy_gb_s: float) -> list[dict]:
    """Per M: µs of one decode step's dense projections each alone ("separate"), with every
    group as one GEMM as the model runs them ("fused"), and the copy floor; per group, one
    call of its projections separate and fused."""
    def us(n: int, k: int, m: int) -> float:
        return next(r["us"] for r in rows
                    if (r["n"], r["k"], r["rows"], r["layout"]) == (n, k, m, "nk"))

    out = []
    for m in sorted({r["rows"] for r in rows}):
        separate = sum(count * us(n, k, m) for n, k, count in shapes.values())
        step = {"rows": m, "separate": separate, "fused": separate, "copy_floor": sum(
            count * n * k * 2 / copy_gb_s / 1e3 for n, k, count in shapes.values())}
        for name, members in groups.items():
            (count,) = {shapes[p][2] for p in members}
            alone = sum(us(*shapes[p][:2], m) for p in members)
            together = us(*fused_shape(shapes, members), m)
            step[name] = {"separate": round(alone, 1), "fused": round(together, 1)}
            step["fused"] += count * (together - alone)
        out.append({k: round(v, 1) if isinstance(v, float) else v for k, v in step.items()})
    return out


def table(shapes: dict, groups: dict, rows: list[dict], steps: list[dict],
          copy_gb_s: float) -> str:
    names = {}
    for name, (n, k, _) in shapes.items():
        names.setdefault((n, k), []).append(name)
    for name, members in groups.items():
        names.setdefault(fused_shape(shapes, members), []).append(name)
        if fused_shape(shapes, members, 1) != fused_shape(shapes, members):
            names.setdefault(fused_shape(shapes, members, 1), []).append(f"{name} unaligned")
    lines = [f"device copy: {copy_gb_s:.0f} GB/s (read + write)", "",
             "| shape | N×K | layout | M | µs | GB/s | % copy |", "|" + "---|" * 7]
    for r in rows:
        lines.append(f"| {'+'.join(names[r['n'], r['k']])}{' (L2)' if r['l2_fits'] else ''} "
                     f"| {r['n']}×{r['k']} | {r['layout']} | {r['rows']} | {r['us']} | "
                     f"{r['gb_s']} | {100 * r['gb_s'] / copy_gb_s:.0f} |")
    lines += ["", "per decode step (µs, each shape × its count); per group, one call of its "
              "projections, separate / fused:", "",
              "| M | separate | groups fused | copy floor | " + " | ".join(groups) + " |",
              "|---|---|---|---|" + "---|" * len(groups)]
    for s in steps:
        lines.append(f"| {s['rows']} | {s['separate']} | {s['fused']} | {s['copy_floor']} | "
                     + " | ".join(f"{s[g]['separate']} / {s[g]['fused']}" for g in groups)
                     + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="cuda: real sizes; cpu: tiny sizes (smoke)")
    p.add_argument("--iters", type=int, default=20, help="timed samples per measurement")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=["nk"],
                   help="weight storage to time: nk (the model's, [N, K]; the per-step sums "
                        "use it, so it is always timed) and kn (its transpose, x @ w)")
    p.add_argument("--out", help="JSON file for the results")
    args = p.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda but torch sees no CUDA device (use --device cpu for the smoke "
                "check)")
    from bench.floors import measure_bandwidth

    shapes = REAL if device.type == "cuda" else SMALL
    groups = GROUPS[device.type]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    iters = args.iters if device.type == "cuda" else min(args.iters, 2)
    copy_gb_s = measure_bandwidth(device, (2 << 30) if device.type == "cuda" else (64 << 20))
    copy_gb_s /= 1e9
    todo = [(n, k) for n, k, _ in shapes.values()]
    todo += [fused_shape(shapes, members) for members in groups.values()]
    # and unaligned (N = the members' rows), to see what the alignment is worth
    todo += [fused_shape(shapes, members, 1) for members in groups.values()]
    rows = []
    for n, k in dict.fromkeys(todo):
        for layout in dict.fromkeys(["nk", *args.layouts]):
            rows += bench_shape(n, k, ROWS[device.type], device, dtype, iters, layout)
        print(f"{n}×{k} done", flush=True)
    steps = per_step(shapes, groups, rows, copy_gb_s)
    print(table(shapes, groups, rows, steps, copy_gb_s))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(device) if device.type == "cuda"
                       else "cpu", "dtype": str(dtype), "shapes": shapes, "groups": groups,
                       "copy_gb_s": round(copy_gb_s, 1), "rows": rows, "per_step": steps},
                      f, indent=1)


if __name__ == "__main__":
    main()
