"""The Gated DeltaNet's round kernels at decode and verify sizes: the in-place recurrence by slot
(target/kernels/gdn_slots.py) at several launch shapes (SlotsLaunch: value columns per
program, warps), the prologue before it (the conv by slot, head split, q/k norms and gates)
and the gated output norm after it, each as the compiled torch chain against its Triton
kernel (target/kernels/gdn_prologue.py). µs per call in CUDA-graph replay (how the engine
runs a round), next to the floor: the bytes a call must move at the bandwidth of a device
copy measured in the same run.

    python -m bench.gdn_kernel --device cuda --out gdn_kernel.json
    python -m bench.gdn_kernel --device cpu --small   # smoke check (Triton interpreter)

Real sizes (Qwen3.5-35B-A3B, one GPU): 16 key heads, 32 value heads, Dk = Dv = 128, conv
kernel 4, bf16 inputs, fp32 states. A sample replays one call on each of a pool of layers' caches,
enough layers that their states (2 MB a sequence a layer) overflow the L2 (POOL_BYTES): they
come from memory, as in a step, where 39 other layers run between a layer's two rounds;
µs = sample / pool size, median over --iters samples.

  decode   L = 1: the recurrence reads and writes each sequence's state; the prologue
           writes the conv state in place (Triton) or returns [state | inputs] for the commit
           (torch; the commit kernel is timed beside it).
  verify   L = B: the recurrence reads the states only; the prologue returns [state | inputs].
  commit   the verify's replay of the kept tokens (half the block, rounded up, for every
           sequence), writing the states: the recurrence alone.

Each launch shape's outputs and states are compared with the default shape's (relative error;
each shape's own bits are one per model, tests/target/test_gdn_slots.py).

A compiled chain picks its launch shape on its first call and keeps it for every size; the
engine's first call is its start-up profile, a prefill of max_num_batched_tokens. So the
compiled chains are called once at PREFILL_TOKENS before anything is timed, as there."""

from __future__ import annotations

import argparse
import json
import os

import torch

from bench.timing import graphed, median_p90, sample_times

REAL = dict(hk=16, hv=32, dk=128, dv=128, kernel=4)
SMALL = dict(hk=2, hv=4, dk=16, dv=16, kernel=4)
# (block_v, warps); the first is gdn_slots.LAUNCH.
SHAPES = [(32, 4), (16, 4), (16, 2), (8, 1), (64, 8)]
POOL_BYTES = 256 << 20  # the states one sample touches: five times the H200's L2
PREFILL_TOKENS = 8192  # the engine's default max_num_batched_tokens


