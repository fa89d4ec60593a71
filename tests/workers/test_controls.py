"""The sampling controls on one verify block's logits agree, row by row, with transformers'
own logits processors (or vLLM's written formula where transformers has none) applied to the
tokens that row has seen: the prompt, the committed output and the drafts before it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import (
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
)

from configs.engine import GrammarSpec, SamplingParams
from deploy.tokenizer import load_tokenizer
from workers.controls import ControlsEnv, SeqControls
from workers.logit_controls import ControlRows, apply_controls
from workers.sampling import probs_from_logits
from workers.token_bitmask import clear_bits, pack_bits, unpack_bits

DEMO_TARGET = Path(__file__).resolve().parents[1] / "assets" / "tiny" / "target"
V = 384
EOS = (317, 318)
PROMPT = [5, 9, 9, 40, 200, 7]
GENERATED = [9, 11, 11, 300, 5]
BLOCK = [12, 11, 40, 77, 11]  # the anchor (its row predicts d1), then d1..d4


def block_logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(len(BLOCK), V, generator=torch.Generator().manual_seed(seed)) * 3


def controlled(params: SamplingParams, logits: torch.Tensor) -> torch.Tensor:
    c = SeqControls(ControlsEnv(V, "cpu"), params, PROMPT, EOS)
    c.commit(GENERATED[:-1])
    c.commit(GENERATED[-1:] + [BLOCK[0]])  # committed in two steps; the anchor is output too
    out = logits.clone()
    assert apply_controls(out, [ControlRows(0, c, 0, BLOCK)]) == {}
    return out


def seen(j: int) -> list[int]:
    """The output row j has seen: the committed output (anchor included) and d1..dj."""
    return GENERATED + BLOCK[: j + 1]


@pytest.mark.parametrize(("rep", "freq", "pres"), [(1.3, 0.0, 0.0), (0.7, 0.0, 0.0),
                                                   (1.0, 0.8, -0.5), (1.2, -1.5, 2.0)])
def test_penalties_follow_vllms_formula_and_transformers_repetition_penalty(rep, freq, pres):
    logits = block_logits()
    got = controlled(SamplingParams(repetition_penalty=rep, frequency_penalty=freq,
                                    presence_penalty=pres), logits)
    for j in range(len(BLOCK)):
        row = logits[j : j + 1]
        if rep != 1:  # over the prompt and the output
            row = RepetitionPenaltyLogitsProcessor(rep)(torch.tensor([PROMPT + seen(j)]), row)
        counts = torch.bincount(torch.tensor(seen(j)), minlength=V).float()  # the output only
        want = row[0] - freq * counts - pres * (counts > 0).float()
        torch.testing.assert_close(got[j], want)


def test_logit_bias_matches_transformers_sequence_bias():
    logits = block_logits(1)
    bias = ((3, 2.5), (11, -100.0), (383, 7.0))
    got = controlled(SamplingParams(logit_bias=bias), logits)
    want = SequenceBiasLogitsProcessor({(t,): b for t, b in bias})(
        torch.tensor([PROMPT + seen(0)]), logits.clone())
    torch.testing.assert_close(got, want)


def test_min_tokens_matches_transformers_and_holds_back_stop_token_ids():
    logits = block_logits(2)
    # 6 tokens are out before row 0 (the anchor included): rows 0..2 are below 9
    params = SamplingParams(min_tokens=9, stop_token_ids=(42,))
    got = controlled(params, logits)
    ends = [*EOS, 42]
    for j in range(len(BLOCK)):
        ids = torch.tensor([PROMPT + seen(j)])
        want = MinNewTokensLengthLogitsProcessor(len(PROMPT), 9, ends)(ids, logits[j : j + 1])
        torch.testing.assert_close(got[j : j + 1], want)
    assert torch.isinf(got[2, 318]) and not torch.isinf(got[3, 318])
    # ignore_eos: the end-of-sequence ids are not ends, stop_token_ids still are
    got = controlled(SamplingParams(min_tokens=9, stop_token_ids=(42,), ignore_eos=True), logits)
    assert not torch.isinf(got[0, 318]) and torch.isinf(got[0, 42])


def test_bad_words_match_transformers_over_the_output():
    logits = block_logits(3)
    words = ((200,), (11, 40), (11, 77, 5), (40, 77))  # one token; two; three; the drafts'
    got = controlled(SamplingParams(bad_words_token_ids=words), logits)
    for j in range(len(BLOCK)):
        want = NoBadWordsLogitsProcessor([list(w) for w in words], eos_token_id=list(EOS))(
            torch.tensor([seen(j)]), logits[j : j + 1].clone())
        torch.testing.assert_close(got[j : j + 1], want)
    assert torch.isinf(got[1, 40]) and torch.isinf(got[2, 77])  # row 2 has seen 11, 40


def test_allowed_token_ids_mask_everything_else():
    logits = block_logits(4)
    allowed = (0, 31, 32, 63, 64, 383)
    got = controlled(SamplingParams(allowed_token_ids=allowed), logits)
    keep = torch.zeros(V, dtype=torch.bool)
    keep[list(allowed)] = True
    assert torch.equal(got[:, keep], logits[:, keep]) and torch.isinf(got[:, ~keep]).all()


def test_min_p_matches_transformers_after_temperature():
    logits = block_logits(5)
    params = SamplingParams(temperature=0.7, min_p=0.08)
    want = torch.softmax(MinPLogitsWarper(0.08)(None, TemperatureLogitsWarper(0.7)(None, logits)),
                         dim=-1)
    torch.testing.assert_close(probs_from_logits(logits, params), want)


def test_bitmasks_pack_unpack_and_clear_every_bit():
    rng = np.random.default_rng(0)
    allowed = rng.random((3, V)) < 0.5
    words = pack_bits(allowed)
    assert words.dtype == np.int32 and words.shape == (3, V // 32)
    assert torch.equal(unpack_bits(torch.from_numpy(words), V), torch.from_numpy(allowed))
    row = pack_bits(np.ones((1, V), bool))[0]
    clear_bits(row, [0, 31, 32, 63, 383])
    got = unpack_bits(torch.from_numpy(row[None]), V)[0]
    assert (~got).nonzero().flatten().tolist() == [0, 31, 32, 63, 383]


def test_a_grammars_block_masks_are_the_matchers_step_by_step():
    """Row j's mask is the matcher's after d1..dj; the walk leaves the matcher where it was;
    only committed tokens advance it."""
    import xgrammar as xgr

    tok = load_tokenizer(str(DEMO_TARGET))
    env = ControlsEnv.for_checkpoint(str(DEMO_TARGET), V, "cpu")
    spec = GrammarSpec("regex", "(ab|cd)+e")
    c = SeqControls(env, SamplingParams(grammar=spec), [1, 2], EOS)
    a, b, cc, d = (tok.convert_tokens_to_ids(x) for x in "abcd")
    c.commit([a])
    block = [a, b, cc, d, a]
    out = torch.full((len(block), V // 32), -1, dtype=torch.int32)
    c.fill_masks(block, out)
    ref = env.grammars().matcher(env.grammars().compile(spec), EOS)
    want = xgr.allocate_token_bitmask(len(block), V)
    assert ref.accept_token(a)
    for j, t in enumerate(block[1:] + [None]):
        ref.fill_next_token_bitmask(want, j)
        if t is not None:
            assert ref.accept_token(t)
    assert torch.equal(out, want)
    # the walk rolled back: the next block's first row is again the mask after "a"
    again = torch.full((1, V // 32), -1, dtype=torch.int32)
    c.fill_masks([a], again)
    assert torch.equal(again[0], out[0])


def test_a_grammar_that_starts_after_a_token_is_free_until_it_is_generated():
    """starts_after (a reasoning model's </think>): rows before the opening draft are free,
    the rows after it are the matcher's from its start; committed tokens before the opening
    token do not advance the matcher; the draft's proposal is free up to it."""
    import xgrammar as xgr

    tok = load_tokenizer(str(DEMO_TARGET))
    env = ControlsEnv.for_checkpoint(str(DEMO_TARGET), V, "cpu")
    end = tok.convert_tokens_to_ids("</think>")
    spec = GrammarSpec("regex", "(ab|cd)+e", starts_after=end)
    c = SeqControls(env, SamplingParams(grammar=spec), [1, 2], EOS)
    a, b, cc, d, z = (tok.convert_tokens_to_ids(x) for x in "abcdz")
    c.commit([z, z])  # reasoning: the grammar waits
    block = [z, z, end, a, b, cc]
    out = torch.full((len(block), V // 32), -1, dtype=torch.int32)
    c.fill_masks(block, out)
    assert (out[:2] == -1).all()  # the rows predicting d1 (z) and d2 (</think>)
    ref = env.grammars().matcher(env.grammars().compile(spec), EOS)
    want = xgr.allocate_token_bitmask(4, V)  # after </think>, then after a, b, cd
    for j, t in enumerate([a, b, cc, None]):
        ref.fill_next_token_bitmask(want, j)
        if t is not None:
            assert ref.accept_token(t)
    assert torch.equal(out[2:], want) and not (out[2] == -1).all()
    # the proposal: top candidates until </think>, then the best legal ones
    assert c.constrain_proposal([[z, a], [end, a], [z, cc], [z, d]]) == [z, end, cc, d]
    assert c.waiting_for == end  # nothing committed yet
    c.commit([z, end, a])  # the grammar opens and takes "a"
    assert c.waiting_for is None
    row = torch.full((1, V // 32), -1, dtype=torch.int32)
    c.fill_masks([a], row)
    assert torch.equal(row[0], want[1])


def penalized_batch(kernel: str, device: str, dtype: torch.dtype, v: int = V
                    ) -> tuple[torch.Tensor, torch.Tensor, list]:
    """Three penalized sequences in one step's logits around an uncontrolled row: a verify
    block with all three penalties, a prefill's sampled row (no block) with frequency only,
    a shorter block with the repetition penalty only. → (logits before, after, the rows)."""
    env = ControlsEnv(v, device, penalties=kernel)
    specs = [(SamplingParams(repetition_penalty=1.3, frequency_penalty=0.6,
                             presence_penalty=-0.4), BLOCK),
             (SamplingParams(frequency_penalty=1.1), []),
             (SamplingParams(repetition_penalty=0.8), [40, 9, 9])]
    rows, first = [], 1  # row 0: a sequence without controls
    for i, (params, block) in enumerate(specs):
        c = SeqControls(env, params, PROMPT, EOS)
        c.commit(GENERATED + block[:1])
        rows.append(ControlRows(i, c, first, block))
        first += max(len(block), 1)
    g = torch.Generator().manual_seed(1)
    logits = (torch.randn(first + 1, v, generator=g) * 3).to(device, dtype)
    logits[:, 2] = float("-inf")  # a masked token stays masked
    out = logits.clone()
    assert apply_controls(out, rows) == {}
    return logits, out, rows


def test_penalties_of_a_batch_are_each_sequences_alone():
    logits, out, rows = penalized_batch("torch", "cpu", torch.float32)
    for r in rows:
        alone = logits[r.first : r.first + r.num_rows].clone()
        apply_controls(alone, [ControlRows(0, r.controls, 0, r.block)])
        assert torch.equal(out[r.first : r.first + r.num_rows], alone)
    assert torch.equal(out[0], logits[0]) and torch.equal(out[-1], logits[-1])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_penalties_are_the_torch_forms_bits(dtype):
    """Qwen3.5's vocabulary width (not a multiple of the kernel's block)."""
    v = 248_320 + 77
    before, want, _ = penalized_batch("torch", "cuda", dtype, v)
    again, got, _ = penalized_batch("triton", "cuda", dtype, v)
    assert torch.equal(before, again)
    assert torch.equal(got, want)
    assert not torch.equal(got, before)
