"""Log-probabilities: the target's own, exact under speculative decoding. Every generated
token's log-probability (and its alternatives) comes from the verify row that produced it, and
every prompt token's from the prefill rows, chunked or not; the oracle is transformers'
forward over the whole sequence."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from workers.logprobs import TokenLogprob, split_rows, token_logprobs

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"
TOL = 2e-5  # fp32: the same logits up to summation order


def engine(draft: bool, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("page_size", 4)
    return LLMEngine(EngineConfig(model=str(DEMO / "target"),
                                  draft_model=str(DEMO / "draft") if draft else None,
                                  block_size=8 if draft else None, **kw))


@pytest.fixture(scope="module")
def hf():
    return Qwen3_5MoeForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()


def oracle(hf, ids: list[int]) -> torch.Tensor:
    """[len(ids), V]: row j is the distribution of token j + 1."""
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 30, (n,), generator=g)]


def check_against(ref: torch.Tensor, tokens: list[int], got: list[TokenLogprob], top: int,
                  rows: range) -> None:
    assert len(got) == len(tokens) == len(rows)
    for row, tok, lp in zip(rows, tokens, got, strict=True):
        assert lp.logprob == pytest.approx(float(ref[row, tok]), abs=TOL)
        assert lp.rank == int((ref[row] > ref[row, tok]).sum()) + 1
        assert len(lp.top) == top
        want = ref[row].topk(top)
        assert [t for t, _ in lp.top] == want.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(want.values.tolist(), abs=TOL)


@pytest.mark.parametrize("draft", [True, False], ids=["speculative", "plain"])
def test_logprobs_match_the_target_alone(hf, draft):
    """Greedy, speculative or not, prompts prefilled in chunks of 8: every output token's and
    every prompt token's log-probability and top 5 are transformers'."""
    ps = prompts(6, 0)
    params = SamplingParams(max_tokens=20, ignore_eos=True, logprobs=5, prompt_logprobs=5)
    outs = engine(draft, max_num_batched_tokens=8).generate(ps, params)
    for prompt, out in zip(ps, outs, strict=True):
        ref = oracle(hf, prompt + out.output_ids)
        n = len(prompt)
        assert out.prompt_logprobs[0] is None
        check_against(ref, prompt[1:], out.prompt_logprobs[1:], 5, range(n - 1))
        check_against(ref, out.output_ids, out.new_logprobs, 5, range(n - 1, n - 1 + 20))


def test_sampled_tokens_carry_their_raw_logprobs(hf):
    """Sampling at temperature 0.7 and top-k 20: each drawn token's log-probability is the
    target's raw one (before temperature and top-k), as vLLM reports it."""
    ps = prompts(4, 1)
    params = [SamplingParams(max_tokens=16, temperature=0.7, top_k=20, seed=i, ignore_eos=True,
                             logprobs=0) for i in range(4)]
    outs = engine(True).generate(ps, params)
    for prompt, out in zip(ps, outs, strict=True):
        ref = oracle(hf, prompt + out.output_ids)
        check_against(ref, out.output_ids, out.new_logprobs, 0,
                      range(len(prompt) - 1, len(prompt) - 1 + 16))


def test_streamed_logprobs_follow_the_tokens_and_stop_with_them():
    """Each step's output carries one log-probability per new token; a stop token cuts both;
    the prompt's come once, with the first output; requests that ask for none get none."""
    eng = engine(True)
    prompt = prompts(1, 2)[0]
    free = eng.generate([prompt], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert free.new_logprobs is None and free.prompt_logprobs is None
    stop = free.output_ids[9]
    rid = eng.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True, logprobs=2,
                                                 prompt_logprobs=1, stop_token_ids=(stop,)))
    tokens, logprobs, prompt_lps = [], [], []
    while eng.has_unfinished():
        for out in eng.step():
            assert out.request_id == rid
            assert len(out.new_logprobs) == len(out.new_token_ids)
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
            prompt_lps.append(out.prompt_logprobs)
    assert tokens == free.output_ids[: free.output_ids.index(stop) + 1]
    assert len(logprobs) == len(tokens) and all(len(lp.top) == 2 for lp in logprobs)
    assert len(prompt_lps[0]) == len(prompt) and all(p is None for p in prompt_lps[1:])


def test_logprobs_settings_are_checked():
    for name in ("logprobs", "prompt_logprobs"):
        for bad in (-1, 21, True, 1.0):
            with pytest.raises(ValueError, match=name):
                SamplingParams(**{name: bad})


def test_token_logprobs_in_slices_and_split():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(600, 50, generator=g)
    tokens = torch.randint(0, 50, (600,), generator=g).tolist()
    got = token_logprobs(logits, tokens, 3)
    ref = torch.log_softmax(logits, -1)
    assert [lp.logprob for lp in got] == pytest.approx(
        ref[torch.arange(600), tokens].tolist(), abs=1e-6)
    assert [lp.rank for lp in got] == ((ref > ref[torch.arange(600), tokens][:, None]).sum(-1)
                                        + 1).tolist()
    parts = split_rows(got, [100, 500], [1, 3])
    assert [len(p) for p in parts] == [100, 500]
    assert all(len(lp.top) == 1 for lp in parts[0]) and parts[1][0] == got[100]
