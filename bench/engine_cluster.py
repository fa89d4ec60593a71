"""`bench/engine.py --tp N`: the engine's steps through the cluster path — N tensor-parallel
TargetWorker actors (NCCL on GPUs, gloo on CPU) and the DFlash draft actor, each in its step
loop, driven from this process through the engine's ChannelExecutor exactly as the driver
drives them (the same `Batch` and step messages as the in-process run) — for each batch size:
prefill throughput, decode, verify for each B, the draft's proposal and a whole round at the
engine's B (the largest given), and the all-reduce each decoder layer issues twice per step,
timed on the workers' own group against the bus bandwidth measured there in the same run.

Times include the control channel's hops.
`--random-weights --preset P` writes P's config.json files to a temporary directory and loads
them with `load_format="dummy"` (target/dummy.py: the same weights at every TP size);
`--model/--draft-model` load checkpoints. Both need every node to see the directories: run it
on one host."""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch

from configs.engine import EngineConfig
from configs.presets import write_preset_dirs


def _model_dirs(args, tmp: Path) -> tuple[str, str, str]:
    if not args.random_weights:
        if not args.draft_model:
            raise ValueError("--tp with --model needs --draft-model")
        return args.model, args.draft_model, "auto"
    target, draft = write_preset_dirs(args.preset, tmp)
    return str(target), str(draft), "dummy"


def run(args) -> dict:
    import ray

    from cluster.ray_executor import RayEngineCluster

    big_b, big_block = max(args.batch_sizes), max(args.block_sizes)
    steps = args.warmup + args.iters + 1
    max_new = steps * (2 + len(args.block_sizes) + 1) * big_block
    pages = -(-(args.prompt_len + max_new) // args.page_size)
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    results: dict = {"args": vars(args), "tp": args.tp, "path": "cluster", "ours": []}
    with tempfile.TemporaryDirectory() as tmp:
        model, draft_model, load_format = _model_dirs(args, Path(tmp))
        cfg = EngineConfig(
            model=model, draft_model=draft_model, block_size=big_block, device=args.device,
            dtype=args.dtype, max_num_seqs=big_b, max_model_len=pages * args.page_size,
            allow_long_max_model_len=True,  # sized by the steps timed, not by the model
            page_size=args.page_size, num_pages=big_b * pages,
            max_num_batched_tokens=max(big_b * args.prompt_len, 8192),
            enforce_eager=args.enforce_eager, load_format=load_format,
            draft_placement=args.draft_placement, control_channel=args.control_channel,
            control_spin_us=args.control_spin_us, attention_backend=args.attention,
            moe_backend=args.moe)
        t = time.perf_counter()
        cluster = RayEngineCluster(cfg, args.tp)
        results["start_s"] = time.perf_counter() - t  # load, profile, allocate, warm up
        try:
            tcfg = cluster.plan.target_config
            results["device"] = args.device
            results["layers"] = tcfg.num_hidden_layers
            results["channel"] = cluster.channel_kind
            results["spin_us"] = cfg.control_spin_s * 1e6
            results["warmup"] = cluster.engine.warmup
            for b in args.batch_sizes:
                results["ours"].append(_bench_batch(cluster, b, args, max_new, tcfg))
                print(json.dumps(results["ours"][-1]), flush=True)
        finally:
            cluster.shutdown()
    return results


def _bench_batch(cluster, b: int, args, max_new: int, tcfg) -> dict:
    from bench.steps import Batch, time_steps

    batch = Batch(cluster.executor, b, args.prompt_len, max_new, args.page_size,
                  tcfg.vocab_size)
    B = max(args.block_sizes)
    # The executor's results have come back: the actors are done with each step.
    r = time_steps(batch, args, None, [B])
    r["tp"] = args.tp
    if args.tp > 1:
        bus_bytes = (256 << 20) if args.device.startswith("cuda") else (16 << 20)
        ar = cluster.call_workers("time_all_reduce", [b, b * B], args.iters * 10, bus_bytes)
        elem = torch.empty((), dtype=getattr(torch, args.dtype)).element_size()
        per_step = {}
        for tokens, us in ar["all_reduce_us"].items():
            nbytes = int(tokens) * tcfg.hidden_size * elem
            floor_us = 2 * (args.tp - 1) / args.tp * nbytes / (ar["bus_GBps"] * 1e9) * 1e6
            # two per decoder layer per step
            per_step[tokens] = {"us_per_call": us, "bus_floor_us_per_call": floor_us,
                                "ms_per_step": 2 * tcfg.num_hidden_layers * us / 1e3}
        r["all_reduce"] = {"bus_GBps": ar["bus_GBps"], "bus_bytes": ar["bus_bytes"],
                           "by_tokens": per_step}
    batch.release()
    return r


def table(results: dict) -> str:
    B = max(results["args"]["block_sizes"])
    blocks = results["args"]["block_sizes"]
    rows = [f"TP {results['tp']} through the cluster path (Ray workers + draft actor, control "
            f"channel {results['channel']})", "",
            "| batch | prefill tok/s | decode ms | " + " | ".join(
                f"verify B={x} ms" for x in blocks) + f" | draft B={B} ms | round B={B} ms | "
            "all-reduce µs/call (decode / verify) | all-reduce ms/step (decode) | bus GB/s |",
            "|" + "---|" * (8 + len(blocks))]
    for r in results["ours"]:
        ar = r.get("all_reduce")
        if ar:
            calls = " / ".join(f"{v['us_per_call']:.0f}" for v in ar["by_tokens"].values())
            first = next(iter(ar["by_tokens"].values()))
            ar_cols = f"{calls} | {first['ms_per_step']:.2f} | {ar['bus_GBps']:.1f}"
        else:
            ar_cols = "- | - | -"
        rows.append(f"| {r['batch']} | {r['prefill_tok_per_s']:.0f} | {r['decode_ms']:.2f} | "
                    + " | ".join(f"{r[f'verify_B{x}_ms']:.2f}" for x in blocks)
                    + f" | {r[f'draft_B{B}_ms']:.2f} | {r[f'round_B{B}_ms']:.2f} | {ar_cols} |")
    return "\n".join(rows)
