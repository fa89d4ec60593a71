"""Prefix caching is exact: with the cache, greedy output (and the draft's acceptance, which
reads the shared pages' context K/V) is token for token what the same engine without it
produces, for repeated prompts, prompts sharing a system prompt concurrently, prompts that
diverge inside a page, at a page boundary and between snapshots, under eviction, with a
seeded sampler, and for a next turn that resumes at the snapshot a finished answer left; an
aborted prefill leaves nothing a later prompt can hit. And the cache's bookkeeping: hash
chains, hits at the deepest snapshot, reference counts, eviction order, boundary slots."""

from __future__ import annotations

import pytest
import torch

from cluster.block_manager import BlockManager
from cluster.engine import LLMEngine
from cluster.prefix_cache import PrefixCache, page_keys
from cluster.scheduler import Scheduler
from cluster.sequence import Sequence
from configs.engine import EngineConfig, SamplingParams

P = 4  # page size
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 316, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- the bookkeeping --------------------------------------------------------------------------


def test_page_keys_chain_over_the_whole_prefix():
    a, b = tokens(12, 0), tokens(12, 1)
    ka, kb = page_keys(a, P), page_keys(a[:4] + b[4:], P)
    assert len(ka) == 3 and ka[0] == kb[0] and ka[1] != kb[1]
    # the same page after different prefixes has different keys
    assert page_keys(b[:4] + a[4:8], P)[1] != ka[1]
    # a chain continued from a parent is the whole chain's tail
    assert page_keys(a, P, ka[0], 1) == ka[1:]
    assert page_keys(a[:11], P) == ka[:2]  # a partial page has no key


def cached(cache: PrefixCache, prompt: list[int], pages: list[int], snap_pages: list[int],
           slots: list[int]) -> list[bytes]:
    keys = page_keys(prompt, P)
    cache.enter_pages(keys, pages)
    for n, slot in zip(snap_pages, slots, strict=True):
        assert cache.enter_snapshot(keys[n - 1], slot, n, None)
    cache.release(pages)
    return keys


def test_a_hit_is_the_deepest_snapshot_that_leaves_a_token_to_prefill():
    cache = PrefixCache(P, [100, 101, 102])
    prompt = tokens(16, 0)
    keys = cached(cache, prompt, [7, 8, 9, 10], [1, 3, 4], [100, 101, 102])
    hit = cache.lookup(16, keys)  # page 4's snapshot would leave nothing to prefill
    assert (hit.pages, hit.snapshot_slot, hit.num_tokens) == ([7, 8, 9], 101, 12)
    hit = cache.lookup(17, page_keys(prompt + [1], P))
    assert (hit.pages, hit.snapshot_slot, hit.num_tokens) == ([7, 8, 9, 10], 102, 16)
    other = prompt[:6] + [(t + 1) % 316 for t in prompt[6:]]  # diverges inside page 2
    hit = cache.lookup(16, page_keys(other, P))
    assert (hit.pages, hit.snapshot_slot, hit.num_tokens) == ([7], 100, 4)
    assert cache.lookup(4, keys).snapshot_slot is None  # shorter than a page and a token


def test_held_pages_are_not_evicted_and_released_chains_go_deepest_first():
    cache = PrefixCache(P, [50])
    blocks = BlockManager(6, P, 2, cache)
    seq = Sequence(0, "a", tokens(16, 0), GREEDY)
    blocks.admit(seq, 16)
    cache.enter_pages(page_keys(seq.prompt_ids, P), seq.block_table)
    assert blocks.num_free_pages == 2
    blocks.free(seq)  # its four pages stay cached, evictable
    assert blocks.num_free_pages == 6 and cache.num_cached_pages == 4
    assert list(cache.evictable) == [3, 2, 1, 0]  # the chain's end first
    hit = cache.lookup(16, page_keys(seq.prompt_ids, P))
    assert hit.snapshot_slot is None  # no snapshot: no hit
    # a new sequence needing 5 pages: the 2 free ones, then the chain from its end
    other = Sequence(1, "b", tokens(17, 1), GREEDY)
    assert blocks.can_admit(17)
    blocks.admit(other, 17)
    assert other.block_table == [4, 5, 3, 2, 1]
    assert cache.num_cached_pages == 1 and cache.stats.page_evictions == 3


