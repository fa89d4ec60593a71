"""What structured outputs and the sampling penalties cost per verify round, in process, on the
real architecture with random weights, against unconstrained rounds in the same run:

    python -m bench.controls --preset qwen3.5-35b-a3b --device cuda --batch-sizes 1 8 \
        --block-size 16 --vocab-tiktoken qwen.tiktoken --out controls.json

Three settings per batch size, each a verify round of B tokens per sequence (forward, masks or
penalties, greedy acceptance, commit), median ms over --iters:

  baseline   free sequences, random drafts
  json       every sequence under a JSON schema (SCHEMA below); its drafts are legal (each
             the lowest token id the grammar allows after the ones before), so every round
             walks the matcher through the whole block: the most mask work a round can need
  penalties  repetition, frequency and presence penalties and a logit bias, random drafts;
             the penalties by the engine's kernel (KernelConfig's default: Triton's on CUDA)
  penalties_torch
             the same by the torch form (the CPU path and the reference)

The grammar needs a tokenizer's vocabulary: --vocab-tiktoken reads a tiktoken BPE table (base64
token, rank per line; e.g. Qwen's 151,643-token qwen.tiktoken), padded to the model's
vocabulary with ids no grammar allows; --tokenizer DIR takes a transformers tokenizer's.

    python -m bench.controls --acceptance --model DIR --draft-model DIR --block-size 8

measures instead what constraining the draft's proposals by the grammar buys: the mean
acceptance length τ of a checkpoint pair over grammar-constrained greedy requests (the JSON
schema, a regex, a choice list; --prompts of each), with the proposals constrained as served
and with the draft proposing freely, on the same requests."""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.floors import sync
from bench.random_model import build_target
from bench.steps import Batch
from configs.engine import GrammarSpec, SamplingParams
from configs.kernels import KernelConfig
from configs.presets import target_preset
from target.kernels import selection
from workers.controls import ControlsEnv
from workers.grammar import Grammars
from workers.token_bitmask import bitmask_words

SCHEMA = {
    "type": "object", "additionalProperties": False,
    "required": ["id", "name", "email", "age", "tags", "address"],
    "properties": {
        "id": {"type": "integer"}, "name": {"type": "string", "maxLength": 40},
        "email": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "required": ["city", "zip"],
                    "properties": {"city": {"type": "string"}, "zip": {"type": "string"}}},
    },
}
PENALTIES = SamplingParams(max_tokens=1 << 20, ignore_eos=True, repetition_penalty=1.1,
                           frequency_penalty=0.4, presence_penalty=0.3,
                           logit_bias=((11, -5.0), (13, 2.0)))


def grammars_for(args, vocab_size: int) -> Grammars:
    import xgrammar as xgr

    if args.tokenizer:
        from transformers import AutoTokenizer

        return Grammars(AutoTokenizer.from_pretrained(args.tokenizer), vocab_size)
    lines = Path(args.vocab_tiktoken).read_bytes().splitlines()
    vocab = [base64.b64decode(line.split()[0]) for line in lines if line.strip()]
    info = xgr.TokenizerInfo(vocab, xgr.VocabType.RAW, vocab_size=vocab_size,
                             stop_token_ids=[vocab_size - 1])
    return Grammars(None, vocab_size, info=info)


def legal_drafts(batch: Batch, k: int) -> list[list[int]]:
    """Per sequence, k tokens its grammar allows after its committed ones (the lowest id each
    time), from a fork of its matcher in the target's controls."""
    out = []
    table = batch.executor.target.controls
    for seq_id in batch.seq_ids:
        matcher = table.get(seq_id).matcher().fork()
        words = np.zeros((1, bitmask_words(batch.vocab)), np.int32)
        drafts = []
        for _ in range(k):
            matcher.fill_next_token_bitmask(words)
            nonzero = np.flatnonzero(words[0])
            if matcher.is_terminated() or not len(nonzero):
                break
            word = int(nonzero[0])
            bit = (int(words[0, word]) & -int(words[0, word])).bit_length() - 1
            tok = word * 32 + bit
            if not matcher.accept_token(tok):
                break
            drafts.append(tok)
        out.append(drafts + [0] * (k - len(drafts)))
    return out


def round_ms(batch: Batch, drafts_fn, iters: int, warmup: int, device) -> dict:
    """Median ms of a verify round (drafts made before the clock starts)."""
    samples = []
    for i in range(warmup + iters):
        drafts = drafts_fn()
        sync(device)
        t = time.perf_counter()
        batch.verify(drafts)
        sync(device)
        if i >= warmup:
            samples.append((time.perf_counter() - t) * 1e3)
    return {"ms": statistics.median(samples), "samples_ms": [round(x, 4) for x in samples]}


