"""A long prompt through the engine against transformers on the same model: time to the first
token, total time and peak memory, each side in a process of its own.

    python -m bench.long_context --model DIR --prompt-len 32768 [--device cpu] [--max-tokens 8]
        [--no-transformers] [--out result.json]

Ours: `LLMEngine` (the in-process engine, chunked prefill at its default budget), greedy,
`--max-tokens` tokens. Transformers: `Qwen3_5MoeForCausalLM` (sdpa), one forward of the
prompt with its cache, then greedy decoding from it. Peak memory is the child's peak resident
set on CPU, the CUDA allocator's peak on a GPU; ours also reports what it held before the
prompt (`base_bytes`: the model, its caches, the runtime). A model whose
`max_position_embeddings` is shorter than the prompt is copied with a longer one
(`long_context_copy`; RoPE has no other length limit).
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def long_context_copy(model_dir: str | Path, out_dir: str | Path, context: int) -> Path:
    """The checkpoint in `model_dir` with max_position_embeddings raised to `context` (files
    linked, config rewritten)."""
    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (out / f.name).exists():
            (out / f.name).symlink_to(f.resolve())
    config = json.loads((src / "config.json").read_text())
    text = config.get("text_config", config)
    text["max_position_embeddings"] = max(context, text.get("max_position_embeddings", 0))
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


def prompt_ids(length: int, vocab: int) -> list[int]:
    return [1 + (i * 7919) % (vocab - 1) for i in range(length)]


def _peak_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.max_memory_allocated(device)
    # VmHWM: this address space's peak (ru_maxrss would carry a forking parent's over exec)
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def _current_bytes(device: str) -> int:
    if device.startswith("cuda"):
        import torch

        return torch.cuda.memory_allocated(device)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize(device)


def run_ours(args) -> dict:
    from cluster.engine import LLMEngine
    from configs.engine import EngineConfig, SamplingParams

    engine = LLMEngine(EngineConfig(model=args.model, device=args.device, dtype=args.dtype,
                                    max_model_len=args.prompt_len + args.max_tokens + 1,
                                    max_num_seqs=1, enforce_eager=args.enforce_eager))
    ids = prompt_ids(args.prompt_len, engine.target_config.vocab_size)
    base = _current_bytes(args.device)
    t = time.perf_counter()
    engine.add_request(ids, SamplingParams(max_tokens=args.max_tokens, ignore_eos=True))
    first, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens += out.new_token_ids
            if first is None and out.new_token_ids:
                _sync(args.device)
                first = time.perf_counter() - t
    total = time.perf_counter() - t
    return {"ttft_s": first, "total_s": total, "tokens": tokens,
            "prefill_chunk": engine.scheduler.max_num_batched_tokens,
            "peak_bytes": _peak_bytes(args.device), "base_bytes": base}


def run_transformers(args) -> dict:
    import torch
    from transformers import Qwen3_5MoeForCausalLM

    dtype = getattr(torch, args.dtype)
    model = Qwen3_5MoeForCausalLM.from_pretrained(args.model, dtype=dtype,
                                                  attn_implementation="sdpa")
    model = model.to(args.device).eval()
    ids = prompt_ids(args.prompt_len, model.config.vocab_size)
    t = time.perf_counter()
    with torch.inference_mode():
        out = model(torch.tensor([ids], device=args.device), use_cache=True)
        tok = int(out.logits[0, -1].argmax())
        _sync(args.device)
        first, tokens, cache = time.perf_counter() - t, [tok], out.past_key_values
        for _ in range(args.max_tokens - 1):
            out = model(torch.tensor([[tok]], device=args.device), past_key_values=cache,
                        use_cache=True)
            tok, cache = int(out.logits[0, -1].argmax()), out.past_key_values
            tokens.append(tok)
    _sync(args.device)
    return {"ttft_s": first, "total_s": time.perf_counter() - t, "tokens": tokens,
            "peak_bytes": _peak_bytes(args.device)}


def child(side: str, args) -> dict:
    cmd = [sys.executable, "-m", "bench.long_context", "--child", side, "--model", args.model,
           "--prompt-len", str(args.prompt_len), "--max-tokens", str(args.max_tokens),
           "--device", args.device, "--dtype", args.dtype]
    if args.enforce_eager:
        cmd.append("--enforce-eager")
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr else "failed"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--prompt-len", type=int, default=32768)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--child", choices=("ours", "transformers"), help=argparse.SUPPRESS)
    p.add_argument("--out")
    args = p.parse_args(argv)
    if args.child:
        result = run_ours(args) if args.child == "ours" else run_transformers(args)
        print(json.dumps(result))
        return
    with tempfile.TemporaryDirectory() as tmp:
        args.model = str(long_context_copy(args.model, Path(tmp) / "model",
                                           args.prompt_len + args.max_tokens + 1))
        results = {"args": vars(args) | {"model": args.model}, "ours": child("ours", args)}
        if not args.no_transformers:
            results["transformers"] = child("transformers", args)
        shutil.rmtree(tmp, ignore_errors=True)
    ours, hf = results["ours"], results.get("transformers")
    if hf and "tokens" in hf and "tokens" in ours:
        results["same_tokens"] = ours["tokens"] == hf["tokens"]
    for name in ("ours", "transformers"):
        r = results.get(name)
        if r and "error" not in r:
            print(f"{name:12s} TTFT {r['ttft_s']:7.2f} s  total {r['total_s']:7.2f} s  peak "
                  f"{r['peak_bytes'] / 2**30:6.2f} GiB")
        elif r:
            print(f"{name:12s} failed: {r['error']}")
    if "same_tokens" in results:
        print("same tokens:", results["same_tokens"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
