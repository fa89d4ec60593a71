"""Step latencies of the in-process engine parts (no Ray, no HTTP) against their memory-bound
floors and transformers, in one run:

    python -m bench.engine --random-weights --preset qwen3.5-35b-a3b --device cuda \
        --batch-sizes 1 8 32 --block-sizes 8 16 --out engine.json
    python -m bench.engine --model DIR --draft-model DIR ...      # a real checkpoint pair

Per batch size: prefill throughput (prompt-len tokens per sequence in one step), the
autoregressive decode step (a 1-token verify: forward + greedy accept + commit), the verify
step for each B (random drafts), the draft's proposal for each B, one whole round (propose +
verify + context write), and the floor of each step (bytes moved / bandwidth measured here).
At batch 1 also transformers' `Qwen3_5MoeForCausalLM` decoding over the same weights. The
projected DFlash speedup is τ · (t_decode + o_AR) / (t_round(B) + o_round) for each τ, where o
is the engine's host bookkeeping per step measured with instant runners (`engine_overhead_ms`).
Medians over --iters; every step's time is in the JSON too. With CUDA
graphs each run ends by replaying its captured decode and verify back to back (with their
logits and argmax, no host work between): the "GPU ms" columns, the device's share of the
step; the rest of the step's time the GPU waits on the host.

    python -m bench.engine --random-weights --preset qwen3.5-35b-a3b --device cuda --tp 2 ...

runs the same steps through the cluster path instead (Ray workers, NCCL, the draft actor) and
adds the all-reduce per decoder layer against the bus bandwidth: bench/engine_cluster.py.

    python -m bench.engine --random-weights ... --acceptance 6.3 --output-len 128

generates instead, plain decoding against DFlash at that acceptance (the draft's proposals
replayed from the target's recorded output, draft/replay.py): bench/acceptance.py."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from bench.floors import cache_bytes, measure_bandwidth, record_routing, sync, weight_bytes
from bench.random_model import (
    add_kernel_args,
    build_draft,
    build_target,
    kernel_config,
    set_kernels,
    transformers_twin,
)
from bench.steps import Batch, time_steps
from bench.timing import sample_times
from cluster.engine import EnginePlan, LLMEngine
from cluster.executor import LocalExecutor
from configs.engine import EngineConfig, SamplingParams
from configs.presets import draft_preset, target_preset
from draft.proposer import DraftRunner
from workers.messages import ContextWrite, ProposeRequest
from workers.model_runner import SeqInput, StepOutput


@torch.inference_mode()  # as the runner's steps
def device_only_ms(graphs, model, rows: int, width: int, iters: int) -> dict | None:
    """The device's share of a round of `width` tokens a sequence: its captured forward (and
    commit) replayed `iters` times back to back with the logits GEMM and argmax a step runs
    after them, no host work between (no inputs built, no sync, no acceptance). `gpu_ms`:
    the GPU's time per step over them (CUDA events); `launch_ms`: the host's per step to
    queue them. A step's wall time minus `gpu_ms` is what the GPU waits on the host for.
    None without a captured shape of that width (CPU, eager). Replays advance the GDN states
    the graph's inputs point at: run it after the run's timings, not between them. The
    replays take the inputs of the last step of that width: run one of the kind timed just
    before (a verify's routing, so its experts' bytes, follows its tokens: a round's draft
    tokens may reach fewer distinct experts than random drafts)."""
    steps = [step for (_, w, _), step in (graphs.steps.items() if graphs else []) if w == width]
    if not steps:
        return None
    step = steps[-1]  # the most recently used shape of that width

    def run() -> None:
        step.forward.graph.replay()
        if step.commit is not None:
            step.commit.graph.replay()
        model.compute_logits(step.forward.outputs[0][:rows], False).argmax(-1)

    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    t = time.perf_counter()
    for _ in range(iters):
        run()
    launch_s = time.perf_counter() - t
    end.record()
    end.synchronize()
    return {"gpu_ms": start.elapsed_time(end) / iters, "launch_ms": launch_s / iters * 1e3}


def floor_ms(target, batch: Batch, step, num_tokens: int, query_len: int, bw: float) -> float:
    ctx = list(batch.num_cached)
    runner = batch.executor.runner
    graphs, runner.graphs = runner.graphs, None  # the hooks run only eagerly
    try:
        with record_routing(target) as routed:
            step()
    finally:
        runner.graphs = graphs
    nbytes = weight_bytes(target, routed, num_tokens) + cache_bytes(target, ctx, query_len)
    return nbytes / bw * 1e3


# The engine's host bookkeeping per round (scheduler, sequences, step messages, stop
# checks, outputs), with a runner and drafter that return at once behind the in-process
# executor: the o of the projected speedup. It measures Python, not kernels.


class InstantRunner:
    """Accepts `accept` drafts per round and emits token 1 (never EOS)."""

    def __init__(self, accept: int):
        self.accept = accept

    def prefill(self, seqs: list[SeqInput]) -> StepOutput:
        n = [len(s.token_ids) for s in seqs]
        return StepOutput([[1] if s.sample else [] for s in seqs], [0] * len(seqs), n, None,
                          torch.zeros(sum(n), dtype=torch.long))

    def verify(self, seqs: list[SeqInput]) -> StepOutput:
        k = [min(self.accept, len(s.token_ids) - 1) for s in seqs]
        toks = [s.token_ids[1 : a + 1] + [1] for s, a in zip(seqs, k, strict=True)]
        return StepOutput(toks, k, [a + 1 for a in k], None,
                          torch.zeros(sum(a + 1 for a in k), dtype=torch.long))

    def release(self, seq_id: int) -> None:
        pass

    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        pass


class InstantDrafter:
    def __init__(self, block: int):
        self.block = block

    def propose(self, req: ProposeRequest, top_k: int = 0,
                block_size: int | None = None) -> torch.Tensor:
        block = self.block if block_size is None else block_size
        return torch.full((len(req.anchors), block - 1), 2, dtype=torch.long)

    def write_context(self, write: ContextWrite) -> None:
        pass


def engine_overhead_ms(plan: EnginePlan, batch: int, block: int, accept: int,
                       rounds: int = 50) -> float:
    """Median host milliseconds of one LLMEngine.step() (a round) for `batch` sequences."""
    page_size = 16
    plan = replace(plan, block_size=block, max_model_len=1 << 20,
                   num_pages=batch * (-(-(64 + rounds * 4 * block) // page_size) + 1))
    cfg = EngineConfig(model="(none)", max_num_seqs=batch, page_size=page_size,
                       max_num_batched_tokens=1 << 20)
    engine = LLMEngine(cfg, LocalExecutor(InstantRunner(accept), InstantDrafter(block)), plan)
    params = SamplingParams(max_tokens=rounds * 4 * block, ignore_eos=True)
    for i in range(batch):
        engine.add_request(list(range(2, 66)), params, f"r{i}")
    engine.step()  # the prefill
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        engine.step()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples[5:])


def bench_batch(target, draft, b: int, args, bw: float, device: torch.device,
                floors: dict | None = None) -> dict:
    """`floors`: the floor figures of an earlier run of the same batch and model (a kernel
    variant's steps move the same bytes): reused, not measured again."""
    plan = EnginePlan(target.config, draft.cfg, max(args.block_sizes), 1 << 20, 1, 1)
    steps_per_kind = args.warmup + args.iters + 1
    max_new = steps_per_kind * (2 + 3 * len(args.block_sizes)) * max(args.block_sizes)
    aux_ids = tuple(draft.cfg.target_layer_ids)
    graphs = device.type == "cuda" and not args.enforce_eager
    pages = -(-(args.prompt_len + max_new) // args.page_size)
    drafter = DraftRunner(draft, b * pages, args.page_size, max(args.block_sizes),
                          target.embed, target.compute_logits, device,
                          graph_max_seqs=b if graphs else 0, graph_max_pages=pages)
    batch = Batch.in_process(target, drafter, aux_ids, b, args.prompt_len, max_new,
                             args.page_size, device, graphs)

    def set_block(B: int) -> None:
        drafter.block_size = B

    before = gpu_state(device)
    r = time_steps(batch, args, lambda: sync(device), args.block_sizes, set_block)
    r["gpu_state"] = {"before": before, "after": gpu_state(device)}
    if floors is not None:
        r.update(floors)
    else:
        r["decode_floor_ms"] = floor_ms(target, batch, lambda: batch.verify([[]] * b), b, 1, bw)
    for B in args.block_sizes:
        if floors is None:
            r[f"verify_B{B}_floor_ms"] = floor_ms(
                target, batch, lambda B=B: batch.verify(batch.random_drafts(B - 1)), b * B,
                B, bw)
        # The engine's own host work per round (scheduler, sequences, outputs), measured with
        # instant runners at the acceptance τ implies; the AR baseline pays it too (B = 1).
        r[f"engine_overhead_B{B}_ms"] = {
            str(tau): engine_overhead_ms(plan, b, B, min(B - 1, round(tau) - 1))
            for tau in args.taus}
        r["engine_overhead_AR_ms"] = engine_overhead_ms(plan, b, 1, 0)
        r[f"projected_speedup_B{B}"] = {
            str(tau): tau * (r["decode_ms"] + r["engine_overhead_AR_ms"])
            / (r[f"round_B{B}_ms"] + r[f"engine_overhead_B{B}_ms"][str(tau)])
            for tau in args.taus}
    failed = {f"round {k}": v for k, v in batch.executor.runner.graphs.failed.items()} \
        if graphs else {}
    failed.update({f"proposal {k}": v for k, v in drafter.failed.items()})
    r["graph_failures"] = failed  # shapes that ran eagerly: their capture failed
    # the device's share of a decode and of a verify (last: the replays move GDN states),
    # each after one more step of its kind, whose inputs the replays then take (a verify's
    # random drafts, as its timed steps had, not the last round's draft tokens)
    r["device_only"] = {}
    for name, width, step in [("decode", 1, lambda: batch.verify([[]] * b)),
                              *((f"verify_B{B}", B,
                                 lambda B=B: batch.verify(batch.random_drafts(B - 1)))
                                for B in args.block_sizes)]:
        if graphs:
            step()
        r["device_only"][name] = device_only_ms(batch.executor.runner.graphs, target,
                                                b * width, width, args.iters)
    return r


def state_table(results: dict) -> str:
    """Each run's gpu_state, before and after its timings, as a markdown table."""
    def cell(state: dict | None, key: str) -> str:
        value = (state or {}).get(key)
        return "-" if value is None else f"{value:.1f}" if key == "reserved_gib" else f"{value:.0f}"

    keys = ("sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_w", "reserved_gib",
            "segments")
    rows = ["| variant | batch | context | SM MHz before / after | memory MHz before / after | "
            "°C before / after | W before / after | reserved GiB before / after | "
            "segments before / after |", "|---" * (3 + len(keys)) + "|"]
    for r in results["ours"]:
        st = r.get("gpu_state") or {}
        rows.append(f"| {r.get('variant', 'baseline')} | {r['batch']} | "
                    f"{r.get('prompt_len', '')} | "
                    + " | ".join(f"{cell(st.get('before'), k)} / {cell(st.get('after'), k)}"
                                 for k in keys) + " |")
    return "\n".join(rows)


def _memory_clock(device: torch.device) -> int:
    """The GPU's memory clock (MHz) through NVML, by the handle torch.cuda's own queries use."""
    import pynvml

    return pynvml.nvmlDeviceGetClockInfo(torch.cuda._get_pynvml_handler(device),
                                         pynvml.NVML_CLOCK_MEM)


def gpu_state(device: torch.device) -> dict | None:
    """The GPU's SM and memory clocks (MHz), temperature (°C) and power draw (W) now, where
    NVML answers (None for a figure it cannot give), and the caching allocator's reserved GiB
    and segments; None on CPU. A run's figures drift within a process (docs/BENCHMARKS.md),
    so each run records these before and after its
    timings."""
    if device.type != "cuda":
        return None
    state = {}
    for name, query, scale in (("sm_clock_mhz", torch.cuda.clock_rate, 1),
                               ("mem_clock_mhz", _memory_clock, 1),
                               ("temperature_c", torch.cuda.temperature, 1),
                               ("power_w", torch.cuda.power_draw, 1e-3)):
        try:
            state[name] = query(device) * scale
        except Exception:  # no NVML (pynvml / amdsmi) on this host
            state[name] = None
    state["reserved_gib"] = torch.cuda.memory_reserved(device) / 2**30
    state["segments"] = torch.cuda.memory_stats(device).get("segment.all.current", 0)
    return state


@torch.inference_mode()
def bench_transformers(hf, device: torch.device, prompt_len: int, vocab: int, args) -> dict:
    ids = torch.randint(0, vocab, (1, prompt_len), device=device)
    sync(device)
    t = time.perf_counter()
    out = hf(input_ids=ids, use_cache=True)
    sync(device)
    prefill_ms = (time.perf_counter() - t) * 1e3
    state = {"past": out.past_key_values, "tok": out.logits[:, -1:].argmax(-1)}

    def step():
        o = hf(input_ids=state["tok"], past_key_values=state["past"], use_cache=True)
        state["past"], state["tok"] = o.past_key_values, o.logits[:, -1:].argmax(-1)

    samples, _ = sample_times(step, args.iters, args.warmup, lambda: sync(device))
    decode_ms = statistics.median(samples) * 1e3
    return {"batch": 1, "prefill_ms": prefill_ms, "decode_ms": decode_ms}


def table(results: dict) -> str:
    """The runs as a markdown table; "GPU ms": a step's device share (device_only_ms), "-"
    where nothing was captured."""
    def gpu(r: dict, name: str) -> str:
        d = (r.get("device_only") or {}).get(name)
        return "-" if d is None else f"{d['gpu_ms']:.2f}"

    rows = ["| variant | batch | context | prefill tok/s | decode ms (floor) | decode GPU ms | "
            + " | ".join(f"verify B={B} ms (floor) | verify B={B} GPU ms | draft B={B} ms | "
                         f"round B={B} ms" for B in results["args"]["block_sizes"]) + " |"]
    for r in results["ours"]:
        cells = [r.get("variant", "baseline"), str(r["batch"]), str(r.get("prompt_len", "")),
                 f"{r['prefill_tok_per_s']:.0f}",
                 f"{r['decode_ms']:.2f} ({r['decode_floor_ms']:.2f})", gpu(r, "decode")]
        for B in results["args"]["block_sizes"]:
            cells += [f"{r[f'verify_B{B}_ms']:.2f} ({r[f'verify_B{B}_floor_ms']:.2f})",
                      gpu(r, f"verify_B{B}"), f"{r[f'draft_B{B}_ms']:.2f}",
                      f"{r[f'round_B{B}_ms']:.2f}"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--random-weights", action="store_true")
    src.add_argument("--model", help="target checkpoint directory")
    p.add_argument("--draft-model", help="draft checkpoint (with --model)")
    p.add_argument("--preset", default="qwen3.5-35b-a3b", help="with --random-weights")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--block-sizes", type=int, nargs="+", default=[8, 16])
    p.add_argument("--prompt-len", type=int, nargs="+", default=[512], dest="prompt_lens",
                   help="context before the timed steps; several: each in turn, one model")
    p.add_argument("--prefill-chunk", type=int, default=8192,
                   help="prompt tokens per prefill step over the batch (the engine's "
                        "max_num_batched_tokens default); 0: the whole prompts in one step")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--taus", type=float, nargs="+", default=[3.0, 5.0, 6.3])
    p.add_argument("--no-baseline", action="store_true", help="skip transformers")
    p.add_argument("--out", help="write the JSON here (rewritten after each batch size)")
    # Kernel choices, to measure each fast path against the others in the same build.
    add_kernel_args(p)
    p.add_argument("--variants", nargs="+", default=[], metavar="FIELD=VALUE[,…]",
                   help="also measure each of these kernel variants (KernelConfig fields over "
                        "the flags above, e.g. moe=sorted) in this process, after the "
                        "flags' own kernels at every batch size: a same-run A/B")
    p.add_argument("--draft-placement", choices=["colocated", "separate"],
                   default="colocated", help="with --tp: the draft on rank 0's GPU or on one "
                   "of its own (aux features over NCCL)")
    p.add_argument("--tp", type=int, help="through the cluster path with N tensor-parallel "
                   "Ray workers and the draft actor (bench/engine_cluster.py); no floors, "
                   "no baseline; of the kernel switches only --attention, --moe and "
                   "--enforce-eager apply (the engine's own settings)")
    p.add_argument("--control-channel", choices=["auto", "shm", "tcp"], default="auto",
                   help="with --tp: what carries the step messages (EngineConfig)")
    p.add_argument("--control-spin-us", type=int, default=None,
                   help="with --tp: spin before sleeping on the channel (default: by core count)")
    a = p.add_argument_group("generation at a chosen acceptance (bench/acceptance.py)")
    a.add_argument("--acceptance", metavar="SPEC", nargs="+",
                   help="instead of the step timings: plain decoding against DFlash (the "
                        "largest --block-sizes) generating at each of these acceptances, a "
                        "mean length (6.3) or per-position probabilities (a JSON list or a "
                        "file), through the whole in-process engine; the first --prompt-len")
    a.add_argument("--output-len", type=int, default=128, help="with --acceptance")
    a.add_argument("--adaptive", action="store_true",
                   help="with --acceptance: also the adaptive draft length")
    a.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="with --acceptance: the engine's")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The parser's namespace plus `prompt_len` (the context being measured: the first of
    --prompt-len until main moves on) and `prefill_chunk` None for whole-prompt steps."""
    args = parser().parse_args(argv)
    args.prompt_len = args.prompt_lens[0]
    args.prefill_chunk = args.prefill_chunk or None
    if args.tp is not None and len(args.prompt_lens) > 1:
        raise SystemExit("--tp measures one --prompt-len per run")
    if args.tp is not None and args.variants:
        raise SystemExit("--variants measures in process; with --tp run one process each")
    return args


def main(argv: list[str] | None = None) -> None:
    import sys

    args = parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.acceptance is not None:
        from bench import acceptance

        acceptance.run(args)
        return
    for variant in args.variants:  # a typo fails now, not after the first measurements
        kernel_config(args, variant)
    if args.tp is not None:
        from bench import engine_cluster

        results = engine_cluster.run(args)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
        print(engine_cluster.table(results))
        return
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if args.random_weights:
        raw = target_preset(args.preset)
        target = build_target(raw, dtype, device)
        draft = build_draft(draft_preset(args.preset), dtype, device, max(args.block_sizes))
    else:
        from draft.model import DFlashDraftModel
        from target.loader import load_target

        raw = None
        target = load_target(args.model, dtype=dtype, device=device)
        draft = DFlashDraftModel.from_pretrained(args.draft_model, dtype=dtype, device=device,
                                                 block_size=max(args.block_sizes))
    set_kernels(target, draft, args, device)
    bw = measure_bandwidth(device, nbytes=(2 << 30) if device.type == "cuda" else (64 << 20))
    results = {"args": vars(args), "device": torch.cuda.get_device_name(device)
               if device.type == "cuda" else "cpu", "torch": torch.__version__,
               "bandwidth_GBps": bw / 1e9, "ours": [], "transformers": None}

    def save() -> None:
        if args.out:
            with open(args.out, "w") as f:
                json.dump(results, f, indent=1)

    runs = [(n, b) for n in args.prompt_lens for b in args.batch_sizes]
    for i, (n, b) in enumerate(runs):
        args.prompt_len = n
        floors = None
        for variant in ["", *args.variants]:
            set_kernels(target, draft, args, device, variant)
            results["ours"].append({"variant": variant or "baseline",
                                    **bench_batch(target, draft, b, args, bw, device, floors)})
            floors = {k: v for k, v in results["ours"][-1].items() if k.endswith("_floor_ms")}
            print(json.dumps(results["ours"][-1]), flush=True)
            save()
            if device.type == "cuda":  # this context's caches and graphs go before the next
                # (the captured rounds keep closures over their RoundGraphs, a cycle that only
                # a collection frees, with the caches it holds; a third variant at 131,072
                # tokens ran out of memory on an 80 GB H100 without it)
                gc.collect()
                torch.cuda.empty_cache()
        if i == 0 and not args.no_baseline and raw is not None:  # early: the slow part
            hf = transformers_twin(target, raw)
            results["transformers"] = bench_transformers(hf, device, args.prompt_len,
                                                         target.config.vocab_size, args)
            del hf
            print(json.dumps(results["transformers"]), flush=True)
            save()
    print(table(results))
    if device.type == "cuda":
        print(state_table(results))


if __name__ == "__main__":
    main()