def make_layer(sizes: dict, n_seqs: int, width: int, device: torch.device, seed: int) -> dict:
    """One layer's round: the conv inputs x [S, L, C], the gates' a and b, its caches (conv
    [2S, C, K−1] and states [2S, Hv, Dk, Dv], sequences on every other slot) and its weights;
    and the recurrence's inputs from the torch prologue."""
    from target.kernels import fused

    hk, hv, dk, dv, taps = (sizes[n] for n in ("hk", "hv", "dk", "dv", "kernel"))
    channels = 2 * hk * dk + hv * dv
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    g = torch.Generator().manual_seed(seed)
    rand = lambda *shape: torch.randn(*shape, generator=g)
    layer = dict(
        x=rand(n_seqs, width, channels).to(device, dtype),
        a=rand(n_seqs * width, hv).to(device, dtype), b=rand(n_seqs * width, hv).to(device, dtype),
        conv=rand(2 * n_seqs, channels, taps - 1).to(device, dtype),
        states=(rand(2 * n_seqs, hv, dk, dv) * 0.1).to(device),
        slots=torch.arange(0, 2 * n_seqs, 2, device=device),
        weight=(rand(channels, taps) * 0.5).to(device, dtype),
        a_log=rand(hv).to(device), dt_bias=rand(hv).to(device))
    g_, beta = fused.gdn_gates(layer["b"], layer["a"], layer["a_log"], layer["dt_bias"], dtype)
    q, k, v, conv_seq = fused.conv_split_heads(layer["x"], layer["conv"], layer["slots"],
                                               layer["weight"], hk * dk, hk, dk, hv, dv, dtype,
                                               False)
    layer.update(q=q, k=k, v=v, g=g_.view(n_seqs, width, hv), beta=beta.view(n_seqs, width, hv),
                 conv_seq=conv_seq,
                 kept=torch.full((n_seqs,), -(-width // 2), device=device),
                 # the norm's inputs: o as the recurrence returns it, z a view of the projection
                 o=rand(n_seqs * width, hv, dv).to(device, dtype),
                 z=rand(n_seqs * width, hv * dv + channels)[:, channels:].to(device, dtype)
                 .view(n_seqs * width, hv, dv),
                 norm_weight=(1 + 0.1 * rand(dv)).to(device, dtype))
    return layer


def warm_compiled(sizes: dict, device: torch.device) -> None:
    """The compiled chains' first calls at a prefill's size (their launch shapes are picked
    then, for every later size), as the engine's start-up profile makes them: make_layer
    runs the prologue's, then the norm."""
    from target.kernels import fused

    if device.type != "cuda":
        return
    layer = make_layer(sizes, 1, PREFILL_TOKENS, device, seed=99)
    fused.gated_rms_norm(layer["o"], layer["z"], layer["norm_weight"], 1e-6)
    torch.cuda.synchronize(device)


def norm_call(layer: dict, kind: str):
    from target.kernels import fused, gdn_prologue

    o, z, weight = layer["o"], layer["z"], layer["norm_weight"]
    if kind == "triton":
        return lambda: gdn_prologue.gated_rms_norm(o, z, weight, 1e-6)
    return lambda: fused.gated_rms_norm(o, z, weight, 1e-6)


def recurrence_call(layer: dict, step: str, launch):
    from target.kernels.gdn_slots import recurrent_slots

    args = [layer[n] for n in ("q", "k", "v", "g", "beta", "states", "slots")]
    if step == "decode":
        return lambda: recurrent_slots(*args, write_state=True, launch=launch)
    if step == "verify":
        return lambda: recurrent_slots(*args, launch=launch)
    return lambda: recurrent_slots(*args, num_kept=layer["kept"], write_state=True,
                                   need_output=False, launch=launch)


def prologue_call(layer: dict, sizes: dict, kind: str):
    """The prologue as the layer runs it (GatedDeltaNet._verify_round). A decode writes the
    layer's conv cache in place (the Triton kernel in its launch, torch in commit_conv):
    the timing repeats it, which changes only the values it reads next."""
    from target.kernels import fused, gdn_prologue, gdn_slots

    hk, hv, dk, dv = (sizes[n] for n in ("hk", "hv", "dk", "dv"))
    x, conv, slots, weight = (layer[n] for n in ("x", "conv", "slots", "weight"))
    a, b, a_log, dt_bias = (layer[n] for n in ("a", "b", "a_log", "dt_bias"))
    dtype, decode = x.dtype, x.shape[1] == 1
    if kind == "triton":
        return lambda: gdn_prologue.conv_split_gates(x, conv, slots, weight, a, b, a_log,
                                                     dt_bias, hk, dk, hv, dv, dtype, dtype)

    def torch_prologue():
        g, beta = fused.gdn_gates(b, a, a_log, dt_bias, dtype)
        q, k, v, conv_seq = fused.conv_split_heads(x, conv, slots, weight, hk * dk, hk, dk, hv,
                                                   dv, dtype, False)
        if decode:  # the decode's commit of its conv state, one launch
            commit = gdn_slots.commit_conv if x.is_cuda else gdn_slots.commit_conv_reference
            commit(conv_seq, conv, slots, 1)
        return q, k, v, g, beta

    return torch_prologue


def floor_bytes(layer: dict, step: str, what: str) -> int:
    """Bytes a call must move: the states read (and written by decode and commit) for the
    recurrence, its inputs and outputs; the conv window, inputs and outputs for the
    prologue."""
    size = lambda t: t.numel() * t.element_size()
    n_seqs = layer["x"].shape[0]
    if what == "norm":  # o and z read, the output written
        return 3 * size(layer["o"])
    if what == "prologue":
        conv = size(layer["conv"]) // 2  # the sequences' slots only
        outs = sum(size(layer[n]) for n in ("q", "k", "v", "g", "beta"))
        return conv * (2 if step == "decode" else 1) + size(layer["x"]) + outs + size(
            layer["a"]) + size(layer["b"])
    states = size(layer["states"]) * n_seqs // layer["states"].shape[0]
    inputs = sum(size(layer[n]) for n in ("q", "k", "v", "g", "beta"))
    if step == "verify":
        return states + inputs + size(layer["v"])  # o like v
    if step == "commit":
        return 2 * states + inputs
    return 2 * states + inputs + size(layer["v"])


def time_calls(calls: list, device: torch.device, iters: int) -> float:
    """Median µs per call: one graph of all calls replayed on CUDA, eager elsewhere."""
    from bench.floors import sync

    def run_all():
        for call in calls:
            call()

    fn = graphed(calls) if device.type == "cuda" else run_all
    warmup = 3 if device.type == "cuda" else 1
    samples = sample_times(fn, iters, warmup, lambda: sync(device))[0]
    return median_p90(samples, "us", 2)["median_us"] / len(calls)


def rel_err(got, want) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30)).item()