def run(args) -> dict:
    device = torch.device(args.device)
    raw = json.loads(Path(args.config).read_text()) if args.config else \
        target_preset(args.preset)
    target = build_target(raw, getattr(torch, args.dtype), device)
    graphs = device.type == "cuda" and not args.enforce_eager
    if graphs:
        target.set_kernels(KernelConfig(), True)
    vocab = target.config.vocab_size
    kernel = selection.penalties_kernel(KernelConfig(), device)
    env = ControlsEnv(vocab, device, penalties=kernel)
    env._grammars = grammars_for(args, vocab)
    torch_env = ControlsEnv(vocab, device, penalties="torch")
    spec = GrammarSpec("json", json.dumps(SCHEMA))
    t = time.perf_counter()
    env.grammars().compile(spec)
    results = {"args": vars(args), "compile_ms": (time.perf_counter() - t) * 1e3,
               "penalties_kernel": kernel, "runs": []}
    settings = {
        "baseline": SamplingParams(max_tokens=1 << 20, ignore_eos=True),
        "json": SamplingParams(max_tokens=1 << 20, ignore_eos=True, grammar=spec),
        "penalties": PENALTIES,
        "penalties_torch": PENALTIES,
    }
    k = args.block_size - 1
    for b in args.batch_sizes:
        max_new = (args.warmup + args.iters + 2) * args.block_size * len(settings)
        row = {"batch": b}
        for name, params in settings.items():
            batch = Batch.in_process(target, None, (), b, args.prompt_len, max_new,
                                     args.page_size, device, graphs, params,
                                     torch_env if name == "penalties_torch" else env)
            batch.prefill()
            drafts = (lambda batch=batch: legal_drafts(batch, k)) if name == "json" else \
                (lambda batch=batch: batch.random_drafts(k))
            row[name] = round_ms(batch, drafts, args.iters, args.warmup, device)
            batch.release()
            del batch
            torch.cuda.empty_cache() if device.type == "cuda" else None
        for name in ("json", "penalties", "penalties_torch"):
            row[f"{name}_cost"] = row[name]["ms"] / row["baseline"]["ms"] - 1
        results["runs"].append(row)
        print(f"batch {b}: baseline {row['baseline']['ms']:.2f} ms, " + ", ".join(
            f"{name} {row[name]['ms']:.2f} ms ({row[name + '_cost']:+.1%})"
            for name in ("json", "penalties", "penalties_torch")), flush=True)
        if args.out:
            Path(args.out).write_text(json.dumps(results, indent=1))
    return results


def acceptance(args) -> dict:
    from cluster.engine import LLMEngine
    from configs.engine import EngineConfig
    from deploy.tokenizer import load_tokenizer
    from workers.controls import ControlsTable

    tokenizer = load_tokenizer(args.model)
    texts = ["To make bread, mix", "The library opens at", "A heron stood in the",
             "Students come to read", "The oldest book in", "On the far bank, a man"]
    prompts = [tokenizer.encode(t) for t in texts][: args.prompts]
    specs = {"json": GrammarSpec("json", json.dumps(SCHEMA)),
             "regex": GrammarSpec("regex", r"[a-z]{2,8}( [a-z]{2,8}){2,6}\."),
             "choice": GrammarSpec("choice", json.dumps(["the river", "an old oak tree",
                                                         "bread and water"]))}
    out = {"args": vars(args), "tau": {}}
    for name, spec in specs.items():
        params = SamplingParams(max_tokens=args.max_tokens, grammar=spec)
        for masked in (True, False):
            engine = LLMEngine(EngineConfig(model=args.model, draft_model=args.draft_model,
                                            block_size=args.block_size, device=args.device,
                                            dtype=args.dtype, max_num_seqs=len(prompts)))
            if not masked:  # the draft keeps no grammars: it proposes freely
                engine.executor.draft.controls = ControlsTable(None, draft=True)
            engine.generate(prompts, [params] * len(prompts))
            key = f"{name}_{'constrained' if masked else 'free'}_proposals"
            out["tau"][key] = engine.stats.mean_acceptance_length
            print(f"{name}: τ {out['tau'][key]:.3f} with "
                  f"{'constrained' if masked else 'free'} proposals", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-35b-a3b")
    p.add_argument("--config", help="a target config.json instead of the preset")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--enforce-eager", action="store_true")
    vocab = p.add_mutually_exclusive_group()
    vocab.add_argument("--vocab-tiktoken", help="a tiktoken BPE table (base64 token, rank)")
    vocab.add_argument("--tokenizer", help="a transformers tokenizer directory")
    p.add_argument("--acceptance", action="store_true",
                   help="τ with constrained and with free proposals (--model, --draft-model)")
    p.add_argument("--model", help="--acceptance: the target checkpoint")
    p.add_argument("--draft-model", help="--acceptance: the draft checkpoint")
    p.add_argument("--prompts", type=int, default=6, help="--acceptance: prompts per grammar")
    p.add_argument("--max-tokens", type=int, default=64, help="--acceptance: per request")
    p.add_argument("--out", help="write the JSON here (rewritten after each batch size)")
    return p


def main() -> None:
    args = parser().parse_args()
    if args.acceptance:
        if not (args.model and args.draft_model):
            raise SystemExit("--acceptance needs --model and --draft-model")
        acceptance(args)
    elif not (args.vocab_tiktoken or args.tokenizer):
        raise SystemExit("give --vocab-tiktoken or --tokenizer (the grammar's vocabulary)")
    else:
        run(args)


if __name__ == "__main__":
    main()
