"""The attention of a captured round (or decode) at long context, each form on the same inputs:
the explicit fp32 scores, one masked SDPA call (memory-efficient kernel), and the keys in
slices with their log-sum-exp merged (`split_keys_attention`, several slice sizes). Also
checks each form against the explicit one and whether a row's result is the same alone as
in a block (what keeps speculative decoding equal to decoding).

    python -m bench.round_attention [--keys 32768 131072] [--seqs 1 8] [--widths 1 16]
        [--splits 2048 4096 8192] [--out result.json]

Shapes: the 35B-A3B's full-attention layer at TP 1 (16 query heads over 2 kv heads of 256),
bf16, every sequence at the full context.
"""

from __future__ import annotations

import argparse
import json
import statistics
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from target.kernels import attention as attn


def inputs(seqs: int, width: int, keys: int, device, dtype, heads=16, kv_heads=2, dim=256):
    g = torch.Generator(device=device).manual_seed(seqs * 7 + width + keys)
    group = heads // kv_heads
    qq = torch.randn(seqs, kv_heads, group * width, dim, device=device, generator=g).to(dtype)
    k = torch.randn(seqs, kv_heads, keys, dim, device=device, generator=g).to(dtype)
    v = torch.randn(seqs, kv_heads, keys, dim, device=device, generator=g).to(dtype)
    q_pos = keys - width + torch.arange(width, device=device)  # the block at the end
    mask = torch.arange(keys, device=device)[None, :] <= q_pos[:, None]  # [W, K]
    rows_mask = mask.repeat(group, 1)[None, None].expand(seqs, 1, -1, -1)
    return qq, k, v, rows_mask


def forms(splits: list[int]) -> dict:
    def explicit(qq, k, v, m, scale):
        scores = attn._scores_fp32(qq, k) * scale
        return torch.matmul(scores.masked_fill(~m, float("-inf")).softmax(-1).to(v.dtype), v)

    def sdpa(qq, k, v, m, scale):
        with sdpa_kernel(attn._MASKED_BACKENDS):
            return F.scaled_dot_product_attention(qq, k, v, attn_mask=m, scale=scale)

    out = {"explicit": explicit, "sdpa_masked": sdpa}
    for split in splits:
        out[f"split_{split}"] = partial(split_form, split=split)
    return out


def split_form(qq, k, v, m, scale, split):
    return attn.split_keys_attention(qq, k, v, m, scale, split)


def time_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--seqs", type=int, nargs="+", default=[1, 8])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 16])
    p.add_argument("--splits", type=int, nargs="+", default=[2048, 4096, 8192])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="cuda")
    p.add_argument("--out")
    args = p.parse_args(argv)
    device, dtype, scale = torch.device(args.device), torch.bfloat16, 256**-0.5
    results = []
    for keys in args.keys:
        for seqs in args.seqs:
            for width in args.widths:
                qq, k, v, m = inputs(seqs, width, keys, device, dtype)
                want = None
                row = {"keys": keys, "seqs": seqs, "width": width}
                for name, fn in forms(args.splits).items():
                    try:
                        got = fn(qq, k, v, m, scale)
                        if want is None:
                            want = got.float()
                        row[f"{name}_max_diff"] = (got.float() - want).abs().max().item()
                        # the last row alone (a decode's one query) against within the block
                        last = fn(qq[:, :, -1:], k, v, m[:, :, -1:], scale)
                        row[f"{name}_row_invariant"] = bool(torch.equal(last, got[:, :, -1:]))
                        if device.type == "cuda":
                            row[f"{name}_ms"] = time_ms(partial(fn, qq, k, v, m, scale),
                                                        args.iters, 3)
                    except Exception as e:  # report the form that cannot run, go on
                        row[f"{name}_error"] = f"{type(e).__name__}: {e}"[:300]
                results.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results},
                                             indent=1))


if __name__ == "__main__":
    main()
