"""The scheduler without models: prefill chunks within the token budget, alternation between
prefill steps and decode rounds, FCFS admission without overtaking, resources of sequences
aborted mid-prefill, max_num_seqs."""

from __future__ import annotations

import itertools

import pytest

from cluster.block_manager import BlockManager
from cluster.scheduler import ScheduledStep, Scheduler
from cluster.sequence import Sequence
from configs.engine import EngineConfig, SamplingParams

_ids = itertools.count()


def seq(prompt_len: int, max_tokens: int = 8) -> Sequence:
    i = next(_ids)
    return Sequence(i, f"req-{i}", [1] * prompt_len, SamplingParams(max_tokens=max_tokens))


def scheduler(budget: int = 7, max_num_seqs: int = 8, num_pages: int = 256,
              page_size: int = 4, lookahead: int = 4) -> Scheduler:
    blocks = BlockManager(num_pages, page_size, max_num_seqs)
    return Scheduler(blocks, max_num_seqs, max_model_len=512, lookahead=lookahead,
                     max_num_batched_tokens=budget)


def run(sched: Scheduler, plan: ScheduledStep, block: int = 4) -> None:
    """What the engine does with a plan: cache the chunks (a prompt's last chunk yields the
    first token), or commit one token per decode-ready sequence and finish at max_tokens."""
    for s, n in zip(plan.prefill, plan.chunk_lens, strict=True):
        s.num_cached += n
        if s.prefilled:
            s.output_ids.append(0)
    for s in plan.decode:
        s.num_cached += 1
        s.output_ids.append(0)
    for s in plan.prefill + plan.decode:
        if s.prefilled and len(s.output_ids) >= s.params.max_tokens:
            sched.finish(s, "length")


def kind(plan: ScheduledStep) -> str:
    assert not (plan.prefill and plan.decode)
    return "P" if plan.prefill else "D" if plan.decode else "-"


def test_chunks_respect_the_budget_and_cover_each_prompt_in_order():
    sched = scheduler(budget=7)
    seqs = [seq(20), seq(3), seq(10), seq(1), seq(7)]
    for s in seqs:
        sched.add(s)
    fed = {s.seq_id: 0 for s in seqs}
    while sched.has_work():
        plan = sched.schedule()
        assert sum(plan.chunk_lens) <= 7
        assert all(n > 0 for n in plan.chunk_lens)
        for s, n in zip(plan.prefill, plan.chunk_lens, strict=True):
            assert s.num_cached == fed[s.seq_id]  # chunks are contiguous, start at num_cached
            assert n <= s.num_prompt_left
            fed[s.seq_id] += n
        if plan.decode:  # a round holds exactly the sequences whose prompt is cached
            assert [s.seq_id for s in plan.decode] == [
                s.seq_id for s in sched.running if s.prefilled
            ]
        run(sched, plan)
        # At most one prompt is left unfinished by a step: it goes first in the next one.
        assert sum(not s.prefilled for s in sched.running) <= 1
    assert fed == {s.seq_id: len(s.prompt_ids) for s in seqs}
    assert all(s.finished and len(s.output_ids) == 8 for s in seqs)


def test_first_prefill_step_fills_the_budget_across_prompts():
    sched = scheduler(budget=7)
    a, b, c = seq(5), seq(4), seq(3)
    for s in (a, b, c):
        sched.add(s)
    plan = sched.schedule()
    assert plan.prefill == [a, b] and plan.chunk_lens == [5, 2]
    run(sched, plan)
    plan = sched.schedule()  # a is decode-ready: its round comes before b's next chunk
    assert kind(plan) == "D" and plan.decode == [a]
    run(sched, plan)
    plan = sched.schedule()
    assert plan.prefill == [b, c] and plan.chunk_lens == [2, 3]


def test_a_long_prompt_alternates_with_decode_rounds():
    sched = scheduler(budget=7)
    short = [seq(3, max_tokens=40), seq(2, max_tokens=40)]
    for s in short:
        sched.add(s)
    run(sched, sched.schedule())  # both prompts in one prefill step
    assert all(s.prefilled for s in short)
    run(sched, sched.schedule())  # a round; the long prompt arrives after it
    long = seq(30, max_tokens=4)
    sched.add(long)
    kinds = []
    while not long.prefilled:
        plan = sched.schedule()
        kinds.append(kind(plan))
        if plan.decode:
            assert plan.decode == short  # the prefilling sequence is not in the round
        run(sched, plan)
    # 30 tokens in chunks of 7 → 5 prefill steps with a round between each two.
    assert "".join(kinds) == "PDPDPDPDP"
    plan = sched.schedule()
    assert kind(plan) == "D" and plan.decode == [*short, long]