def test_a_hits_pages_are_shared_and_counted_out_of_the_free_ones():
    cache = PrefixCache(P, [50])
    blocks = BlockManager(5, P, 3, cache)
    first = Sequence(0, "a", tokens(9, 0), GREEDY)
    blocks.admit(first, 9)
    keys = page_keys(first.prompt_ids, P)
    cache.enter_pages(keys, first.block_table[:2])
    cache.enter_snapshot(keys[1], cache.reserve_snapshot(), 2, None)
    second = Sequence(1, "b", first.prompt_ids, GREEDY)
    hit = cache.lookup(9, keys)
    assert hit.pages == first.block_table[:2]
    assert blocks.can_admit(9, hit)  # 3 pages: 2 shared + 1 of the 2 free
    blocks.admit(second, 9, hit)
    assert second.block_table[:2] == first.block_table[:2]
    blocks.free(first)
    assert cache.refs[second.block_table[0]] == 1  # still held by the second
    assert not cache.evictable
    blocks.free(second)
    assert len(cache.evictable) == 2 and blocks.num_free_pages == 5


def test_snapshots_in_the_middle_of_a_chain_are_evicted_before_its_end():
    cache = PrefixCache(P, [10, 11])
    keys = page_keys(tokens(12, 0), P)
    cache.enter_pages(keys, [0, 1, 2])
    assert cache.enter_snapshot(keys[0], cache.reserve_snapshot(), 1, None)
    assert cache.enter_snapshot(keys[2], cache.reserve_snapshot(), 3, keys[0])
    cache.lookup(13, keys)
    slot = cache.reserve_snapshot()  # full: the middle one (page 1's) goes, though used later
    assert slot == 10 and keys[0] not in cache.snapshots and keys[2] in cache.snapshots
    cache.cancel_snapshot(slot)
    # the end of a chain evicted with its page
    cache.release([0, 1, 2])
    assert cache.evict_page() == 2 and keys[2] not in cache.snapshots
    assert sorted(cache.free_snapshot_slots) == [10, 11]
    # a slot restored in the same step is kept
    assert cache.enter_snapshot(keys[1], cache.reserve_snapshot(), 2, None)
    assert cache.enter_snapshot(keys[0], cache.reserve_snapshot(), 1, None)
    assert cache.reserve_snapshot(keep={cache.snapshots[keys[0]].slot,
                                        cache.snapshots[keys[1]].slot}) is None


def test_a_branch_point_outlives_the_middle_of_a_single_chain():
    """A snapshot several chains go on from serves prompts of each: it is evicted as a leaf
    is (least recently used), after a snapshot that has one deeper one after it."""
    cache = PrefixCache(P, [10, 11, 12, 13, 14])
    shared = tokens(4, 1)
    a, b = page_keys(shared + tokens(8, 2), P), page_keys(shared + tokens(8, 3), P)
    cache.enter_pages(a, [0, 1, 2])
    cache.enter_pages(b[1:], [3, 4])
    for key, pages, parent in ((a[0], 1, None), (a[1], 2, a[0]), (a[2], 3, a[1]),
                               (b[2], 3, a[0])):
        assert cache.enter_snapshot(key, cache.reserve_snapshot(), pages, parent)
    assert cache.snapshots[a[0]].children == 2  # a branch point, least recently used
    cache.free_snapshot_slots.clear()
    cache.reserve_snapshot()  # a[1]: one deeper snapshot after it
    assert a[1] not in cache.snapshots and a[0] in cache.snapshots
    cache.reserve_snapshot()  # then the least recently used: the branch point
    assert a[0] not in cache.snapshots


def test_boundary_slots_are_lent_from_half_the_pool_and_come_back_as_snapshots():
    cache = PrefixCache(P, [10, 11, 12, 13])
    keys = page_keys(tokens(16, 1), P)
    cache.enter_pages(keys, [0, 1, 2, 3])
    first, second = cache.lend_boundary_slot(), cache.lend_boundary_slot()
    assert None not in (first, second) and cache.lend_boundary_slot() is None  # half the pool
    assert cache.return_boundary_slot(first, keys[3], 4, None)  # page 4's snapshot now
    assert cache.snapshots[keys[3]].slot == first and first not in cache.free_snapshot_slots
    assert not cache.return_boundary_slot(second, None, 0, None)  # no boundary reached
    assert second in cache.free_snapshot_slots and cache.boundary_slots == set()
    lent = cache.lend_boundary_slot()
    cache.reset()  # an engine restart: a lent slot is the pool's again, its return ignored
    assert sorted(cache.free_snapshot_slots) == [10, 11, 12, 13]
    assert not cache.return_boundary_slot(lent, keys[2], 3, None)
    assert sorted(cache.free_snapshot_slots) == [10, 11, 12, 13]


def test_chunks_end_at_page_boundaries_and_the_prompts_snapshot_is_taken_inside_one():
    """A 23-token prompt at 10 tokens a step, pages of 4: the budget's cuts end at page
    boundaries (snapshots at 8 and 16); the last chunk runs to the prompt's end and takes its
    snapshot at 20, inside it (no step of its own)."""
    blocks = BlockManager(64, P, 2, PrefixCache(P, [10, 11]))
    sched = Scheduler(blocks, max_num_seqs=2, max_model_len=200, lookahead=4,
                      max_num_batched_tokens=10)
    seq = Sequence(0, "r", tokens(23, 1), SamplingParams(max_tokens=4))
    sched.add(seq)
    chunks = []
    while not seq.prefilled:
        (n,) = sched.schedule().chunk_lens
        chunks.append((n, sched.snapshot_in(seq, n)))
        seq.num_cached += n
    assert chunks == [(8, 8), (8, 16), (7, 20)]


