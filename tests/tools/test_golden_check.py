"""tools/golden_check.py: identical outputs report no divergence (fp32, and bf16 on CPU with
the demo pair); a planted divergence is located and measured against the target's own logits
at that position."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from cluster.engine import LLMEngine
from configs.engine import EngineConfig
from tools.golden_check import bf16_spacing, check, last_logits

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"


def engines(dtype: str):
    common = {"model": str(DEMO / "target"), "dtype": dtype, "max_num_seqs": 8}
    spec = LLMEngine(EngineConfig(draft_model=str(DEMO / "draft"), block_size=8, **common))
    return spec, LLMEngine(EngineConfig(**common))


def prompts(n: int):
    g = torch.Generator().manual_seed(4)
    return [torch.randint(0, 320, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 30, (n,), generator=g)]


def test_speculative_equals_target_only_in_fp32_and_bf16():
    for dtype in ("float32", "bfloat16"):
        report = check(*engines(dtype), prompts(12), max_tokens=24)
        assert report["token_match_rate"] == 1.0 and report["divergences"] == [], dtype
        assert report["mean_acceptance_length"] > 1


def test_a_planted_divergence_is_located_and_measured():
    spec, ref = engines("float32")
    ps = prompts(3)
    real_generate = spec.generate

    def diverging(prompt_list, params):  # prompt 1 takes the runner-up at output position 5
        outs = real_generate(prompt_list, params)
        ids = outs[1].output_ids
        logits = last_logits(ref, prompt_list[1] + ids[:5])
        outs[1] = replace(outs[1], output_ids=ids[:5] + [int(logits.topk(2).indices[1])])
        return outs

    spec.generate = diverging
    report = check(spec, ref, ps, max_tokens=12)
    (d,) = report["divergences"]
    assert (d["prompt"], d["position"]) == (1, 5) and d["speculative_is_runner_up"]
    logits = last_logits(ref, ps[1] + ref.generate([ps[1]], _params(12))[0].output_ids[:5])
    top = logits.topk(2).values
    assert d["top2_gap"] == float(top[0] - top[1])
    assert d["gap_ulps"] == d["top2_gap"] / bf16_spacing(float(top[0]))
    # the runner-up was taken: rank 1, and the chosen pair's gap is the top-2 gap
    assert d["speculative_rank"] == 1 and d["chosen_gap_ulps"] == d["gap_ulps"]
    assert report["max_chosen_gap_ulps"] == d["chosen_gap_ulps"]
    assert report["identical_outputs"] == 2 and report["token_match_rate"] < 1.0


def _params(n: int):
    from configs.engine import SamplingParams

    return SamplingParams(max_tokens=n, ignore_eos=True)


def test_bf16_spacing():
    assert bf16_spacing(1.0) == 2**-7 and bf16_spacing(-3.0) == 2**-6
    assert torch.tensor(1.0 + bf16_spacing(1.0), dtype=torch.bfloat16).item() > 1.0
