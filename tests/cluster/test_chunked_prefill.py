"""Chunked prefill is lossless: a prompt fed in chunks of `max_num_batched_tokens` leaves the
same caches and aux features as one whole forward, and greedy output is token for token the
unchunked one, without and with the draft, also when a long prompt joins running streams."""

from __future__ import annotations

import pytest
import torch

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from workers.model_runner import SeqInput

BUDGET = 7
LENGTHS = [23, 7, 40, 14, 31, 5]  # exact multiples of the budget and a prompt below it


def prompts_of(lengths: list[int], seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 316, (n,), generator=g).tolist() for n in lengths]


def engine(target, draft=None, block_size=None, **kw) -> LLMEngine:
    kw.setdefault("max_num_seqs", 8)
    kw.setdefault("page_size", 4)
    return LLMEngine(EngineConfig(model=str(target), draft_model=draft and str(draft),
                                  block_size=block_size, **kw))


def record_forwards(eng: LLMEngine) -> list[tuple[str, list[SeqInput]]]:
    calls = []
    prefill, verify = eng.executor.runner.prefill, eng.executor.runner.verify

    def recording_prefill(seqs):
        calls.append(("prefill", seqs))
        return prefill(seqs)

    def recording_verify(seqs):
        calls.append(("verify", seqs))
        return verify(seqs)

    eng.executor.runner.prefill, eng.executor.runner.verify = recording_prefill, recording_verify
    return calls


def check_shapes(calls, prompt_len: dict[int, int], block_size: int) -> None:
    """Prefill steps stay within the budget; a round verifies exactly B tokens for each
    sequence and never one whose prompt is still being prefilled."""
    cached = dict.fromkeys(prompt_len, 0)
    for kind, seqs in calls:
        if kind == "prefill":
            assert sum(len(s.token_ids) for s in seqs) <= BUDGET
            for s in seqs:
                assert s.start_pos == cached[s.seq_id]
                cached[s.seq_id] += len(s.token_ids)
                assert s.sample == (cached[s.seq_id] == prompt_len[s.seq_id])
        else:
            assert all(len(s.token_ids) == block_size for s in seqs)
            assert all(cached[s.seq_id] == prompt_len[s.seq_id] for s in seqs)
    assert cached == prompt_len


@pytest.fixture(scope="module")
def reference(tiny_demo):
    target, _ = tiny_demo
    prompts = prompts_of(LENGTHS, 0)
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in (12, 9, 14, 6, 10, 13)]
    outs = engine(target).generate(prompts, params)
    return prompts, params, [o.output_ids for o in outs]


def test_chunks_leave_the_caches_and_aux_of_a_whole_prefill(tiny_demo):
    eng = engine(*tiny_demo, 4)
    runner, prompt = eng.executor.runner, prompts_of([30], 1)[0]
    greedy = SamplingParams()
    whole = runner.prefill([SeqInput(0, prompt, 0, list(range(8)), 0, greedy)])
    table, aux, tokens = list(range(8, 16)), [], []
    for lo in range(0, 30, BUDGET):
        chunk = prompt[lo : lo + BUDGET]
        out = runner.prefill([SeqInput(1, chunk, lo, table, 1, greedy,
                                       sample=lo + len(chunk) == 30)])
        assert out.num_committed == [len(chunk)]
        assert out.aux_positions.tolist() == list(range(lo, lo + len(chunk)))
        aux.append(out.aux)
        tokens += out.new_tokens
    assert tokens == [[]] * 4 + whole.new_tokens
    torch.testing.assert_close(torch.cat(aux), whole.aux, rtol=1e-5, atol=1e-5)
    caches = runner.caches
    for layer in caches.conv:
        torch.testing.assert_close(caches.conv[layer][1], caches.conv[layer][0])
        torch.testing.assert_close(caches.ssm[layer][1], caches.ssm[layer][0],
                                   rtol=1e-5, atol=1e-5)
    for k_cache, v_cache in caches.kv.values():
        for cache in (k_cache, v_cache):
            torch.testing.assert_close(cache[8:16].flatten(0, 1)[:30],
                                       cache[0:8].flatten(0, 1)[:30], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("block_size", [None, 4])
def test_chunked_greedy_equals_unchunked(tiny_demo, reference, block_size):
    prompts, params, want = reference
    target, draft = tiny_demo
    eng = engine(target, draft if block_size else None, block_size,
                 max_num_batched_tokens=BUDGET)
    calls = record_forwards(eng)
    assert [o.output_ids for o in eng.generate(prompts, params)] == want
    check_shapes(calls, {i: len(p) for i, p in enumerate(prompts)}, block_size or 1)


def test_long_prompt_joining_running_streams(tiny_demo, reference):
    prompts, params, want = reference
    eng = engine(*tiny_demo, 8, max_num_batched_tokens=BUDGET)
    calls = record_forwards(eng)
    order = [1, 5, 2, 0, 4, 3]  # the short ones first; then 40, 23, 31, 14 tokens join
    ids = {eng.add_request(prompts[i], params[i]): i for i in order[:2]}
    pending = order[2:]
    done, waited = {}, {}  # waited: consecutive steps a decoding stream got no token
    while eng.has_unfinished():
        decoding = {s.request_id for s in eng.scheduler.running if s.prefilled}
        outs = eng.step()
        got = {o.request_id for o in outs if o.new_token_ids}
        for out in outs:
            if out.finished:
                done[ids[out.request_id]] = out.output_ids
        for rid in decoding:  # a running stream waits at most one prefill step for its round
            waited[rid] = 0 if rid in got else waited.get(rid, 0) + 1
            assert waited[rid] <= 1
        if pending and len(calls) % 3 == 0:  # requests join while others decode
            i = pending.pop(0)
            ids[eng.add_request(prompts[i], params[i])] = i
    assert pending == []
    # Rounds really ran between the chunks of a joining prompt.
    kinds = "".join("p" if k == "prefill" and any(not s.sample for s in seqs) else k[0]
                    for k, seqs in calls)
    assert "pv" in kinds
    assert [done[i] for i in range(len(prompts))] == want
    check_shapes(calls, {eng_id: len(prompts[i]) for eng_id, i in enumerate(order)}, 8)


def test_abort_mid_prefill_returns_pages_and_slot(tiny_demo, reference):
    prompts, params, want = reference
    eng = engine(*tiny_demo, 4, max_num_batched_tokens=BUDGET)
    free_blocks, free_slots = eng.blocks.num_free_pages, len(eng.blocks.free_slots)
    long = eng.add_request(prompts[2], params[2])  # 40 tokens: 6 chunks
    short = eng.add_request(prompts[1], params[1])
    assert eng.step() == []  # a first chunk: nothing to report
    seq = eng._by_request[long]
    assert 0 < seq.num_cached < len(prompts[2])
    eng.abort(long)
    outs = {}
    while eng.has_unfinished():
        outs |= {o.request_id: o for o in eng.step() if o.finished}
    assert list(outs) == [short] and outs[short].output_ids == want[1]
    assert eng.blocks.num_free_pages == free_blocks
    assert len(eng.blocks.free_slots) == free_slots
