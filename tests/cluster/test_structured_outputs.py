"""Structured outputs and the sampling controls through the in-process engine: speculative
greedy output equals target-only output token for token with every control, in one batch of
mixed requests (constrained and free in the same rounds), at several block sizes; every
constrained output is valid (parses and validates, matches, is a choice) even on the tiny
random-looking model; sampling under a constraint is exact in distribution."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import Qwen3_5MoeForCausalLM, RepetitionPenaltyLogitsProcessor

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, GrammarSpec, SamplingParams
from deploy.tokenizer import load_tokenizer
from workers.grammar import Grammars
from workers.sampling import probs_from_logits
from workers.token_bitmask import unpack_bits

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"
TOKENIZER = load_tokenizer(str(DEMO / "target"))
EOS = 318  # <|im_end|>, the demo target's end of sequence

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "tags": {"type": "array", "items": {"enum": ["oak", "river", "bread"]},
                                  "maxItems": 3}}}
REGEX = r"[a-z]{2,8}( [a-z]{2,6}){2}\."
CHOICES = ["the river", "the oak tree", "bread", "a heron"]
EBNF = 'root ::= "(" num (" + " num)* ")"\nnum ::= [1-9] [0-9]?'
# xgrammar's structural tag: free text until "<", then an integer below 100 and ">"
TAG = {"type": "structural_tag", "format": {
    "type": "triggered_tags", "triggers": ["<"], "tags": [{
        "begin": "<", "end": ">", "content": {
            "type": "json_schema",
            "json_schema": {"type": "integer", "minimum": 0, "maximum": 99}}}]}}
OPENS = 121
PROMPTS = ["To make bread, mix", "The library opens at", "On the far bank, a man",
           "A heron stood in the", "Students come to read", "The oldest book in"]


def constrained(max_tokens: int = 64, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, **kw)


def requests() -> list[tuple[list[int], SamplingParams]]:
    """Mixed requests: every constraint and every control, and free ones."""
    ids = [TOKENIZER.encode(p) for p in PROMPTS]
    the = TOKENIZER.encode(" the", add_special_tokens=False)
    return [
        (ids[0], constrained(grammar=GrammarSpec("json", json.dumps(SCHEMA)))),
        (ids[1], constrained(grammar=GrammarSpec("regex", REGEX))),
        (ids[2], constrained(grammar=GrammarSpec("choice", json.dumps(CHOICES)))),
        (ids[3], constrained(grammar=GrammarSpec("grammar", EBNF))),
        (ids[4], constrained(grammar=GrammarSpec("json_object", ""), max_tokens=40)),
        (ids[5], SamplingParams(max_tokens=40, repetition_penalty=1.4)),
        (ids[2], SamplingParams(max_tokens=40, frequency_penalty=1.5, presence_penalty=0.5)),
        (ids[1], SamplingParams(max_tokens=40, presence_penalty=-1.0, min_tokens=30,
                                logit_bias=((264, 5.0), (90, -100.0)))),
        (ids[0], SamplingParams(max_tokens=40, bad_words_token_ids=((the[0],), (256, 265)))),
        (ids[3], SamplingParams(max_tokens=40, allowed_token_ids=tuple(range(64, 128)))),
        (ids[4], SamplingParams(max_tokens=40)),  # free, in the same rounds
        (ids[5], constrained(grammar=GrammarSpec("regex", "[0-9]{4}"), max_tokens=12,
                             repetition_penalty=1.2, logit_bias=((17, 3.0),))),
        (ids[1], constrained(grammar=GrammarSpec("structural_tag", json.dumps(TAG)),
                             max_tokens=24, logit_bias=((TOKENIZER.convert_tokens_to_ids("<"),
                                                         8.0),))),
        # free until token OPENS (as after a reasoning model's </think>; the free greedy
        # continuation of this prompt has it 5th), then three digits
        (ids[2], constrained(grammar=GrammarSpec("regex", "[0-9]{3}", starts_after=OPENS),
                             max_tokens=40)),
    ]


def engine(draft: bool, block_size: int | None = None, **kw) -> LLMEngine:
    kw = {"max_num_seqs": 16, "page_size": 4} | kw
    return LLMEngine(EngineConfig(model=str(DEMO / "target"),
                                  draft_model=str(DEMO / "draft") if draft else None,
                                  block_size=block_size, **kw))


@pytest.fixture(scope="module")
def target_only():
    reqs = requests()
    outs = engine(False).generate([p for p, _ in reqs], [s for _, s in reqs])
    return reqs, outs


def text(ids: list[int]) -> str:
    return TOKENIZER.decode([t for t in ids if t != EOS])


@pytest.mark.parametrize("block_size", [2, 5, 8, 16])
def test_speculative_output_equals_target_only_with_every_control(target_only, block_size):
    reqs, want = target_only
    spec = engine(True, block_size)
    got = spec.generate([p for p, _ in reqs], [s for _, s in reqs])
    for (_, params), g, w in zip(reqs, got, want, strict=True):
        assert g.output_ids == w.output_ids, params
        assert g.finish_reason == w.finish_reason
    assert spec.stats.accepted_at and spec.stats.accepted_at[0] > 0  # drafts were accepted


def test_constrained_outputs_are_valid(target_only):
    reqs, outs = target_only
    for (_, params), out in zip(reqs, outs, strict=True):
        g = params.grammar
        if g is None:
            continue
        s = text(out.output_ids)
        if g.kind == "json_object":  # any object: the random model's may outrun max_tokens
            assert s.startswith("{")
            assert out.finish_reason == "length" or isinstance(json.loads(s), dict)
            continue
        if g.kind == "structural_tag":  # every tag opened is a well-formed one
            tags = re.findall(r"<([^>]*)>", s)
            assert tags and all(re.fullmatch(r"-?(0|[1-9][0-9]*)", t) for t in tags), s
            continue
        assert out.finish_reason == "stop" and out.output_ids[-1] == EOS, (g, out)
        if g.starts_after is not None:
            ids = out.output_ids
            opened = ids.index(g.starts_after) + 1
            assert opened == 5 and re.fullmatch(g.value, text(ids[opened:])), ids
            continue
        if g.kind == "json":
            jsonschema.validate(json.loads(s), SCHEMA)
        elif g.kind == "regex":
            assert re.fullmatch(g.value, s), s
        elif g.kind == "choice":
            assert s in CHOICES
        else:
            assert re.fullmatch(r"\([1-9][0-9]?( \+ [1-9][0-9]?)*\)", s), s


def test_controls_change_the_output_as_they_say(target_only):
    reqs, outs = target_only
    by = {i: (params, out.output_ids)
          for i, ((_, params), out) in enumerate(zip(reqs, outs, strict=True))}
    params, ids = by[7]  # min_tokens 30, token 90 banned by a bias of -100
    assert len(ids) >= 30 and 90 not in ids and EOS not in ids[:30]
    params, ids = by[8]  # bad words: " the" never; 265 never right after 256
    assert params.bad_words_token_ids[0][0] not in ids
    assert all(not (a == 256 and b == 265) for a, b in zip(ids[:-1], ids[1:], strict=True))
    params, ids = by[9]  # allowed_token_ids
    assert all(64 <= t < 128 for t in ids)
    params, ids = by[6]  # the penalties (their formula: tests/workers/test_controls.py) on a
    # prompt whose free continuation repeats itself
    free = engine(False).generate([reqs[6][0]], SamplingParams(max_tokens=40))[0].output_ids
    assert len(set(ids)) > len(set(free))


def test_an_uncompilable_grammar_fails_its_request_alone():
    eng = engine(True, 4)
    ok = SamplingParams(max_tokens=8)
    bad = SamplingParams(max_tokens=8, grammar=GrammarSpec("regex", "(a"))
    outs = eng.generate([TOKENIZER.encode(PROMPTS[0])] * 2, [ok, bad])
    assert outs[0].finish_reason == "length" and len(outs[0].output_ids) == 8
    assert outs[1].finish_reason == "error" and "does not compile" in outs[1].error
    # and the engine serves on
    assert eng.generate([TOKENIZER.encode(PROMPTS[1])], ok)[0].finish_reason == "length"


# ---- sampling under a constraint is exact in distribution ----------------------------------

N = 1500
# bans what makes up a fifth of the first token's mass, keeps what the draft proposes
MASK_SPEC = GrammarSpec("regex", "[^:`x\\n]{1,12}")


def exact_joint(params: SamplingParams, prompt: list[int], eos_ids: list[int]
                ) -> dict[tuple[int, int], float]:
    """The law of the first two tokens from transformers' model, masked by xgrammar's own
    matcher and penalized by transformers' RepetitionPenaltyLogitsProcessor."""
    hf = Qwen3_5MoeForCausalLM.from_pretrained(DEMO / "target", dtype=torch.float32).eval()
    grammars = Grammars(TOKENIZER, hf.config.vocab_size)
    matcher = grammars.matcher(grammars.compile(params.grammar), eos_ids)
    penalty = RepetitionPenaltyLogitsProcessor(params.repetition_penalty)
    bitmask = xgr.allocate_token_bitmask(1, hf.config.vocab_size)

    def probs(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            logits = hf(torch.tensor([ids])).logits[0, -1:]
        matcher.fill_next_token_bitmask(bitmask)
        logits = logits.masked_fill(~unpack_bits(bitmask, logits.shape[-1]), float("-inf"))
        return probs_from_logits(penalty(torch.tensor([ids]), logits), params)[0]

    joint = {}
    p1 = probs(prompt)
    for t1 in p1.nonzero().flatten().tolist():
        assert matcher.accept_token(t1)
        p2 = probs(prompt + [t1])
        matcher.rollback(1)
        for t2 in p2.nonzero().flatten().tolist():
            joint[(t1, t2)] = (p1[t1] * p2[t2]).item()
    return joint


def test_sampling_under_a_grammar_follows_the_masked_target_distribution():
    from test_sampling_distribution import PROMPT, noise_bound, tv

    params = SamplingParams(max_tokens=2, temperature=1.0, min_p=0.02, repetition_penalty=1.3,
                            grammar=MASK_SPEC, ignore_eos=True)
    eng = engine(True, 4, max_model_len=32, max_num_seqs=512)
    exact = exact_joint(params, PROMPT, sorted(eng.eos_ids))
    outs = eng.generate([PROMPT] * N, [SamplingParams(
        max_tokens=2, temperature=1.0, min_p=0.02, repetition_penalty=1.3, grammar=MASK_SPEC,
        ignore_eos=True, seed=i) for i in range(N)])
    counts: dict[tuple[int, int], float] = {}
    for o in outs:
        counts[tuple(o.output_ids)] = counts.get(tuple(o.output_ids), 0) + 1 / N
    assert eng.stats.rounds > 0 and eng.stats.accepted_at[0] > 0
    assert tv(counts, exact) < noise_bound(exact)


@pytest.mark.gpu
def test_on_cuda_with_captured_rounds_the_output_still_equals_target_only():
    """The same mixed batch on the GPU (fp32): rounds and proposals replay CUDA graphs, the
    masks, bias and penalties run on the device after them, the grammar's proposals through
    the draft's top-k graph."""
    reqs = requests()
    prompts, params = [p for p, _ in reqs], [s for _, s in reqs]
    want = engine(False, device="cuda", num_pages=512).generate(prompts, params)
    for block_size in (8, 16):
        spec = engine(True, block_size, device="cuda", num_pages=512)
        got = spec.generate(prompts, params)
        assert [g.output_ids for g in got] == [w.output_ids for w in want]
        assert any(k[-1] == 8 for k in spec.executor.drafter.graphs)  # the top-k proposals
    for (_, p), out in zip(reqs, want, strict=True):
        if p.grammar is not None and p.grammar.kind == "json":
            jsonschema.validate(json.loads(text(out.output_ids)), SCHEMA)
