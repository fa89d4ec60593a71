"""Acceptance replay (draft/replay.py): the curve's draws meet its mean acceptance length; an
engine replaying commits exactly the tokens the curve says in every round of a recorded prompt,
and its outputs are those of the recording run (the target's)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from draft.replay import AcceptanceCurve

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"


@pytest.mark.parametrize("tau", [1.0, 2.5, 6.3, 16.0])
def test_a_mean_length_is_met_by_the_draws(tau):
    curve = AcceptanceCurve.from_spec(str(tau), 15)
    assert curve.mean_length() == pytest.approx(tau, abs=1e-9)
    rng = random.Random(0)
    draws = [curve.draw(rng) for _ in range(40_000)]
    assert min(draws) >= 0 and max(draws) <= 15
    assert 1 + sum(draws) / len(draws) == pytest.approx(tau, rel=0.02)


def test_a_curve_from_a_list_or_a_file(tmp_path):
    assert AcceptanceCurve.from_spec("[1, 0.5]", 4).accept == (1.0, 0.5, 0.0, 0.0)
    assert AcceptanceCurve.from_spec("[1, 1, 1, 1, 1]", 3).mean_length() == 4
    (tmp_path / "curve.json").write_text("[0.9, 0.8, 0.7]")
    curve = AcceptanceCurve.from_spec(str(tmp_path / "curve.json"), 3)
    assert curve.mean_length() == pytest.approx(1 + 0.9 + 0.72 + 0.504)


@pytest.mark.parametrize("spec, match", [
    ("17", r"in \[1, 16\]"), ("0.5", r"in \[1, 16\]"), ("[1.5]", "probabilities in"),
    ('["a"]', "probabilities in"), ("[0.5", "probabilities in"),
    ("no-such-file.json", "neither a number"),
])
def test_bad_specs_are_refused(spec, match):
    with pytest.raises(ValueError, match=match):
        AcceptanceCurve.from_spec(spec, 15)


def test_the_engine_config_checks_it():
    with pytest.raises(ValueError, match="needs --draft-model"):
        EngineConfig(model=str(DEMO / "target"), acceptance_replay="6.3")
    with pytest.raises(ValueError, match="must be >= 1"):
        EngineConfig(model=str(DEMO / "target"), draft_model=str(DEMO / "draft"),
                     acceptance_replay="0")
    with pytest.raises(ValueError, match="neither a mean acceptance length"):
        EngineConfig(model=str(DEMO / "target"), draft_model=str(DEMO / "draft"),
                     acceptance_replay="nowhere.json")


@pytest.mark.parametrize("curve, per_round", [("[1, 1, 0]", 3), ("1", 1), ("4", 4)])
def test_a_recorded_prompt_commits_what_the_curve_says(curve, per_round):
    engine = LLMEngine(EngineConfig(
        model=str(DEMO / "target"), draft_model=str(DEMO / "draft"), block_size=4,
        max_num_seqs=4, page_size=4, enable_prefix_caching=False, acceptance_replay=curve))
    prompts = [[11, 12, 13, 14, 15], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 8]]
    params = SamplingParams(max_tokens=25, ignore_eos=True)
    first = engine.generate(prompts, params)  # records: no earlier output of these prompts
    second = engine.generate(prompts, params)  # replays
    reference = LLMEngine(EngineConfig(model=str(DEMO / "target"), max_num_seqs=4,
                                       page_size=4)).generate(prompts, params)
    for a, b, want in zip(first, second, reference, strict=True):
        assert a.output_ids == b.output_ids == want.output_ids
        # the prefill's token, then rounds of `per_round` tokens; the last one cut by max_tokens
        lengths = b.acceptance_lengths
        assert lengths[:-1] == [per_round] * (len(lengths) - 1)
        assert 1 <= lengths[-1] <= per_round and 1 + sum(lengths) == 25