def bench_round(sizes: dict, n_seqs: int, width: int, device: torch.device, iters: int,
                pool: int, shapes: list[tuple], copy_gb_s: float) -> list[dict]:
    from target.kernels.gdn_slots import SlotsLaunch

    if pool == 0:  # enough layers for POOL_BYTES of states
        per_layer = n_seqs * sizes["hv"] * sizes["dk"] * sizes["dv"] * 4
        pool = max(2, -(-POOL_BYTES // per_layer))
    layers = [make_layer(sizes, n_seqs, width, device, seed) for seed in range(pool)]
    steps = ["decode"] if width == 1 else ["verify", "commit"]
    rows = []

    def row(what, step, config, us, err=None):
        nbytes = floor_bytes(layers[0], step, what)
        floor_us = nbytes / copy_gb_s / 1e3
        out = {"what": what, "step": step, "seqs": n_seqs, "width": width, "config": config,
               "pool": pool, "us": round(us, 2), "floor_us": round(floor_us, 2),
               "x_floor": round(us / floor_us, 2), "mb": round(nbytes / 1e6, 2)}
        if err is not None:
            out["rel_err_vs_default"] = float(f"{err:.2e}")
        return out

    for step in steps:
        # every shape from the same states: the results to compare with the first (default)
        first = layers[0]
        start = first["states"].clone()
        results = []
        for shape in shapes:
            first["states"].copy_(start)
            out = recurrence_call(first, step, SlotsLaunch(*shape))()
            results.append(([] if out is None else [out]) + [first["states"].clone()])
        first["states"].copy_(start)
        for shape, result in zip(shapes, results, strict=True):
            err = max(rel_err(a, b) for a, b in zip(result, results[0], strict=True))
            us = time_calls([recurrence_call(layer, step, SlotsLaunch(*shape))
                             for layer in layers], device, iters)
            rows.append(row("recurrence", step, "x".join(map(str, shape)), us, err))
        if step == "commit":
            continue
        for kind in ("torch", "triton"):
            us = time_calls([prologue_call(layer, sizes, kind) for layer in layers], device,
                            iters)
            rows.append(row("prologue", step, kind, us))
        for kind in ("torch", "triton"):
            us = time_calls([norm_call(layer, kind) for layer in layers], device, iters)
            rows.append(row("norm", step, kind, us))
    return rows


def table(rows: list[dict], copy_gb_s: float) -> str:
    lines = [f"device copy: {copy_gb_s:.0f} GB/s (read + write)", "",
             "| what | step | S × L | config | layers | µs | floor µs | × floor | MB "
             "| rel err vs default |", "|" + "---|" * 10]
    for r in rows:
        lines.append(f"| {r['what']} | {r['step']} | {r['seqs']} × {r['width']} | {r['config']} "
                     f"| {r['pool']} | {r['us']} | {r['floor_us']} | {r['x_floor']} | {r['mb']} | "
                     f"{r.get('rel_err_vs_default', '-')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--small", action="store_true", help="tiny sizes (CPU smoke check)")
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 16],
                   help="tokens per sequence: 1 is a decode, more a verify and its commit")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", help="JSON file for the results (rewritten after each size)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu":
        # Triton reads this when it is imported: the kernels then run in its interpreter.
        os.environ["TRITON_INTERPRET"] = "1"
    # Only now: bench.floors imports the model, and with it triton.
    from bench.floors import measure_bandwidth
    from target.kernels import fused

    fused.enable(True)  # the torch prologue as the engine runs it: compiled (CUDA only)
    sizes = SMALL if args.small else REAL
    cpu = device.type == "cpu"
    iters, pool = (min(args.iters, 2), 2) if cpu else (args.iters, 0)
    shapes = SHAPES[:2] if cpu else SHAPES
    copy_gb_s = measure_bandwidth(device, (64 << 20) if cpu else (2 << 30)) / 1e9
    warm_compiled(sizes, device)
    rows = []
    for n_seqs in args.seqs:
        for width in args.widths:
            rows += bench_round(sizes, n_seqs, width, device, iters, pool, shapes, copy_gb_s)
            print(f"S={n_seqs} L={width} done", flush=True)
            if args.out:
                with open(args.out, "w") as f:
                    json.dump({"device": torch.cuda.get_device_name(device)
                               if device.type == "cuda" else "cpu", "sizes": sizes,
                               "copy_gb_s": round(copy_gb_s, 1), "rows": rows},
                              f, indent=1)
    print(table(rows, copy_gb_s))
    return rows


if __name__ == "__main__":
    main()
