"""The golden invariant at scale: speculative greedy vs target-only greedy over many prompts,
in the engine's own dtype and device, and for every divergence whether it starts at a near-tie.

    python -m tools.golden_check --model DIR --draft-model DIR --device cuda --dtype bfloat16 \
        --num-prompts 100 --max-tokens 64 --block-size 16 --out golden.json
    python -m tools.golden_check … --kernel-overrides pdl=off   # a variant's

In fp32 the two must agree exactly. In bf16 a verify block and a one-token decode round
differently (other batch shapes, other reduction orders), so the argmax can flip where the top
two logits are within rounding of each other; anywhere else a flip means a rollback or cache
bug. For each first divergence this recomputes the target-only logits at that position (one
cache-free forward of prompt + the agreed prefix, in the same dtype) and reports the top-2 gap
in units of the bf16 spacing at the top logit's magnitude (`gap_ulps`), whether the
speculative token is the runner-up, its rank among those logits, and the gap between the two
tokens actually chosen (`chosen_gap_ulps`: target-only's logit minus speculative's, in the same
spacings; where several tokens tie, the speculative one need not be the runner-up, and this is
the gap that matters)."""

from __future__ import annotations

import argparse
import json
import math

import torch

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from workers.cache import allocate_target_caches
from workers.model_runner import ModelRunner, SeqInput

NEAR_TIE_ULPS = 8  # top-2 gap at most this many bf16 spacings of the top logit


def bf16_spacing(x: float) -> float:
    """Distance between adjacent bf16 values around |x| (8 significant bits)."""
    return 2.0 ** (math.floor(math.log2(max(abs(x), 1e-30))) - 7)


@torch.inference_mode()
def last_logits(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Target logits after `ids`, cache-free (a fresh single-sequence cache)."""
    runner = engine.executor.runner
    model, device, page_size = runner.model, runner.device, engine.cfg.page_size
    pages = -(-len(ids) // page_size)
    caches = allocate_target_caches(model, pages, page_size, 1, device)
    runner = ModelRunner(model, caches, (), device)
    batch = runner._batch([SeqInput(0, ids, 0, list(range(pages)), 0, SamplingParams())], False)
    hidden, _ = model(batch, caches)
    return model.compute_logits(hidden[-1:])[0].float().cpu()


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first differing token (the shorter length if one is a prefix of the other,
    len(a) if equal)."""
    n = min(len(a), len(b))
    return next((j for j in range(n) if a[j] != b[j]), n if len(a) != len(b) else len(a))


def check(spec: LLMEngine, ref: LLMEngine, prompts: list[list[int]], max_tokens: int) -> dict:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    got = spec.generate(prompts, params)
    want = ref.generate(prompts, params)
    divergences = []
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.output_ids == w.output_ids:
            continue
        at = first_divergence(g.output_ids, w.output_ids)
        logits = last_logits(ref, prompts[i] + w.output_ids[:at])
        top2 = logits.topk(2)
        gap = float(top2.values[0] - top2.values[1])
        spacing = bf16_spacing(float(top2.values[0]))
        ulps = gap / spacing
        taken = g.output_ids[at] if at < len(g.output_ids) else None
        chosen = None if taken is None or at >= len(w.output_ids) else \
            float(logits[w.output_ids[at]] - logits[taken]) / spacing
        divergences.append({
            "prompt": i, "position": at,
            "target_only": w.output_ids[at] if at < len(w.output_ids) else None,
            "speculative": taken,
            "top2_gap": gap, "gap_ulps": ulps,
            "speculative_is_runner_up": taken is not None and int(top2.indices[1]) == taken,
            "speculative_rank": None if taken is None else int((logits > logits[taken]).sum()),
            "chosen_gap_ulps": chosen,
            "near_tie": ulps <= NEAR_TIE_ULPS})
    tokens = sum(len(w.output_ids) for w in want)
    matched = sum(min(first_divergence(g.output_ids, w.output_ids), len(w.output_ids))
                  for g, w in zip(got, want, strict=True))
    return {
        "prompts": len(prompts), "identical_outputs": len(prompts) - len(divergences),
        "token_match_rate": matched / tokens,  # tokens before each output's first divergence
        "divergences": divergences,
        "all_divergences_near_ties": all(d["near_tie"] for d in divergences),
        "max_chosen_gap_ulps": max((d["chosen_gap_ulps"] for d in divergences
                                    if d["chosen_gap_ulps"] is not None), default=None),
        "mean_acceptance_length": spec.stats.mean_acceptance_length,
        "cuda_graphs": {"speculative": captured_shapes(spec), "target_only": captured_shapes(ref)},
    }


def captured_shapes(engine: LLMEngine) -> dict[str, list]:
    """The shapes that ran as CUDA graphs (empty off CUDA or with enforce_eager), and any whose
    capture failed and ran eagerly."""
    rounds, drafter = engine.executor.runner.graphs, engine.executor.drafter
    return {
        "rounds": sorted(rounds.steps) if rounds is not None else [],
        "proposals": sorted(drafter.graphs) if drafter is not None else [],
        "failed": [str(k) for k in (rounds.failed if rounds is not None else {})]
        + [str(k) for k in (drafter.failed if drafter is not None else {})],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft-model", required=True)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--prompt-len", type=int, nargs=2, default=[4, 64], help="min max")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int)
    p.add_argument("--max-num-seqs", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--kernel-overrides", default="",
                   help="field=value[,…] over the default kernels, in both engines "
                        "(EngineConfig.kernel_overrides): a variant's golden check")
    p.add_argument("--out")
    args = p.parse_args()
    # Two engines share one device: fixed pools (a measured one would take the whole GPU).
    pages = -(-(args.prompt_len[1] + args.max_tokens + 65) // 16)
    common = {"model": args.model, "device": args.device, "dtype": args.dtype,
              "max_num_seqs": args.max_num_seqs, "page_size": 16,
              "num_pages": args.max_num_seqs * pages,
              "kernel_overrides": args.kernel_overrides}
    spec = LLMEngine(EngineConfig(draft_model=args.draft_model, block_size=args.block_size,
                                  **common))
    ref = LLMEngine(EngineConfig(**common))
    g = torch.Generator().manual_seed(args.seed)
    vocab = spec.target_config.vocab_size
    lo, hi = args.prompt_len
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist()
               for n in torch.randint(lo, hi + 1, (args.num_prompts,), generator=g)]
    report = {"args": vars(args), **check(spec, ref, prompts, args.max_tokens)}
    summary = {k: v for k, v in report.items() if k != "divergences"}
    print(json.dumps(summary, indent=1))
    for d in report["divergences"]:
        print(json.dumps(d))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
