"""DFlash at a chosen acceptance length against plain decoding, in process, on any weights:
`python -m bench.engine --acceptance SPEC` runs this instead of the step timings.

    python -m bench.engine --random-weights --preset qwen3.5-35b-a3b --device cuda \
        --acceptance 1 3 6.3 --adaptive --batch-sizes 1 8 32 --block-sizes 16 \
        --prompt-len 512 --output-len 128 --out acceptance.json

Each SPEC is an acceptance for the engine's replay (draft/replay.py): a mean acceptance length
τ such as 6.3, or per-position acceptance probabilities (a JSON list, or a file holding one).
One engine per mode, one after the other: plain decoding (no draft), DFlash with a fixed block
(the largest --block-sizes), and with --adaptive DFlash choosing each round's draft length
(EngineConfig.speculative_adaptive, its round costs measured at warm-up). A DFlash engine
takes each SPEC in turn (its replay's curve set in place). For each SPEC and batch size the
same token-id prompts (greedy, ignore_eos) run twice: the first pass warms up (the adaptive
rule's estimates too) and, the first time, records the target's outputs; the second is
measured, its proposals replayed from the recording. Per row: tokens/s per user (each
request's output tokens after its first over the time from its first token to its last,
median over the requests), total tokens/s (all output tokens over the pass), TTFT median, the
mean acceptance length the rounds reached, each DFlash mode's speedups over plain decoding,
and whether every mode's outputs are the same (they must be: the target verifies every
draft)."""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch


def measured_pass(engine, prompts: list[list[int]], output_len: int) -> dict:
    """The prompts at once through `engine`, one step at a time; per request its output and
    the times of its first and last token."""
    from configs.engine import SamplingParams

    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    sync()
    start = time.perf_counter()
    ids = [engine.add_request(p, params) for p in prompts]
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    final = {}
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            if o.new_token_ids:
                first.setdefault(o.request_id, now)
                last[o.request_id] = now
            if o.finished:
                final[o.request_id] = o
    wall = time.perf_counter() - start
    outputs = [final[i].output_ids for i in ids]
    rates = [(len(out) - 1) / (last[i] - first[i])
             for i, out in zip(ids, outputs, strict=True) if last[i] > first[i]]
    lengths = [n for i in ids for n in final[i].acceptance_lengths]
    return {"outputs": outputs,
            "tokens_per_s_per_user": statistics.median(rates) if rates else None,
            "tokens_per_s": sum(map(len, outputs)) / wall,
            "ttft_ms_p50": 1e3 * statistics.median(first[i] - start for i in ids),
            "rounds": len(lengths),
            "acceptance_length": sum(lengths) / len(lengths) if lengths else None,
            "wall_s": wall}


def run(args: argparse.Namespace) -> dict:
    from cluster.engine import LLMEngine
    from configs.engine import EngineConfig
    from draft.replay import AcceptanceCurve

    model, draft, load_format = args.model, args.draft_model, "auto"
    if args.random_weights:
        from configs.presets import write_preset_dirs

        root = Path(tempfile.mkdtemp(prefix="bench-acceptance-"))
        model, draft = map(str, write_preset_dirs(args.preset, root))
        load_format = "dummy"
    block = max(args.block_sizes)
    rng = random.Random(0)
    prompts = {b: [[rng.randrange(10, 300) for _ in range(args.prompt_len)] for _ in range(b)]
               for b in args.batch_sizes}
    results = {"command": "python -m bench.engine " + " ".join(args.argv),
               "device": torch.cuda.get_device_name() if args.device.startswith("cuda")
               else "cpu", "acceptance": args.acceptance, "block_size": block, "rows": []}
    measured: dict[tuple[str, str, int], dict] = {}  # (engine, acceptance, batch) → its pass
    names = ("plain", "dflash", "adaptive") if args.adaptive else ("plain", "dflash")
    for name in names:
        spec = name != "plain"
        engine = LLMEngine(EngineConfig(
            model=model, draft_model=draft if spec else None, block_size=block if spec else None,
            device=args.device, dtype=args.dtype, max_num_seqs=max(args.batch_sizes),
            max_model_len=args.prompt_len + args.output_len + 2 * block,
            page_size=args.page_size, load_format=load_format,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=False,  # each pass prefills its prompts whole
            acceptance_replay=args.acceptance[0] if spec else None,
            speculative_adaptive=name == "adaptive"))
        engine.warm_up()
        for acceptance in args.acceptance if spec else ["-"]:
            if spec:  # the engine's replay (in process: the executor's) draws from this curve
                engine.executor.draft.replay.curve = AcceptanceCurve.from_spec(acceptance,
                                                                               block - 1)
            for b in args.batch_sizes:
                # the first pass warms up (the adaptive rule's estimates too) and, the first
                # time, records the outputs the draft's proposals are replayed from
                measured_pass(engine, prompts[b], args.output_len)
                r = measured[name, acceptance, b] = measured_pass(engine, prompts[b],
                                                                  args.output_len)
                print(f"{name} at {acceptance}, batch {b}: {r['tokens_per_s_per_user']:.1f} "
                      f"tok/s per user, {r['tokens_per_s']:.1f} tok/s, acceptance length "
                      f"{r['acceptance_length'] or 1:.2f}", flush=True)
        del engine
        gc.collect()
        if args.device.startswith("cuda"):
            torch.cuda.empty_cache()
    for acceptance in args.acceptance:
        for b in args.batch_sizes:
            plain = measured["plain", "-", b]
            runs = [(n, measured[n, "-" if n == "plain" else acceptance, b]) for n in names]
            row = {"acceptance": acceptance, "batch": b,
                   "same_outputs": all(r["outputs"] == plain["outputs"] for _, r in runs)}
            for n, r in runs:
                row |= {f"{k}_{n}": v for k, v in r.items() if k != "outputs"}
                if n != "plain":
                    row[f"speedup_per_user_{n}"] = (r["tokens_per_s_per_user"]
                                                    / plain["tokens_per_s_per_user"])
                    row[f"speedup_total_{n}"] = r["tokens_per_s"] / plain["tokens_per_s"]
            results["rows"].append(row)
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))
    return results


def table(results: dict) -> str:
    spec = [n for n in ("dflash", "adaptive") if f"speedup_total_{n}" in results["rows"][0]]
    label = {"dflash": f"B = {results['block_size']}", "adaptive": "adaptive"}
    lines = [f"{results['device']}: tokens/s per user (and in total), plain decoding against "
             f"DFlash with replayed proposals",
             "| τ asked | batch | plain | " + " | ".join(
                 f"{label[n]} | speedup | τ reached" for n in spec) + " | outputs equal |",
             "|---" * (3 + 3 * len(spec)) + "|:---:|"]
    for r in results["rows"]:
        cells = [r["acceptance"], str(r["batch"]),
                 f"{r['tokens_per_s_per_user_plain']:.1f} ({r['tokens_per_s_plain']:.0f})"]
        for n in spec:
            cells += [f"{r[f'tokens_per_s_per_user_{n}']:.1f} ({r[f'tokens_per_s_{n}']:.0f})",
                      f"{r[f'speedup_per_user_{n}']:.2f}× ({r[f'speedup_total_{n}']:.2f}×)",
                      f"{r[f'acceptance_length_{n}']:.2f}"]
        lines.append("| " + " | ".join(cells) + f" | {'yes' if r['same_outputs'] else 'NO'} |")
    return "\n".join(lines)