# ---- exactness through the engine -------------------------------------------------------------


@pytest.fixture(scope="module")
def engines(tiny_demo):
    """Engines over the demo pair, fp32, pages of 4 tokens, prompts fed 24 at a time: without
    and with the cache (63 snapshot slots: no snapshot is evicted here), and with it over a
    pool of pages small enough to evict."""
    return (make_engine(tiny_demo, enable_prefix_caching=False),
            make_engine(tiny_demo, prefix_cache_state_gb=STATE_GB),
            make_engine(tiny_demo, num_pages=90))


STATE_GB = 0.004  # 63 snapshots of the demo target (67,584 bytes each)


def make_engine(tiny_demo, draft: bool = True, **kw) -> LLMEngine:
    target, draft_dir = map(str, tiny_demo)
    return LLMEngine(EngineConfig(model=target, draft_model=draft_dir if draft else None,
                                  max_num_seqs=4, max_model_len=160, page_size=P,
                                  max_num_batched_tokens=24, **kw))


def same(cold: LLMEngine, warm: LLMEngine, batches: list[list[list[int]]],
         params: SamplingParams = GREEDY) -> list:
    """Each batch through both engines in turn (the warm one keeps its cache between them):
    the outputs and the draft's acceptance agree; returns the warm engine's outputs."""
    outs = []
    for batch in batches:
        want, got = cold.generate(batch, params), warm.generate(batch, params)
        for w, g in zip(want, got, strict=True):
            assert g.output_ids == w.output_ids
            assert g.acceptance_lengths == w.acceptance_lengths
        outs += got
    return outs


def test_repeated_and_extended_prompts_hit_and_match_the_cold_engine(engines):
    cold, warm, _ = engines
    prompt = tokens(45, 3)
    first = same(cold, warm, [[prompt]])[0]
    assert first.num_cached_tokens == 0
    again, longer = same(cold, warm, [[prompt], [prompt + first.output_ids + tokens(9, 4)]])
    assert again.num_cached_tokens == 44  # the snapshot before the last token's page
    # a follow-up turn: the previous prompt and answer and more; it hits the snapshot the
    # first answer left at its last full page (45 + 24 tokens: 68)
    assert longer.num_cached_tokens == 68


def test_a_shared_system_prompt_hits_concurrently_and_diverging_prompts_match(engines):
    cold, warm, _ = engines
    system = tokens(50, 5)
    asks = [system + tokens(n, 10 + n) for n in (3, 12, 30)]
    # divergence inside a page, at a page boundary, between two snapshots of a long prompt
    # (its chunks end at 24, 48, 72 and its snapshot point, 96)
    base = tokens(100, 6)
    diverge = [base[:k] + tokens(20, 20 + k) for k in (53, 72, 87)]
    outs = same(cold, warm, [asks, [base], diverge, asks])
    assert [o.num_cached_tokens for o in outs[:3]] == [0, 48, 48]
    assert [o.num_cached_tokens for o in outs[4:]] == [48, 72, 72, 52, 60, 76]


def test_a_multi_turn_chat_through_the_template_hits_its_earlier_turns(engines, tiny_demo):
    """Each turn's prompt: the conversation so far (the answers as the template renders
    them back) and a new question; it hits where the previous turn's prompt was snapshotted."""
    from transformers import AutoTokenizer

    cold, warm, _ = engines
    tok = AutoTokenizer.from_pretrained(tiny_demo[0])
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Weather in Paris?"}]
    last: list[int] = []
    for turn in range(3):
        prompt = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
        out = same(cold, warm, [[prompt]], SamplingParams(max_tokens=12))[0]
        # (the template renders an earlier answer differently once a later question follows)
        common = next((i for i, (a, b) in enumerate(zip(prompt, last, strict=False))
                       if a != b), min(len(prompt), len(last)))
        assert out.num_cached_tokens == 0 if turn == 0 else 0 < out.num_cached_tokens <= common
        last = prompt
        messages += [{"role": "assistant",
                      "content": tok.decode(out.output_ids, skip_special_tokens=True)},
                     {"role": "user", "content": f"And on day {turn + 1}?"}]


