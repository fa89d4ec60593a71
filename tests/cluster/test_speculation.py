"""Adaptive speculation (cluster/speculation.py): the rule's choice against the costs and the
acceptance it sees, its estimates, and an engine that measures its costs at warm-up and
switches lengths with target-only's outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from cluster.engine import LLMEngine
from cluster.sequence import Sequence
from cluster.speculation import (
    PROBE_AFTER,
    AdaptiveDraftLength,
    RoundCosts,
    candidates,
    expected_tokens,
)
from configs.engine import EngineConfig, SamplingParams

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"

# An H100-like shape: a decode step of 4 ms at batch 1, 9 at 8, 20 at 32; a 16-token verify
# 12, 30 and 55 ms (its tokens reach many more experts); the shorter blocks in between.
COSTS = RoundCosts((1, 8, 32), {0: (4e-3, 9e-3, 20e-3), 3: (7e-3, 16e-3, 32e-3),
                                7: (9e-3, 21e-3, 42e-3), 15: (12e-3, 30e-3, 55e-3)})


def seqs(n: int) -> list[Sequence]:
    return [Sequence(i, str(i), [1, 2], SamplingParams()) for i in range(n)]


def test_candidates_and_expected_tokens():
    assert candidates(16) == (15, 7, 3, 0) and candidates(8) == (7, 3, 0)
    assert candidates(4) == (3, 0) and candidates(2) == (1, 0)
    assert expected_tokens(0.0, 15) == 1 and expected_tokens(1.0, 7) == 8
    assert expected_tokens(0.5, 2) == 1.75


def test_costs_interpolate_between_the_measured_sizes():
    assert COSTS.round_seconds(1, 0) == 4e-3 and COSTS.round_seconds(8, 15) == 30e-3
    assert COSTS.round_seconds(20, 0) == pytest.approx(14.5e-3)
    assert COSTS.round_seconds(64, 0) == pytest.approx(40e-3)  # in proportion past the last
    with pytest.raises(ValueError, match="ascending"):
        RoundCosts((8, 1), {0: (1.0, 1.0)})
    with pytest.raises(ValueError, match="one positive time"):
        RoundCosts((1, 8), {0: (1.0,)})


@pytest.mark.parametrize(("rate", "batch", "want"), [
    (0.9, 1, 15),   # a good draft, one user: the whole block
    (0.9, 32, 15),  # still worth it at 32: 6.9 tokens a round for 2.75× a decode
    (0.5, 1, 3),    # a weak draft: a short block
    (0.3, 32, 0),   # a weak draft under load: plain decoding
    (0.0, 1, 0),    # a draft that never guesses right: plain decoding
])
def test_the_rule_maximises_tokens_per_second(rate, batch, want):
    rule = AdaptiveDraftLength(COSTS, 16)
    assert rule.choose([rate] * batch) == want
    speeds = {k: batch * expected_tokens(rate, k) / COSTS.round_seconds(batch, k)
              for k in candidates(16)}
    assert max(speeds, key=speeds.get) == want


def test_estimates_follow_the_rounds_and_probes_come_back():
    rule = AdaptiveDraftLength(COSTS, 16)
    batch = seqs(8)
    first = rule(batch)
    assert first in candidates(16) and rule.chosen == {first: 1}
    for _ in range(20):  # every draft rejected: the rates fall, the rule stops drafting
        k = rule(batch)
        for s in batch:
            rule.observe(s.seq_id, 0, k)
    assert rule.rate(0) < 0.1 and rule(batch) == 0
    for _ in range(PROBE_AFTER):  # rounds without drafts teach nothing ...
        for s in batch:
            rule.observe(s.seq_id, 0, 0)
    assert rule(batch) == 3  # ... so a short block probes
    for s in batch:
        rule.observe(s.seq_id, 0, 3)
    young = seqs(9)[8:]  # a sequence that just joined: still a probe after 64 rounds of the rest
    for _ in range(PROBE_AFTER):
        assert rule(batch + young) == 0
        for s in batch + young:
            rule.observe(s.seq_id, 0, 0)
    rule.forget(8)
    assert rule(batch + seqs(10)[9:]) == 3
    for _ in range(12):  # every draft accepted now: the rates recover, the whole block again
        k = rule(batch)
        for s in batch:
            rule.observe(s.seq_id, k, k)
    assert rule.rate(0) > 0.8 and rule(batch) == 15
    rule.forget(0)  # a new sequence starts from the engine-wide rate
    assert rule.rate(0) == pytest.approx(rule.rate(100))


def test_an_adaptive_engine_measures_its_costs_and_stays_exact():
    """The warm-up times rounds at each length the rule may pick; the rule then drafts as it
    sees fit (the trained demo draft at 1 and 4 sequences) with target-only's outputs."""
    prompts = [[11, 12, 13, 14, 15], [40, 41, 42, 43, 44, 45, 46, 47, 48], [7, 8], [300, 2]]
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    want = LLMEngine(EngineConfig(model=str(DEMO / "target"), max_num_seqs=4,
                                  page_size=4)).generate(prompts, params)
    engine = LLMEngine(EngineConfig(model=str(DEMO / "target"), draft_model=str(DEMO / "draft"),
                                    block_size=16, max_num_seqs=4, page_size=4,
                                    speculative_adaptive=True))
    engine.warm_up()
    rule = engine.draft_length
    assert isinstance(rule, AdaptiveDraftLength) and rule.costs.batch_sizes == (1, 4)
    assert sorted(rule.costs.seconds) == [0, 3, 7, 15] and rule.chosen == {}
    assert engine.stats.rounds == 0  # the measurement is not counted
    got = engine.generate(prompts, params)
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    assert sum(rule.chosen.values()) > 0 and not rule.by_seq  # every sequence forgotten
    alone = engine.generate(prompts[:1], params)
    assert alone[0].output_ids == want[0].output_ids
