"""The attention of a decode step or verify round at long context, each kernel on the same
paged cache: "gathered" (the table's pages copied out, then batched matmuls or masked SDPA:
attention_backend torch under CUDA graphs), "triton" (the split-keys kernel over the pages in
place: attention_backend triton). Each is checked against "gathered", and for whether a
query's result is the same bits alone (a decode) as at the end of a block (what keeps
speculative decoding equal to target-only decoding).
Also the floor: the bytes of K/V read once over the measured bandwidth.

    python -m bench.round_attention [--keys 32768 131072] [--seqs 1 8] [--widths 1 16]
        [--forms gathered triton]
        [--launch SPLIT,BM,BN,WARPS,STAGES[,CHUNK[,MAX_SPLITS[,SPLIT_RATIO[,SMALL_ROWS]]]] ...]
        [--out result.json]

"triton" runs the engine's launch shape (target/kernels/selection.py ATTENTION_LAUNCH); --launch
adds the Triton kernel at each given launch shape (target/kernels/attention_triton.py Launch;
the last fields max_splits, 0 for the fixed split, split_ratio, 0 for none, and small_rows, 0
for none) as a form "triton_<shape>", to choose the default.

Shapes: the 35B-A3B's full-attention layer at TP 1 (16 query heads over 2 kv heads of 256),
bf16, pages of 16 in shuffled order, every sequence at the full context. Times are CUDA-graph
replays of REPS calls, as the engine's steps run: eager calls would time the host's launches
(~0.1 ms), not the kernels, at short context.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

import torch

from bench.timing import graphed
from target.kernels import attention as attn
from target.kernels import attention_triton, selection

HEADS, KV_HEADS, DIM, PAGE_SIZE = 16, 2, 256, 16


def inputs(seqs: int, width: int, keys: int, device, dtype):
    """q [S·W, Hq, D], the caches [S·K/page_size, page_size, Hkv, D], tables
    [S, K/page_size] (shuffled), seq_lens [S] = keys."""
    g = torch.Generator(device=device).manual_seed(seqs * 7 + width + keys)
    pages = -(-keys // PAGE_SIZE)
    q = torch.randn(seqs * width, HEADS, DIM, device=device, generator=g).to(dtype)
    k = torch.randn(seqs * pages, PAGE_SIZE, KV_HEADS, DIM, device=device, generator=g).to(dtype)
    v = torch.randn(seqs * pages, PAGE_SIZE, KV_HEADS, DIM, device=device, generator=g).to(dtype)
    order = torch.randperm(seqs * pages, device=device, generator=g)
    tables = order.view(seqs, pages).to(torch.int32)
    lens = torch.full((seqs,), keys, dtype=torch.int32, device=device)
    return q, k, v, tables, lens


def gathered(q, k, v, tables, lens, scale):
    return attn.paged_attention_gathered(q, k, v, lens, tables, scale)


def triton_form(q, k, v, tables, lens, scale, launch=None):
    """The Triton kernel at `launch`, by default the engine's (selection.ATTENTION_LAUNCH)."""
    width = q.shape[0] // tables.shape[0]
    return attention_triton.paged_attention(q, k, v, tables, lens - width, lens, scale,
                                            launch=launch or selection.ATTENTION_LAUNCH)


FORMS = {"gathered": gathered, "triton": triton_form}


REPS = 10  # calls per captured graph: one replay's launch cost spread over them


def time_ms(fn, iters: int, warmup: int) -> float:
    """The median time of one call, from replays of a graph of REPS calls."""
    replay = graphed([fn] * REPS)
    for _ in range(warmup):
        replay()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / REPS)
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 16])
    p.add_argument("--forms", nargs="+", choices=list(FORMS), default=list(FORMS))
    p.add_argument("--launch", nargs="*", default=[],
                   help="more Triton launch shapes: "
                        "split,block_m,block_n,warps,stages"
                        "[,chunk[,max_splits[,split_ratio[,small_rows]]]]")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out")
    args = p.parse_args(argv)
    device, dtype, scale = torch.device(args.device), torch.bfloat16, DIM**-0.5
    forms = {name: FORMS[name] for name in args.forms}
    for shape in args.launch:
        launch = attention_triton.Launch.parse(shape)
        forms[f"triton_{shape.replace(',', '_')}"] = partial(triton_form, launch=launch)
    bandwidth = None
    if device.type == "cuda":
        from bench.floors import measure_bandwidth

        bandwidth = measure_bandwidth(device, nbytes=2 << 30)
    results = []
    for keys in args.keys:
        for seqs in args.seqs:
            for width in args.widths:
                q, k, v, tables, lens = inputs(seqs, width, keys, device, dtype)
                row = {"keys": keys, "seqs": seqs, "width": width}
                if bandwidth:  # K and V of every sequence read once
                    kv_bytes = 2 * seqs * keys * KV_HEADS * DIM * dtype.itemsize
                    row["floor_ms"] = kv_bytes / bandwidth * 1e3
                want = None
                for name, fn in forms.items():
                    try:
                        got = fn(q, k, v, tables, lens, scale)
                        if want is None:
                            want = got.float()
                        row[f"{name}_max_diff"] = (got.float() - want).abs().max().item()
                        # each sequence's last query alone (a decode) against in the block
                        last = q.view(seqs, width, HEADS, DIM)[:, -1]
                        alone = fn(last.contiguous(), k, v, tables, lens, scale)
                        in_block = got.view(seqs, width, HEADS, DIM)[:, -1]
                        row[f"{name}_row_invariant"] = bool(torch.equal(alone, in_block))
                        if device.type == "cuda":
                            row[f"{name}_ms"] = time_ms(partial(fn, q, k, v, tables, lens, scale),
                                                        args.iters, 3)
                    except Exception as e:  # report the form that cannot run, go on
                        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                results.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "bandwidth_GBps":
                                              bandwidth and bandwidth / 1e9,
                                              "results": results}, indent=1))


if __name__ == "__main__":
    main()
