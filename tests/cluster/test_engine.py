"""The in-process engine: the golden invariant (speculative greedy == target-only greedy),
stop conditions, statistics, resource bookkeeping and request errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import Qwen3_5MoeForCausalLM

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"


def make_prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (n,), generator=g).tolist()
    return [torch.randint(0, 320, (k,), generator=g).tolist() for k in lengths]


def mixed_params(n: int, seed: int) -> list[SamplingParams]:
    # Different budgets so sequences leave the batch at different rounds; EOS stays active.
    g = torch.Generator().manual_seed(seed)
    return [SamplingParams(max_tokens=int(m)) for m in torch.randint(1, 40, (n,), generator=g)]


def engine(target, draft=None, block_size=None, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("page_size", 4)
    return LLMEngine(EngineConfig(model=str(target), draft_model=draft and str(draft),
                                  block_size=block_size, **kw))


@pytest.fixture(scope="module")
def demo_reference():
    prompts, params = make_prompts(24, 0), mixed_params(24, 1)
    outs = engine(DEMO / "target").generate(prompts, params)
    return prompts, params, [o.output_ids for o in outs]


def test_target_only_greedy_matches_transformers(tiny_models):
    hf = Qwen3_5MoeForCausalLM.from_pretrained(tiny_models / "target", dtype=torch.float32).eval()
    prompts = make_prompts(3, 5)
    outs = engine(tiny_models / "target").generate(
        prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for prompt, out in zip(prompts, outs, strict=True):
        ids = list(prompt)
        with torch.inference_mode():
            for _ in range(12):  # cache-free greedy: the target alone, the oracle
                ids.append(int(hf(torch.tensor([ids])).logits[0, -1].argmax()))
        assert out.output_ids == ids[len(prompt) :]


@pytest.mark.parametrize("block_size", [2, 4, 8, 16])
def test_speculative_greedy_equals_target_only_trained_draft(demo_reference, block_size):
    prompts, params, want = demo_reference
    spec = engine(DEMO / "target", DEMO / "draft", block_size)
    got = [o.output_ids for o in spec.generate(prompts, params)]
    assert got == want
    # The trained draft really predicts the target, so multi-token acceptance is exercised:
    # many rounds accept drafts, some accept several.
    assert spec.stats.accepted_at[0] >= 0.1 * spec.stats.rounds
    assert max(spec.stats.lengths) >= min(block_size, 4)


class CycledDraftLength:
    """A round's drafts per sequence from a fixed cycle, switching every round; it counts the
    drafts it handed out."""

    def __init__(self, cycle: list[int | None], block_size: int):
        self.cycle, self.block_size, self.calls, self.drafts = cycle, block_size, 0, 0

    def __call__(self, seqs) -> int | None:
        k = self.cycle[self.calls % len(self.cycle)]
        self.calls += 1
        self.drafts += len(seqs) * (self.block_size - 1 if k is None else k)
        return k


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_draft_length_switched_every_round_keeps_the_invariant(demo_reference,
                                                                 prefix_caching):
    """Rounds of 7, 3, 0 (a plain decode step: the draft proposes nothing but still writes
    the token into its context), 1, B − 1 and 5 drafts in turn: target-only's outputs; each
    round commits at most its drafts + 1."""
    prompts, params, want = demo_reference
    spec = engine(DEMO / "target", DEMO / "draft", 8, enable_prefix_caching=prefix_caching)
    spec.draft_length = lengths = CycledDraftLength([7, 3, 0, 1, None, 5, 0, 0, 2], 8)
    outs = spec.generate(prompts, params)
    assert [o.output_ids for o in outs] == want
    assert spec.stats.draft_tokens == lengths.drafts and lengths.calls > 0
    assert max(spec.stats.lengths) >= 4  # the longer blocks still accept several drafts
    again = spec.generate(prompts, params)  # the context the draft kept is still right
    assert [o.output_ids for o in again] == want


@pytest.mark.parametrize(("draft", "block_size"), [("draft-full", 8), ("draft-swa", 4),
                                                   ("draft-swa", 16)])
def test_speculative_greedy_equals_target_only_random_drafts(tiny_models, draft, block_size):
    prompts, params = make_prompts(20, 2), mixed_params(20, 3)
    want = [o.output_ids for o in engine(tiny_models / "target").generate(prompts, params)]
    spec = engine(tiny_models / "target", tiny_models / draft, block_size)
    assert [o.output_ids for o in spec.generate(prompts, params)] == want


def test_requests_joining_mid_flight_keep_the_invariant(demo_reference):
    prompts, params, want = demo_reference
    spec = engine(DEMO / "target", DEMO / "draft", 8, max_num_seqs=3)
    ids = [spec.add_request(p, sp) for p, sp in zip(prompts[:4], params[:4], strict=True)]
    done = {}
    pending = list(zip(prompts[4:10], params[4:10], strict=True))
    while spec.has_unfinished():
        for out in spec.step():
            if out.finished:
                done[out.request_id] = out.output_ids
        if pending:  # a new request arrives after every step
            p, sp = pending.pop(0)
            ids.append(spec.add_request(p, sp))
    assert [done[i] for i in ids] == want[:10]


def test_acceptance_statistics_are_consistent(demo_reference):
    prompts, params, _ = demo_reference
    spec = engine(DEMO / "target", DEMO / "draft", 8)
    outs = spec.generate(prompts, [SamplingParams(max_tokens=30, ignore_eos=True)] * len(prompts))
    for o in outs:
        # the prefill yields the first token, each round the rest
        assert 1 + sum(o.acceptance_lengths) == len(o.output_ids) == 30
        assert all(1 <= n <= 8 for n in o.acceptance_lengths)
    rates = spec.stats.position_acceptance_rate
    assert len(rates) == 7 and all(a >= b for a, b in zip(rates, rates[1:], strict=False))
    assert sum(spec.stats.lengths.values()) == spec.stats.rounds


def test_stop_conditions(demo_reference):
    prompts, _, _ = demo_reference
    eng = engine(DEMO / "target", DEMO / "draft", 4)
    free = eng.generate([prompts[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    stop_tok = free.output_ids[5]
    first = free.output_ids.index(stop_tok)
    out = eng.generate([prompts[0]], SamplingParams(max_tokens=20, ignore_eos=True,
                                                    stop_token_ids=(stop_tok,)))[0]
    assert out.output_ids == free.output_ids[: first + 1] and out.finish_reason == "stop"
    out = eng.generate([prompts[0]], SamplingParams(max_tokens=7, ignore_eos=True))[0]
    assert out.output_ids == free.output_ids[:7] and out.finish_reason == "length"
    # EOS: make the engine treat the 4th token as EOS.
    eos = free.output_ids[3]
    eng.eos_ids = {eos}
    out = eng.generate([prompts[0]], SamplingParams(max_tokens=20))[0]
    assert out.output_ids == free.output_ids[: free.output_ids.index(eos) + 1]
    assert out.finish_reason == "stop"
    # Context length: generation stops when the sequence fills max_model_len.
    short = engine(DEMO / "target", DEMO / "draft", 4, max_model_len=len(prompts[0]) + 6)
    out = short.generate([prompts[0]], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert out.output_ids == free.output_ids[:6] and out.finish_reason == "length"


def test_resources_return_after_finish_and_abort(demo_reference):
    prompts, params, _ = demo_reference
    eng = engine(DEMO / "target", DEMO / "draft", 4)
    free_blocks, free_slots = eng.blocks.num_free_pages, len(eng.blocks.free_slots)
    rid = eng.add_request(prompts[0], SamplingParams(max_tokens=30, ignore_eos=True))
    eng.add_request(prompts[1], SamplingParams(max_tokens=3))
    eng.step()
    eng.step()
    assert eng.blocks.num_free_pages < free_blocks
    eng.abort(rid)
    while eng.has_unfinished():
        eng.step()
    assert eng.blocks.num_free_pages == free_blocks
    assert len(eng.blocks.free_slots) == free_slots
    assert not eng.executor.runner.generators


def test_request_errors(tiny_models):
    eng = engine(tiny_models / "target", max_model_len=64, num_pages=8)
    with pytest.raises(ValueError, match="empty"):
        eng.add_request([], SamplingParams())
    with pytest.raises(ValueError, match="token ids"):
        eng.add_request([1, 999], SamplingParams())
    with pytest.raises(ValueError, match="context length"):
        eng.add_request(list(range(64)), SamplingParams())
    with pytest.raises(ValueError, match="cache"):
        eng.add_request([1, 2], SamplingParams(max_tokens=60))
    for bad in ({"max_tokens": 0}, {"temperature": -1.0}, {"top_p": 0.0}, {"top_p": 1.5},
                {"top_k": -2}):
        field = next(iter(bad))
        with pytest.raises(ValueError, match=field):
            SamplingParams(**bad)


def test_engine_config_errors(tiny_models):
    with pytest.raises(ValueError, match="draft-model"):
        EngineConfig(model="m", block_size=4)
    with pytest.raises(ValueError, match="block-size"):
        EngineConfig(model="m", draft_model="d", block_size=1)
    with pytest.raises(ValueError, match="bfloat16"):
        EngineConfig(model="m", dtype="float16")
    with pytest.raises(ValueError, match="hidden_size"):
        # a draft whose hidden size disagrees with the target is refused at start-up
        import json
        import shutil
        bad = tiny_models.parent / "bad-draft"
        shutil.copytree(tiny_models / "draft-full", bad, dirs_exist_ok=True)
        cfg = json.loads((bad / "config.json").read_text())
        cfg["hidden_size"] = 32
        (bad / "config.json").write_text(json.dumps(cfg))
        engine(tiny_models / "target", bad)


def test_greedy_requests_batched_with_sampled_ones_stay_exact(demo_reference):
    """Greedy acceptance runs batched on the device when every sequence of a round is greedy,
    and per sequence otherwise; greedy requests sharing rounds with sampled ones must still
    equal target-only greedy."""
    prompts, params, want = demo_reference
    sampled = [SamplingParams(max_tokens=20, temperature=1.0, seed=i) for i in range(4)]
    spec = engine(DEMO / "target", DEMO / "draft", 8)
    outs = spec.generate(prompts[:8] + prompts[:4], params[:8] + sampled)
    assert [o.output_ids for o in outs[:8]] == want[:8]
    assert all(len(o.output_ids) >= 1 for o in outs[8:])


def test_a_bad_draft_placement_names_the_field():
    with pytest.raises(ValueError, match="draft_placement must be one of"):
        EngineConfig(model=str(DEMO / "target"), draft_placement="remote")


def test_warm_up_chunks_a_prompt_runs_rounds_and_leaves_no_trace(demo_reference):
    """The warm-up as it runs on a GPU (a prompt of a full prefill budget and a page, longer
    than this model's vocabulary; CUDA graphs off, so no batch buckets), here on CPU: two
    prefill chunks and rounds, every page and slot free after, statistics untouched, and the
    engine still exact."""
    from dataclasses import replace

    prompts, params, want = demo_reference
    eng = engine(DEMO / "target", DEMO / "draft", 8, max_num_batched_tokens=600,
                 page_size=16)
    eng.cfg = replace(eng.cfg, device="cuda", enforce_eager=True)  # the GPU's warm-up size
    eng.warm_up()
    assert eng.warmup["requests"] == 1 and eng.warmup["steps"] >= 4  # 2 chunks, rounds, drop
    assert eng.stats.rounds == 0 and eng.verify_time.count == 0
    assert eng.blocks.num_free_pages == eng.blocks.num_pages and not eng.has_unfinished()
    assert [o.output_ids for o in eng.generate(prompts, params)] == want


@pytest.mark.parametrize("phase", ["prefill", "round"])
def test_a_request_whose_sampling_fails_fails_alone(monkeypatch, phase):
    """A step that raises in one sequence's sampling (planted: temperature 0.77, in its first
    token's sampling or, with the draft, in a verify round's) ends that request with finish
    reason "error" and the reason; the others' outputs are what they are without it, and the
    engine goes on serving with every page and slot back."""
    from workers import sampling

    real = sampling.probs_from_logits

    def probs_from_logits(logits, params):
        if params.temperature == 0.77 and (phase == "prefill" or logits.shape[0] > 1):
            raise RuntimeError("planted sampling failure")
        return real(logits, params)

    prompts = make_prompts(4, 11)
    params = [SamplingParams(max_tokens=12, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.9, seed=5, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.77, seed=6, ignore_eos=True),
              SamplingParams(max_tokens=12, ignore_eos=True)]
    draft = (DEMO / "draft", 4) if phase == "round" else (None, None)
    want = engine(DEMO / "target", *draft).generate(prompts, params)
    monkeypatch.setattr(sampling, "probs_from_logits", probs_from_logits)
    eng = engine(DEMO / "target", *draft)
    free = eng.blocks.num_free_pages
    got = eng.generate(prompts, params)
    assert got[2].finish_reason == "error" and "planted sampling failure" in got[2].error
    if phase == "prefill":
        assert got[2].output_ids == []
    for i in (0, 1, 3):
        assert got[i].output_ids == want[i].output_ids and got[i].finish_reason == "length"
    assert not eng.has_unfinished() and eng.blocks.num_free_pages == free
    again = eng.generate([prompts[0]], params[0])[0]
    assert again.output_ids == want[0].output_ids
