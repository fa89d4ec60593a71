"""Sampling with speculation is exact in distribution: the law of the first two generated
tokens equals the target's own (computed exactly from transformers' model), as does plain
sampling through the same engine."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3_5MoeForCausalLM

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from workers.sampling import probs_from_logits

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"
N = 1500


def _prompt() -> list[int]:
    # A text prompt extended by the target's own greedy continuation: there the demo draft
    # predicts well, so the first round really accepts drafts as well as rejecting them.
    from deploy.tokenizer import load_tokenizer

    ids = load_tokenizer(str(DEMO / "target")).encode("To make bread, mix")
    eng = LLMEngine(EngineConfig(model=str(DEMO / "target"), max_num_seqs=1, page_size=4))
    return ids + eng.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))[0].output_ids


PROMPT = _prompt()


def exact_joint(params: SamplingParams) -> dict[tuple[int, int], float]:
    hf = Qwen3_5MoeForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    with torch.inference_mode():
        p1 = probs_from_logits(hf(torch.tensor([PROMPT])).logits[0, -1:], params)[0]
        joint = {}
        for t1 in p1.nonzero().flatten().tolist():
            p2 = probs_from_logits(hf(torch.tensor([PROMPT + [t1]])).logits[0, -1:], params)[0]
            for t2 in p2.nonzero().flatten().tolist():
                joint[(t1, t2)] = (p1[t1] * p2[t2]).item()
    return joint


def sampled_joint(draft: Path | None, params: SamplingParams) -> dict[tuple[int, int], float]:
    eng = LLMEngine(EngineConfig(model=str(DEMO / "target"), draft_model=draft and str(draft),
                                 block_size=4 if draft else None, max_num_seqs=512,
                                 max_model_len=32, page_size=4))
    outs = eng.generate([PROMPT] * N, [
        SamplingParams(max_tokens=2, ignore_eos=True, temperature=params.temperature,
                       top_k=params.top_k, top_p=params.top_p, seed=i) for i in range(N)
    ])
    counts: dict[tuple[int, int], float] = {}
    for o in outs:
        key = tuple(o.output_ids)
        counts[key] = counts.get(key, 0) + 1 / N
    if draft:
        assert eng.stats.accepted_at[0] > 0  # drafts were really accepted, not just rejected
    return counts


def tv(a: dict, b: dict) -> float:
    return 0.5 * sum(abs(a.get(k, 0.0) - b.get(k, 0.0)) for k in set(a) | set(b))


def noise_bound(exact: dict, trials: int = 200) -> float:
    # The largest TV distance N exact draws show over `trials` repetitions, with 25% margin.
    keys = list(exact)
    probs = torch.tensor([exact[k] for k in keys])
    g = torch.Generator().manual_seed(0)
    worst = 0.0
    for _ in range(trials):
        counts = torch.bincount(torch.multinomial(probs, N, True, generator=g), minlength=len(keys))
        worst = max(worst, tv({k: c / N for k, c in zip(keys, counts.tolist(), strict=True)},
                              exact))
    return 1.25 * worst


def test_first_two_tokens_follow_the_target_distribution():
    params = SamplingParams(temperature=1.0, top_k=3)
    exact = exact_joint(params)
    bound = noise_bound(exact)
    # The bound is tight enough to catch a sampler at a slightly wrong temperature.
    assert tv(exact, exact_joint(SamplingParams(temperature=0.7, top_k=3))) > 2 * bound
    assert tv(sampled_joint(DEMO / "draft", params), exact) < bound
    assert tv(sampled_joint(None, params), exact) < bound


def test_seeded_requests_are_reproducible():
    eng = LLMEngine(EngineConfig(model=str(DEMO / "target"), draft_model=str(DEMO / "draft"),
                                 block_size=4, max_num_seqs=4, page_size=4))
    sp = SamplingParams(max_tokens=16, temperature=1.0, seed=7, ignore_eos=True)
    a, b = eng.generate([PROMPT, PROMPT], [sp, sp])
    assert a.output_ids == b.output_ids
    c = eng.generate([PROMPT], SamplingParams(max_tokens=16, temperature=1.0, seed=8,
                                              ignore_eos=True))[0]
    assert c.output_ids != a.output_ids
