"""LocalEngineClient: one engine thread behind asyncio streams. Same tokens as the engine run
directly, aborts free pages and slots, a failing step fails its requests but not the loop,
admission limit, clean shutdown."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import torch

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from deploy.engine_client import (
    EngineDeadError,
    EngineOverloaded,
    EngineStepError,
    LocalEngineClient,
    RequestTiming,
)

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"


def make_engine(draft: bool = True) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(DEMO / "target"),
                                  draft_model=str(DEMO / "draft") if draft else None,
                                  block_size=8 if draft else None, max_num_seqs=8,
                                  page_size=8))


def prompts(n: int, seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 320, (int(k),), generator=g).tolist()
            for k in torch.randint(3, 30, (n,), generator=g)]


@pytest.fixture
def client():
    c = LocalEngineClient(make_engine(), "tiny")
    yield c
    c.close()


async def collect(client, request_id, prompt, params, timing=None):
    streamed, last = [], None
    async for out in client.generate(request_id, prompt, params, timing):
        streamed += out.new_token_ids
        last = out
    assert streamed == last.output_ids
    return last


def assert_idle(engine: LLMEngine) -> None:
    assert engine.blocks.num_free_pages == engine.blocks.num_pages
    assert len(engine.blocks.free_slots) == engine.blocks.num_slots
    assert not engine.has_unfinished()


def test_concurrent_requests_equal_target_only_generate(client):
    ps = prompts(6, 0)
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True)
              for m in (5, 40, 17, 1, 28, 33)]
    want = [o.output_ids for o in make_engine(draft=False).generate(ps, params)]
    timings = [RequestTiming() for _ in ps]

    async def run():
        return await asyncio.gather(*(collect(client, f"r{i}", p, sp, t) for i, (p, sp, t)
                                      in enumerate(zip(ps, params, timings, strict=True))))

    outs = asyncio.run(run())
    assert [o.output_ids for o in outs] == want
    assert [o.finish_reason for o in outs] == ["length"] * len(ps)
    for t, o in zip(timings, outs, strict=True):
        assert t.arrival <= t.first_token <= t.last_token <= t.finished
        # prefill delivers one token, then one batch per round
        assert 1 + sum(k for _, k in t.token_batches) == len(o.output_ids)
        assert len(t.token_batches) == len(o.acceptance_lengths)
    assert_idle(client.engine)
    snap = client.snapshot()
    assert snap.running == snap.waiting == 0 and snap.cache_usage == 0.0
    assert snap.acceptance.rounds > 0
    # One propose and one verify per batched round; AcceptanceStats counts per sequence.
    assert 0 < snap.draft_time_per_round.count == snap.verify_time_per_round.count
    assert snap.draft_time_per_round.count <= snap.acceptance.rounds


def test_abort_and_closing_the_stream_free_pages_and_slot(client):
    params = SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True)
    p = prompts(2, 1)

    async def run():
        gen = client.generate("a", p[0], params)
        await anext(gen)
        await anext(gen)
        assert client.snapshot().running == 1
        await client.abort("a")  # returns once the engine dropped it
        assert_idle(client.engine)
        rest = [out async for out in gen]
        assert rest[-1].finished and rest[-1].finish_reason == "abort"
        assert len(rest[-1].output_ids) < 400

        gen = client.generate("b", p[1], params)  # the consumer walks away instead
        await anext(gen)
        await gen.aclose()
        # The abort travels through the engine thread's inbox; the snapshot may still be the
        # one published before "b" started, so wait for the pages themselves to come back.
        blocks = client.engine.blocks
        for _ in range(1000):
            if blocks.num_free_pages == blocks.num_pages and client.snapshot().running == 0:
                break
            await asyncio.sleep(0.01)

    asyncio.run(run())
    snap = client.snapshot()
    assert snap.running == 0 and snap.cache_usage == 0.0
    assert_idle(client.engine)


def test_bad_requests_raise_value_error_before_yielding(client):
    async def run():
        with pytest.raises(ValueError, match="context length"):
            await anext(client.generate("long", [1] * 2000, SamplingParams()))
        with pytest.raises(ValueError, match="token ids"):
            await anext(client.generate("vocab", [10_000], SamplingParams()))
        gen = client.generate("dup", [1, 2, 3], SamplingParams(max_tokens=300, ignore_eos=True))
        await anext(gen)
        with pytest.raises(ValueError, match="already in use"):
            await anext(client.generate("dup", [4, 5], SamplingParams()))
        await gen.aclose()

    asyncio.run(run())


def test_step_exception_fails_in_flight_requests_and_the_loop_survives(client, monkeypatch):
    runner, calls = client.engine.executor.runner, {"verify": 0}
    real_verify = runner.verify

    def flaky_verify(*args, **kwargs):
        calls["verify"] += 1
        if calls["verify"] == 2:
            raise RuntimeError("injected fault")
        return real_verify(*args, **kwargs)

    monkeypatch.setattr(runner, "verify", flaky_verify)
    ps = prompts(4, 2)
    params = SamplingParams(max_tokens=60, temperature=0.0, ignore_eos=True)

    async def run():
        results = await asyncio.wait_for(asyncio.gather(
            *(collect(client, f"f{i}", p, params) for i, p in enumerate(ps[:3])),
            return_exceptions=True), timeout=30)
        for r in results:
            assert isinstance(r, EngineStepError) and "injected fault" in str(r)
        assert_idle(client.engine)
        await client.check_health()
        return await collect(client, "after", ps[3], params)

    out = asyncio.run(run())
    want = make_engine(draft=False).generate([ps[3]], params)[0].output_ids
    assert out.output_ids == want


def test_overload_raises_engine_overloaded(monkeypatch):
    client = LocalEngineClient(make_engine(), "tiny", max_waiting=2)
    gate, real_prefill = threading.Event(), client.engine.executor.runner.prefill

    def gated_prefill(*args, **kwargs):
        gate.wait(timeout=30)
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(client.engine.executor.runner, "prefill", gated_prefill)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    p = prompts(4, 3)

    async def run():
        tasks = [asyncio.create_task(collect(client, f"w{i}", p[i], params)) for i in range(2)]
        await asyncio.sleep(0.05)  # both submitted; neither has produced a token
        with pytest.raises(EngineOverloaded):
            await anext(client.generate("third", p[2], params))
        gate.set()
        await asyncio.gather(*tasks)
        await collect(client, "fourth", p[3], params)  # admitted again

    try:
        asyncio.run(run())
    finally:
        gate.set()
        client.close()
    with pytest.raises(ValueError, match="max_waiting"):
        LocalEngineClient(client.engine, "tiny", max_waiting=0)


def test_idle_loop_sleeps_and_shutdown_joins(client):
    clock = time.pthread_getcpuclockid(client._thread.ident)  # the engine thread's CPU time
    time.sleep(0.1)
    cpu = time.clock_gettime(clock)
    time.sleep(0.5)
    assert time.clock_gettime(clock) - cpu < 0.01  # idle, it blocks on its queue

    async def run():
        gen = client.generate("s", prompts(1, 4)[0],
                              SamplingParams(max_tokens=900, temperature=0.0, ignore_eos=True))
        await anext(gen)
        await client.shutdown()
        assert not client._thread.is_alive()
        with pytest.raises(EngineDeadError):
            async for _ in gen:
                pass
        with pytest.raises(EngineDeadError):
            await client.check_health()
        with pytest.raises(EngineDeadError):
            await anext(client.generate("late", [1, 2], SamplingParams()))
        await client.shutdown()  # idempotent

    asyncio.run(run())


def test_a_request_failing_alone_raises_for_it_and_the_others_stream_on(client, monkeypatch):
    """A step that failed in one request's sampling (planted: temperature 0.77) raises
    EngineStepError naming it for that request only (HTTP 500 for it); the others' streams
    finish with their usual tokens, and the engine is not restarted."""
    from workers import sampling

    real = sampling.probs_from_logits

    def probs_from_logits(logits, params):
        if params.temperature == 0.77:
            raise RuntimeError("planted sampling failure")
        return real(logits, params)

    monkeypatch.setattr(sampling, "probs_from_logits", probs_from_logits)
    ps = prompts(3, 4)
    greedy = SamplingParams(max_tokens=20, ignore_eos=True)
    want = [o.output_ids for o in make_engine(draft=False).generate(ps[:2], greedy)]
    engine = client.engine

    async def run():
        async def poisoned():
            with pytest.raises(EngineStepError, match="'bad' failed.*planted sampling failure"
                                                      ".*not affected"):
                await collect(client, "bad", ps[2], SamplingParams(max_tokens=20,
                                                                   temperature=0.77))
        outs = await asyncio.gather(collect(client, "a", ps[0], greedy), poisoned(),
                                    collect(client, "b", ps[1], greedy))
        return [outs[0], outs[2]]

    outs = asyncio.run(run())
    assert [o.output_ids for o in outs] == want
    assert client.engine is engine and client.snapshot().running == 0
    assert_idle(engine)


@pytest.mark.parametrize("poison", [False, True])
def test_a_restart_runs_requests_that_streamed_nothing_again_once(poison):
    """With a restarting engine (as under Ray): a failed step fails the requests that have
    streamed tokens, and runs the ones that have not again on the restarted engine, as if they
    had arrived during the restart; a request that fails the restarted engine too fails."""
    faults = {"prefill": 0}

    def faulty(engine: LLMEngine) -> LLMEngine:
        runner = engine.executor.runner
        real_prefill = runner.prefill

        def prefill(seqs):
            if any(len(s.token_ids) == 7 for s in seqs) and (poison or faults["prefill"] == 0):
                faults["prefill"] += 1  # the 7-token prompt's prefill fails
                raise RuntimeError("injected fault")
            return real_prefill(seqs)

        runner.prefill = prefill
        return engine

    restarts = []

    def recover(error: Exception) -> LLMEngine:
        restarts.append(str(error))
        return faulty(make_engine())

    client = LocalEngineClient(faulty(make_engine()), "tiny", recover=recover)
    streaming = prompts(1, 9)[0]
    late = [11, 12, 13, 14, 15, 16, 17]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    try:
        async def run():
            gen = client.generate("streaming", streaming, params)
            await anext(gen)  # it has streamed a token when the fault comes
            late_task = asyncio.ensure_future(collect(client, "late", late, params))
            with pytest.raises(EngineStepError, match="injected fault"):
                async for _ in gen:
                    pass
            return await asyncio.gather(late_task, return_exceptions=True)

        (late_out,) = asyncio.run(asyncio.wait_for(run(), timeout=60))
    finally:
        client.close()
    if poison:  # it failed the restarted engine too: it fails, and is not run a third time
        assert isinstance(late_out, EngineStepError) and len(restarts) == 2
    else:
        want = make_engine(draft=False).generate([late], params)[0].output_ids
        assert late_out.output_ids == want and len(restarts) == 1


def test_drain_lets_requests_finish_then_refuses_new_ones(client):
    """A drain with time to spare: the request in flight ends with its whole output; new
    requests and the health check get EngineDraining (HTTP 503) from then on."""
    from cluster.engine_types import EngineDraining

    async def run():
        params = SamplingParams(max_tokens=300, ignore_eos=True)
        gen = client.generate("a", prompts(1, 5)[0], params)
        await anext(gen)
        counts = await client.drain(grace_s=120)
        rest = [out async for out in gen]
        assert rest[-1].finished and rest[-1].finish_reason == "length"
        assert len(rest[-1].output_ids) == 300
        with pytest.raises(EngineDraining, match="shutting down"):
            await anext(client.generate("b", [1, 2, 3], SamplingParams()))
        with pytest.raises(EngineDraining):
            await client.check_health()
        await client.check_alive()  # Serve must not replace a draining replica
        return counts

    counts = asyncio.run(run())  # "a" may have finished before the drain counted it
    assert counts["stopped"] == 0 and counts["finished"] == counts["in_flight"] <= 1
    assert_idle(client.engine)


def test_drain_past_its_grace_stops_what_still_runs_and_frees_it(client):
    from cluster.engine_types import EngineDraining

    async def run():
        params = SamplingParams(max_tokens=900, ignore_eos=True)
        gens = [client.generate(f"r{i}", p, params) for i, p in enumerate(prompts(2, 6))]
        firsts = [await anext(g) for g in gens]
        counts = await client.drain(grace_s=0)
        for gen, first in zip(gens, firsts, strict=True):
            got = list(first.new_token_ids)
            with pytest.raises(EngineDraining, match="stopped before it finished"):
                async for out in gen:
                    got += out.new_token_ids
            assert 0 < len(got) < 900
        return counts

    assert asyncio.run(run()) == {"in_flight": 2, "finished": 0, "stopped": 2}
    assert_idle(client.engine)


def test_a_request_the_engine_cannot_take_fails_alone(client):
    """What the HTTP layer never sends, sent anyway (a tensor as a prompt, a params dict):
    that request ends with an error; the loop, and the request beside it, go on."""
    params = SamplingParams(max_tokens=6, temperature=0.0)
    p = prompts(2, 12)

    async def run():
        other = asyncio.create_task(collect(client, "fine", p[0], params))
        with pytest.raises(ValueError, match="integers"):
            await anext(client.generate("tensor", [torch.tensor([1, 2, 3])], params))
        with pytest.raises(ValueError, match="SamplingParams"):
            await anext(client.generate("dict", p[1], {"max_tokens": 3}))
        return await other

    out = asyncio.run(run())
    assert out.output_ids == make_engine(draft=False).generate([p[0]], params)[0].output_ids
    asyncio.run(client.check_health())
    assert_idle(client.engine)


def test_an_abort_that_comes_before_its_add_ends_the_request_at_once(client):
    """The driver actor may run a request's abort before its add (Ray does not order an
    async actor's calls): the add then ends the request without running it."""
    params = SamplingParams(max_tokens=200, ignore_eos=True)

    async def run():
        await client.abort("early")  # nothing of that id yet
        return [out async for out in client.generate("early", prompts(1, 13)[0], params)]

    (out,) = asyncio.run(run())
    assert out.finished and out.finish_reason == "abort" and out.output_ids == []
    assert_idle(client.engine)


