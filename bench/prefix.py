"""The prefix cache in process (no Ray, no HTTP): one conversation's time to first token per
turn with the cache and without it, each turn's prefill steps, and its rounds' times, in one
run:

    python -m bench.prefix --preset qwen3.5-35b-a3b --device cuda --max-model-len 32768 \
        --max-num-seqs 8 --gpu-memory-utilization 0.97 --out prefix.json
    python -m bench.prefix --model DIR --draft-model DIR ...     # a checkpoint pair

The conversation is bench/serving.py's multi-turn workload: token-id prompts, a --history-len
history, then --turns turns, each adding --turn-len tokens to everything before (the earlier
answers included) and generating --output-len tokens (greedy, ignore_eos), after a warm-up
conversation of --warmup-turns turns with other tokens (kernels compile and tune on their first
use; the warm-up's snapshots stay in the cache, as other users' would). The engine is built
twice, one after the other, without the cache and with it (random weights of --preset's
architecture, or the checkpoints given); both run the same turns. Per turn: prompt and cached
tokens, the time to the first token (from add_request to the step that returns it, the device
synced), its prefill steps (chunk lengths, wall ms) and the median wall time of its rounds.
The summary: each turn's TTFT with the cache over the TTFT of the same prompt without it, and
the rounds' median time with and without the cache (the cache should not change it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def conversation_turns(engine, args: argparse.Namespace, *, seed: int, turns: int,
                       label: str = "turn") -> list[dict]:
    """The multi-turn workload through `engine`, one step at a time."""
    from configs.engine import SamplingParams

    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(args.token_id_min, args.token_id_max)  # noqa: E731
                     for _ in range(n)]
    history, done = ids(args.history_len), []
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    for turn in range(1, turns + 1):
        history += ids(args.turn_len)
        sync(args.device)
        start = time.perf_counter()
        engine.add_request(list(history), params)
        ttft, prefill, rounds, final = None, [], [], None
        while engine.has_unfinished():
            t = time.perf_counter()
            engine.begin_step()
            plan = engine.step_in_flight
            outs = engine.finish_step()
            sync(args.device)
            ms = 1e3 * (time.perf_counter() - t)
            if plan.prefill:
                prefill.append({"chunks": list(plan.chunk_lens), "ms": ms})
            else:
                rounds.append(ms)
            for o in outs:
                if ttft is None and o.new_token_ids:
                    ttft = time.perf_counter() - start
                if o.finished:
                    final = o
        history += final.output_ids
        done.append({"turn": turn, "prompt_tokens": len(final.prompt_ids),
                      "cached_tokens": final.num_cached_tokens, "ttft_ms": 1e3 * ttft,
                      "prefill_steps": prefill,
                      "round_ms_median": statistics.median(rounds) if rounds else None})
        print(f"  {label} {turn}: {len(final.prompt_ids)} prompt tokens "
              f"({final.num_cached_tokens} cached), TTFT {1e3 * ttft:.1f} ms, prefill "
              + " ".join(f"{p['chunks']}:{p['ms']:.1f}" for p in prefill)
              + (f", rounds {statistics.median(rounds):.2f} ms" if rounds else ""), flush=True)
    return done


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(args: argparse.Namespace) -> dict:
    import gc

    from cluster.engine import LLMEngine
    from configs.engine import EngineConfig

    model, draft, load_format = args.model, args.draft_model, "auto"
    if model is None:
        from configs.presets import write_preset_dirs

        root = Path(tempfile.mkdtemp(prefix="bench-prefix-"))
        model, draft = map(str, write_preset_dirs(args.preset, root))
        load_format = "dummy"
    out = {"command": "python -m bench.prefix " + " ".join(args.argv), "args": vars(args)}
    for name, on in (("off", False), ("on", True)):
        t = time.perf_counter()
        engine = LLMEngine(EngineConfig(
            model=model, draft_model=draft, block_size=args.block_size, device=args.device,
            dtype=args.dtype, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
            gpu_memory_utilization=args.gpu_memory_utilization, load_format=load_format,
            page_size=args.page_size, enable_prefix_caching=on))
        print(f"cache {name}: engine up in {time.perf_counter() - t:.0f} s", flush=True)
        if args.warmup_turns:  # kernels compile and tune on first use: not in the figures
            conversation_turns(engine, args, seed=args.seed + 1, turns=args.warmup_turns,
                               label="warm-up turn")
        out[name] = {"turns": conversation_turns(engine, args, seed=args.seed, turns=args.turns),
                     "prefix_cache": dataclasses.asdict(engine.prefix_snapshot()) if on
                     else None}
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    out["summary"] = [
        {"turn": on_t["turn"], "ttft_on_over_off": on_t["ttft_ms"] / off_t["ttft_ms"],
         "round_ms_on": on_t["round_ms_median"], "round_ms_off": off_t["round_ms_median"]}
        for on_t, off_t in zip(out["on"]["turns"], out["off"]["turns"], strict=True)]
    for s in out["summary"]:
        rounds = (f", rounds {s['round_ms_on']:.2f} / {s['round_ms_off']:.2f} ms"
                  if s["round_ms_on"] is not None else "")
        print(f"turn {s['turn']}: TTFT with the cache {s['ttft_on_over_off']:.1%} of without"
              + rounds)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="qwen3.5-35b-a3b",
                     help="random weights of this architecture (configs/presets.py)")
    src.add_argument("--model", help="a target checkpoint instead")
    p.add_argument("--draft-model", help="with --model: its DFlash draft")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=32768)
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--history-len", type=int, default=16384)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--turn-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--token-id-min", type=int, default=10)
    p.add_argument("--token-id-max", type=int, default=300)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup-turns", type=int, default=2,
                   help="a conversation of the same shape (other tokens) first, not reported")
    p.add_argument("--out", help="write the JSON here")
    return p


def main(argv: list[str] | None = None) -> dict:
    import sys

    args = parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.model is not None and args.draft_model is None:
        raise SystemExit("--model needs --draft-model")
    return run(args)


if __name__ == "__main__":
    main()