def test_a_stream_of_decode_work_cannot_starve_admission():
    sched = scheduler(budget=7)
    running = seq(2, max_tokens=100)
    sched.add(running)
    run(sched, sched.schedule())
    for _ in range(5):  # a new request after every step; admission never waits past one round
        new = seq(4, max_tokens=100)
        sched.add(new)
        kinds = []
        while not new.prefilled:
            plan = sched.schedule()
            kinds.append(kind(plan))
            run(sched, plan)
        assert len(kinds) <= 2


def test_prefill_runs_back_to_back_when_nothing_decodes():
    sched = scheduler(budget=7)
    long = seq(30)
    sched.add(long)
    kinds = []
    while not long.prefilled:
        plan = sched.schedule()
        kinds.append(kind(plan))
        run(sched, plan)
    assert kinds == ["P"] * 5


def test_fcfs_admission_without_overtaking():
    # 16 pages of 4 positions. reach = prompt + max_tokens + lookahead 4.
    sched = scheduler(budget=100, num_pages=16)
    first = seq(4, max_tokens=20)  # 28 positions → 7 pages
    big = seq(20, max_tokens=20)  # 44 → 11 pages: does not fit beside `first`
    small = seq(2, max_tokens=2)  # 8 → 2 pages: would fit, but must not overtake `big`
    for s in (first, big, small):
        sched.add(s)
    plan = sched.schedule()
    assert plan.prefill == [first]
    assert list(sched.waiting) == [big, small]
    while not first.finished:
        plan = sched.schedule()
        assert big not in plan.prefill and small not in plan.prefill
        run(sched, plan)
    plan = sched.schedule()
    assert plan.prefill == [big, small]  # 11 + 2 of the 16 pages
    assert not sched.waiting


def test_a_request_waiting_for_memory_does_not_block_decode_rounds():
    sched = scheduler(budget=100, num_pages=16)
    first, big = seq(4, max_tokens=20), seq(20, max_tokens=20)
    sched.add(first)
    sched.add(big)
    run(sched, sched.schedule())
    for _ in range(3):
        plan = sched.schedule()
        assert kind(plan) == "D" and plan.decode == [first]
        run(sched, plan)


def test_abort_mid_prefill_frees_pages_and_slot():
    sched = scheduler(budget=7)
    blocks = sched.blocks
    free_blocks, free_slots = len(blocks.free_blocks), len(blocks.free_slots)
    long, other = seq(30), seq(3)
    sched.add(long)
    sched.add(other)
    run(sched, sched.schedule())
    assert 0 < long.num_cached < 30 and long.block_table and long.state_slot >= 0
    sched.finish(long, "abort")
    assert long.finished and long.block_table == [] and long.state_slot == -1
    assert long not in sched.running
    plan = sched.schedule()
    assert plan.prefill == [other] and plan.chunk_lens == [3]
    run(sched, plan)
    sched.finish(other, "abort")
    assert not sched.has_work()
    assert len(blocks.free_blocks) == free_blocks and len(blocks.free_slots) == free_slots


def test_abort_while_waiting_frees_nothing_it_did_not_take():
    sched = scheduler(budget=7, max_num_seqs=1)
    a, b = seq(3), seq(3)
    sched.add(a)
    sched.add(b)
    run(sched, sched.schedule())
    free_blocks = len(sched.blocks.free_blocks)
    sched.finish(b, "abort")
    assert len(sched.blocks.free_blocks) == free_blocks and not sched.waiting


def test_max_num_seqs_is_respected():
    sched = scheduler(budget=1000, max_num_seqs=2)
    seqs = [seq(3, max_tokens=3) for _ in range(5)]
    for s in seqs:
        sched.add(s)
    admitted_order = []
    while sched.has_work():
        plan = sched.schedule()
        assert len(sched.running) <= 2
        assert len(plan.prefill) + len(plan.decode) <= 2
        admitted_order += [s.seq_id for s in plan.prefill if s.num_cached == 0]
        run(sched, plan)
    assert admitted_order == [s.seq_id for s in seqs]  # FCFS


def test_max_num_batched_tokens_is_validated():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        EngineConfig(model="m", max_num_batched_tokens=0)
    assert EngineConfig(model="m").max_num_batched_tokens == 8192