def test_a_requests_choices_are_admitted_together_or_refused_at_once(monkeypatch):
    """generate_many: all of a request's choices fit the queue, or none is queued
    (EngineOverloaded before anything waits); a group larger than max_waiting is admitted
    when nothing else waits."""
    from deploy.engine_client import EngineRequest

    client = LocalEngineClient(make_engine(), "tiny", max_waiting=3)
    gate, real_prefill = threading.Event(), client.engine.executor.runner.prefill

    def gated_prefill(*args, **kwargs):
        gate.wait(timeout=30)
        return real_prefill(*args, **kwargs)

    monkeypatch.setattr(client.engine.executor.runner, "prefill", gated_prefill)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    p = prompts(1, 14)[0]

    def group(name: str, n: int) -> list[EngineRequest]:
        return [EngineRequest(f"{name}-{j}", p, params) for j in range(n)]

    async def drain(streams) -> list[str]:
        out = []
        for s in streams:
            out += [o.finish_reason async for o in s if o.finished]
            await s.aclose()
        return out

    async def run():
        big = await client.generate_many(group("big", 5))  # 5 > 3, but nothing waits
        with pytest.raises(EngineOverloaded, match="brings 2 choices"):
            await client.generate_many(group("pair", 2))
        gate.set()
        return await drain(big), await drain(await client.generate_many(group("after", 2)))

    try:
        big, after = asyncio.run(run())
    finally:
        gate.set()
        client.close()
    assert big == ["length"] * 5 and after == ["length"] * 2
