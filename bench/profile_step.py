"""Where a step's time goes: torch.profiler over the prefill, the decode step, a verify step and
the draft's proposal (the same steps bench/engine.py times), on the random-weight model.

    python -m bench.profile_step --preset qwen3.5-35b-a3b --device cuda --batch 1 --block-size 16 \
        --out prof.txt

Per step it appends the operator table (top ops by device time, then by host time) to --out
and prints wall ms, summed kernel ms, kernel launches per step (host launches: one per
replayed graph) and the kernels the device ran, in all and by kind (GEMMs, the engine's
Triton kernels, compiled chains, fla, torch's own small ops): a step whose kernels add up to
much less than its wall time is bound by the host (launches, syncs, Python), not by the GPU."""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

from bench.floors import sync
from bench.random_model import add_kernel_args, build_draft, build_target, set_kernels
from bench.steps import Batch
from configs.presets import draft_preset, target_preset
from draft.proposer import DraftRunner

# Kernel names → what they are, first match wins (the profile's own names: cuBLAS's nvjet and
# cutlass GEMMs, the engine's Triton kernels, Inductor's compiled chains, fla, torch's own).
KERNEL_KINDS = (
    ("gemm", ("nvjet", "gemm", "cutlass", "cublas", "splitkreduce", "dot_kernel", "gemv")),
    ("engine triton", ("_gate_up_kernel", "_down_kernel", "_route_kernel", "_groups_kernel",
                       "_place_kernel", "_recurrent_slots_kernel", "_split_kernel",
                       "_merge_kernel")),
    ("compiled chains", ("triton_",)),
    ("fla", ("gated_delta", "chunk_", "fused_recurrent")),
    ("copies", ("memcpy", "memset")),
    ("torch index/gather", ("index", "gather", "scatter", "catarray", "cat_")),
    ("torch elementwise/reduce", ("elementwise", "reduce", "softmax", "topk", "sort",
                                  "fill", "arange")),
)


def kernel_kind(name: str) -> str:
    low = name.lower()
    return next((kind for kind, marks in KERNEL_KINDS if any(m in low for m in marks)), "other")


def kernels_by_kind(kernels: list[tuple[str, int, float]], steps: int) -> dict[str, dict]:
    """(name, calls, device µs) of every kernel → per kind: launches and ms per step, the
    "fewer, fuller kernels" view of a step."""
    out: dict[str, dict] = {}
    for name, calls, us in kernels:
        k = out.setdefault(kernel_kind(name), {"launches": 0.0, "ms": 0.0})
        k["launches"] += calls / steps
        k["ms"] += us / steps / 1e3
    return dict(sorted(out.items(), key=lambda kv: -kv[1]["ms"]))


def profile_step(name: str, fn, device: torch.device, steps: int, out: str | None) -> dict:
    for _ in range(2):
        fn()
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        for _ in range(steps):
            fn()
        sync(device)
        wall = (time.perf_counter() - t) / steps
    events = prof.key_averages()
    kernel_us = sum(e.self_device_time_total for e in events
                    if e.device_type == torch.autograd.DeviceType.CUDA) / steps
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cuLaunchKernel",
                                                        "cudaLaunchKernelExC")) / steps
    syncs = sum(e.count for e in events if e.key in ("cudaStreamSynchronize",
                                                    "cudaDeviceSynchronize")) / steps
    kernels = [(e.key, e.count, e.self_device_time_total) for e in events
               if e.device_type == torch.autograd.DeviceType.CUDA and e.self_device_time_total]
    row = {"step": name, "wall_ms": wall * 1e3, "kernel_ms": kernel_us / 1e3,
           "launches": launches, "host_syncs": syncs,
           "kernels": sum(c for _, c, _ in kernels) / steps,
           "by_kind": kernels_by_kind(kernels, steps)}
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n\n")
            f.write(events.table(sort_by="self_device_time_total", row_limit=40))
            f.write("\n\n")
            f.write(events.table(sort_by="self_cpu_time_total", row_limit=30))
            f.write("\n\n")
    return row


STEP_KINDS = ("prefill", "decode", "verify", "draft")


def profile_run(target, draft, args, device: torch.device, graphs: bool) -> list[dict]:
    """One run over fresh caches and graphs: the prompts prefilled, then each of args.kinds
    profiled."""
    B, b = args.block_size, args.batch
    max_new = (2 * args.steps + 8) * 2 * B
    pages = -(-(args.prompt_len + max_new) // 16)
    drafter = DraftRunner(draft, b * pages, 16, B, target.embed, target.compute_logits,
                          device, graph_max_seqs=b if graphs else 0, graph_max_pages=pages)
    batch = Batch.in_process(target, drafter, tuple(draft.cfg.target_layer_ids), b,
                             args.prompt_len, max_new, 16, device, graphs)

    def prefill():  # the same prompts again: num_cached back to prompt_len
        return batch.prefill(args.prefill_chunk or None)

    prefill()  # also the draft's context
    steps = {"prefill": prefill, "decode": lambda: batch.verify([[]] * b),
             "verify": lambda: batch.verify(batch.random_drafts(B - 1)),
             "draft": batch.propose}
    return [profile_step(f"{kind}_b{b}" if kind in ("prefill", "decode") else
                         f"{kind}_B{B}_b{b}", steps[kind], device, args.steps, args.out)
            for kind in args.kinds]


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-35b-a3b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--prefill-chunk", type=int, default=8192,
                   help="prompt tokens per prefill step over the batch, as bench/engine.py "
                        "takes it (the engine's max_num_batched_tokens default); 0: one step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--kinds", nargs="+", choices=STEP_KINDS, default=list(STEP_KINDS),
                   help="the steps to profile (a long context's prefill is slow to profile)")
    p.add_argument("--repeats", type=int, default=1,
                   help="profile the steps this many times, each over fresh caches and "
                        "graphs as each run of bench/engine.py has them: whether a run's "
                        "slower steps are slower kernels or more host time")
    add_kernel_args(p)
    p.add_argument("--variant", default="", metavar="FIELD=VALUE[,…]",
                   help="KernelConfig fields over the flags' kernels, as bench/engine.py "
                        "--variants takes them (e.g. gdn_prologue=triton)")
    p.add_argument("--out", help="append the operator tables to this file")
    args = p.parse_args(argv)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    target = build_target(target_preset(args.preset), dtype, device)
    draft = build_draft(draft_preset(args.preset), dtype, device, args.block_size)
    graphs = set_kernels(target, draft, args, device, args.variant)
    rows = []
    for repeat in range(args.repeats):
        for row in profile_run(target, draft, args, device, graphs):
            row["repeat"] = repeat
            rows.append(row)
            print(json.dumps(row), flush=True)
        if device.type == "cuda":  # as bench/engine.py between runs: the graphs' cycles
            gc.collect()
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