@pytest.mark.parametrize("kind", ["dflash", "per-seq", "autoregressive"])
def test_a_finished_request_leaves_a_snapshot_at_its_last_full_page(engines, tiny_demo, kind):
    """The boundary slot a decoding sequence holds: after a length, the next turn resumes at
    the answer's last full page; after a stop token, at most where the kept tokens end (the
    last round may have kept drafts past the stop). Through the batched commit, the
    per-sequence one (KernelConfig gdn_rounds) and plain decoding (no draft: the state is
    copied when a decode reaches a boundary)."""
    cold, warm = engines[:2]
    if kind == "per-seq":
        warm = make_engine(tiny_demo, prefix_cache_state_gb=STATE_GB,
                           kernel_overrides="gdn_rounds=per-seq")
    elif kind == "autoregressive":
        cold = make_engine(tiny_demo, draft=False, enable_prefix_caching=False)
        warm = make_engine(tiny_demo, draft=False, prefix_cache_state_gb=STATE_GB)
    prompt = tokens(37, 60)
    first = same(cold, warm, [[prompt]])[0]  # 37 + 24 tokens: its last full page ends at 60
    follow = same(cold, warm, [[prompt + first.output_ids + tokens(7, 61)]])[0]
    assert follow.num_cached_tokens == 60
    assert warm.prefix.boundary_slots == set()  # every lent slot came back
    stop = first.output_ids[12]  # (its first occurrence ends the answer there or before)
    params = SamplingParams(max_tokens=24, stop_token_ids=[stop])
    cut = same(cold, warm, [[tokens(37, 62)]], params)[0]  # (its own prompt)
    end = 37 + len(cut.output_ids)
    follow = same(cold, warm, [[tokens(37, 62) + cut.output_ids + tokens(7, 63)]])[0]
    assert 36 <= follow.num_cached_tokens <= end


def test_eviction_under_memory_pressure_keeps_outputs_exact(engines):
    cold, _, small = engines
    prompts = [tokens(60, 30 + i) for i in range(6)]
    same(cold, small, [prompts[:3], prompts[3:], prompts[:3]])
    assert small.prefix.stats.page_evictions > 0


def test_seeded_sampling_and_prompt_logprobs_with_the_cache(engines):
    cold, warm, _ = engines
    prompt = tokens(40, 40)
    seeded = SamplingParams(max_tokens=16, temperature=0.8, seed=7)
    same(cold, warm, [[prompt], [prompt]], seeded)
    # prompt log-probabilities are computed by prefilling every prompt token: no hit
    logprobs = SamplingParams(max_tokens=4, prompt_logprobs=0)
    out = warm.generate([prompt], logprobs)[0]
    assert out.num_cached_tokens == 0 and len(out.prompt_logprobs) == len(prompt)
    assert out.prompt_logprobs == cold.generate([prompt], logprobs)[0].prompt_logprobs


def test_a_step_that_fails_enters_nothing(engines):
    _, warm, _ = engines
    prompt = tokens(90, 50)
    rid = warm.add_request(prompt, GREEDY)
    warm.step()  # its first chunk (24 tokens): its pages and a snapshot enter the cache
    result = warm.executor.result

    def lost():
        result()
        raise RuntimeError("the step was lost")

    warm.executor.result = lost
    warm.begin_step()  # the second chunk, whose step fails
    with pytest.raises(RuntimeError, match="lost"):
        warm.finish_step()
    warm.executor.result = result
    warm.abort(rid)
    keys, cache = page_keys(prompt, P), warm.prefix
    assert cache.lookup(len(prompt), keys).num_tokens == 24
    assert keys[6] not in cache.page_of and keys[11] not in cache.snapshots  # the lost chunk's
    assert len(cache.snapshots) + len(cache.free_snapshot_slots) == cache.num_snapshot_slots
    assert not warm.has_unfinished()


@pytest.mark.gpu
def test_on_the_gpu_with_cuda_graphs_the_cache_changes_no_output(tiny_demo):
    """The snapshot copies on the device, the Triton prefill and the captured rounds (their
    commits' taps included)."""
    target, draft = map(str, tiny_demo)

    def make(**kw):
        return LLMEngine(EngineConfig(model=target, draft_model=draft, device="cuda",
                                      max_num_seqs=4, max_model_len=160, page_size=P,
                                      max_num_batched_tokens=24, num_pages=400, **kw))

    cold, warm = make(enable_prefix_caching=False), make()
    system = tokens(50, 5)
    asks = [system + tokens(n, 10 + n) for n in (3, 12, 30)]
    outs = same(cold, warm, [asks, asks])
    assert all(o.num_cached_tokens >= 48 for o in outs[1:])
    # the captured commit's taps: a next turn resumes at the answer's last full page
    follow = same(cold, warm, [[asks[0] + outs[3].output_ids + tokens(7, 61)]])[0]
    assert follow.num_cached_tokens == (len(asks[0]) + len(outs[3].output_ids)) // P * P
