"""The whole system through HTTP: Ray Serve → DFlashServer replica → driver actor → TP 2 target
workers (gloo) + colocated draft actor, on the demo pair, driven by the real `openai` client.
Greedy outputs equal target-only greedy decoding token for token; cancelled streams free their
pages; bad input gets 4xx and the server keeps serving; a killed worker fails its request
clearly and the engine recovers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import threading
import time
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import ray
from live_server import scrape_metrics, wait_until_idle
from ray import serve

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from deploy.app import ServeArgs, build_deployment
from deploy.ray_client import DRIVER_NAME_PREFIX
from deploy.tokenizer import load_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"
MODEL = "tiny-dflash"
GREEDY = {"temperature": 0.0}
pytestmark = pytest.mark.ray


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def app(ray_cluster):
    target, draft = str(DEMO / "target"), str(DEMO / "draft")
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = ServeArgs(model=target, draft_model=draft, tp=2, device="cpu",
                     speculative_dflash_block_size=8, served_model_name=MODEL, max_num_seqs=16,
                     page_size=8, max_waiting=16)
    serve.run(build_deployment(args), name="dflash", route_prefix="/")
    url = f"http://127.0.0.1:{port}"
    reference = LLMEngine(EngineConfig(model=target, max_num_seqs=16))  # target only, in process
    yield {"url": url, "tokenizer": load_tokenizer(target), "reference": reference}
    serve.shutdown()


@pytest.fixture(scope="module")
def oai(app) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{app['url']}/v1", api_key="x", max_retries=0, timeout=120)


def async_client(app) -> openai.AsyncOpenAI:
    # One per asyncio.run: its connection pool belongs to that event loop.
    return openai.AsyncOpenAI(base_url=f"{app['url']}/v1", api_key="x", max_retries=0,
                              timeout=120)


def target_only(app, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    return [o.output_ids for o in app["reference"].generate(prompts, params)]


def metrics(app) -> dict[tuple[str, tuple], float]:
    return scrape_metrics(app["url"])


def wait_idle(app, timeout: float = 60.0) -> dict:
    return wait_until_idle(app["url"], timeout, poll=0.1)


def wait_healthy(app, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while httpx.get(f"{app['url']}/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline, "the engine did not recover"
        time.sleep(0.2)


def driver_handle():
    names = [a for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(DRIVER_NAME_PREFIX)]
    assert len(names) == 1, names
    return ray.get_actor(names[0]["name"], namespace=names[0]["namespace"])


def test_the_engine_warmed_up_before_the_replica_was_healthy(app):
    # serve.run returned once the replica was healthy; its constructor waited for the driver's
    # start, which ends with the warm-up: a prompt in two prefill chunks, then rounds.
    report = ray.get(driver_handle().warmup.remote())
    assert report["requests"] >= 1 and report["steps"] >= 3 and report["seconds"] > 0


def test_completion_and_chat_equal_target_only(app, oai):
    prompt = "The quick brown fox"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=40, **GREEDY,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    (want,) = target_only(app, [r.model_extra["prompt_token_ids"]], [40])
    assert r.model_extra["prompt_token_ids"] == app["tokenizer"].encode(prompt)
    assert r.choices[0].model_extra["token_ids"] == want
    assert r.choices[0].text == app["tokenizer"].decode(want, skip_special_tokens=True)
    assert r.usage.completion_tokens == 40

    messages = [{"role": "user", "content": "Tell me a story."}]
    c = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, **GREEDY,
                                    extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt_ids = app["tokenizer"].apply_chat_template(messages, add_generation_prompt=True,
                                                      tokenize=True, return_dict=False)
    assert c.model_extra["prompt_token_ids"] == list(prompt_ids)
    (want,) = target_only(app, [list(prompt_ids)], [30])
    assert c.choices[0].model_extra["token_ids"] == want

    pieces, ids, usage = [], [], None
    for chunk in oai.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=30, stream=True, **GREEDY,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True, "return_token_ids": True}):
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            pieces.append(choice.delta.content or "")
            ids += choice.model_extra.get("token_ids") or []
    assert ids == want and "".join(pieces) == c.choices[0].message.content
    assert usage.completion_tokens == 30 and usage.prompt_tokens == len(prompt_ids)
    m = wait_idle(app)
    assert m[("dflash_spec_decode_num_drafts_total", ())] > 0
    assert m[("dflash_draft_time_per_round_seconds_count", ())] > 0
    assert m[("dflash_verify_time_per_round_seconds_count", ())] > 0


def test_logprobs_echo_and_choices_through_the_cluster(app, oai):
    """Across the driver and two TP ranks: a batch of two token-id prompts, n=2, echo and
    logprobs; every log-probability is the target-only engine's."""
    tok = app["tokenizer"]
    prompts = [tok.encode("The quick brown fox"), tok.encode("Once upon")]
    r = oai.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=6, echo=True,
                               logprobs=2, **GREEDY, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    params = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=2, prompt_logprobs=2)
    for i, want in enumerate(app["reference"].generate(prompts, params)):
        lps = [None] + [x.logprob for x in want.prompt_logprobs[1:] + want.new_logprobs]
        for choice in r.choices[2 * i : 2 * i + 2]:
            got = choice.logprobs.token_logprobs
            assert got[0] is None and got[1:] == pytest.approx(lps[1:], abs=2e-5)
    wait_idle(app)


def test_sixteen_concurrent_streams_are_exact(app):
    prompts = [f"Request {i}: " + "abc " * (i % 5) for i in range(16)]
    lengths = [8 + 3 * i for i in range(16)]

    async def one(aoai, prompt: str, n: int) -> tuple[list[int], list[int], str]:
        ids, prompt_ids, text = [], None, []
        stream = await aoai.completions.create(
            model=MODEL, prompt=prompt, max_tokens=n, stream=True, **GREEDY,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        async for chunk in stream:
            prompt_ids = chunk.model_extra.get("prompt_token_ids") or prompt_ids
            for choice in chunk.choices:
                ids += choice.model_extra.get("token_ids") or []
                text.append(choice.text)
        return prompt_ids, ids, "".join(text)

    async def run():
        async with async_client(app) as aoai:
            return await asyncio.gather(*(one(aoai, p, n)
                                          for p, n in zip(prompts, lengths, strict=True)))

    results = asyncio.run(run())
    want = target_only(app, [r[0] for r in results], lengths)
    assert [r[1] for r in results] == want
    tok = app["tokenizer"]
    assert [r[2] for r in results] == [tok.decode(w, skip_special_tokens=True) for w in want]
    wait_idle(app)


ABORTED = ("dflash_requests_total", (("endpoint", "completions"), ("finish_reason", "abort")))


def test_cancelled_stream_frees_its_pages(app):
    """A client that leaves a stream after three chunks: the engine aborts its request and
    frees its pages and slot. The tiny pair can finish 900 tokens before the client looks (a
    loaded 2-core box): such a try has nothing to cancel, and the next one runs."""
    body = {"model": MODEL, "prompt": "cancel me", "max_tokens": 900, "stream": True,
            "ignore_eos": True}
    for _ in range(5):
        wait_idle(app)
        aborted = metrics(app).get(ABORTED, 0)
        with httpx.stream("POST", f"{app['url']}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: ")
                if seen >= 3:
                    break
            m = metrics(app)
            if m[("dflash_num_requests_running", ())] == 0:
                continue  # it finished already
            assert m[("dflash_num_requests_running", ())] == 1
            assert m[("dflash_kv_cache_usage_ratio", ())] > 0
        m = wait_idle(app)  # the disconnect aborted the request and freed its pages and slot
        assert m[ABORTED] == aborted + 1
        return
    pytest.fail("every try finished before the client could cancel it")


BAD = [
    (b"{not json", 400, "invalid_json"),
    ({"model": "other-model", "prompt": "x"}, 404, "model_not_found"),
    ({"model": MODEL, "prompt": "x", "temperature": -1}, 400, None),
    ({"model": MODEL, "prompt": "x", "top_p": 0}, 400, None),
    ({"model": MODEL, "prompt": "x", "max_tokens": 0}, 400, None),
    ({"model": MODEL, "prompt": "x " * 2000}, 400, None),  # longer than the context
]


@pytest.mark.parametrize(("body", "status", "code"), BAD)
def test_bad_input_is_4xx_and_the_server_keeps_serving(app, oai, body, status, code):
    kw = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = httpx.post(f"{app['url']}/v1/completions", timeout=30,
                   headers={"content-type": "application/json"}, **kw)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if code is not None:
        assert err["code"] == code
    assert oai.completions.create(model=MODEL, prompt="ok", max_tokens=3).usage.total_tokens


def test_a_requests_choices_are_admitted_together_or_refused_at_once(app):
    """Three requests of n = 20 at once against a queue of 16: each is served whole or
    refused (429) before any choice of it waited, so every refusal comes back while the
    served requests still run."""
    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, float]:
        r = await client.post(f"{app['url']}/v1/completions", json={
            "model": MODEL, "prompt": f"many {i}", "n": 20, "max_tokens": 40,
            "ignore_eos": True})
        if r.status_code == 200:
            assert len(r.json()["choices"]) == 20
        else:
            assert r.json()["error"]["code"] == "engine_overloaded", r.text
        return r.status_code, time.monotonic()

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*(one(client, i) for i in range(3)))

    results = asyncio.run(run())
    assert {status for status, _ in results} <= {200, 429}
    served = [at for status, at in results if status == 200]
    refused = [at for status, at in results if status == 429]
    assert served and refused
    assert max(refused) < min(served)
    wait_idle(app)


ENDED_BY_LENGTH = ("dflash_engine_requests_finished_total", (("finish_reason", "length"),))


def test_clients_that_leave_at_any_moment_leave_nothing_running(app):
    """40 requests at once (streamed or not, n 1 or 4), each abandoned by its client at a
    random moment in its first 1.5 s (queued, prefilling, decoding): the engine aborts every
    one of them, none runs on to its 1,000 tokens, and the engine returns to idle."""
    import random

    rng = random.Random(3)
    wait_idle(app)
    by_length = metrics(app).get(ENDED_BY_LENGTH, 0)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        body = {"model": MODEL, "prompt": f"leaving {i}", "max_tokens": 1000,
                "ignore_eos": True, "stream": rng.random() < 0.5, "n": rng.choice([1, 1, 4])}
        task = asyncio.create_task(client.post(f"{app['url']}/v1/completions", json=body))
        await asyncio.sleep(rng.uniform(0.0, 1.5))
        task.cancel()
        with contextlib.suppress(BaseException):
            await task

    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=100)) \
                as client:
            await asyncio.gather(*(one(client, i) for i in range(40)))

    asyncio.run(run())
    m = wait_idle(app)
    assert m.get(ENDED_BY_LENGTH, 0) == by_length  # every one was aborted, none ran out


def test_too_many_requests_is_429(app):
    # 16 run, 16 may wait (max_waiting); beyond that the engine refuses with 429.
    async def one(aoai, i: int):
        try:
            stream = await aoai.completions.create(
                model=MODEL, prompt=f"load {i}", max_tokens=400, stream=True,
                extra_body={"ignore_eos": True})
            async for _ in stream:
                break  # admitted: the first chunk came; closing the stream aborts it
            await stream.close()
            return "ok"
        except openai.RateLimitError as e:
            assert e.body["code"] == "engine_overloaded"
            return 429

    async def run():
        async with async_client(app) as aoai:
            return await asyncio.gather(*(one(aoai, i) for i in range(48)))

    results = asyncio.run(run())
    assert results.count(429) > 0 and results.count("ok") >= 16
    wait_idle(app)


@pytest.mark.parametrize(("role", "index"), [("workers", 1), ("draft", 0)])
def test_killed_actor_fails_its_request_and_the_engine_recovers(app, oai, role, index):
    """A TP worker or the draft killed mid-stream: the stream ends with a clear error, the
    engine restarts all its actors, and the next request is exact."""
    driver = driver_handle()
    restarts = ray.get(driver.restarts.remote())
    stream = oai.completions.create(model=MODEL, prompt="doomed", max_tokens=900, stream=True,
                                    extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    ray.kill(ray.get(driver.actors.remote())[role][index])
    with pytest.raises(openai.APIError) as e:
        for _ in it:
            pass
    assert "engine step failed" in str(e.value.message)
    wait_healthy(app)
    assert ray.get(driver.restarts.remote()) == restarts + 1
    r = oai.completions.create(model=MODEL, prompt="after the crash", max_tokens=20, **GREEDY,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    (want,) = target_only(app, [r.model_extra["prompt_token_ids"]], [20])
    assert r.choices[0].model_extra["token_ids"] == want
    wait_idle(app)


def test_killed_driver_is_replaced_inside_the_replica(app, oai):
    """The driver actor killed mid-stream: the stream ends with a clear 503-class error, the
    replica starts a new driver in its placement group (Serve does not have to replace the
    replica), and a request sent meanwhile waits for it and is exact."""
    driver = driver_handle()
    old = driver._actor_id
    stream = oai.completions.create(model=MODEL, prompt="doomed", max_tokens=900, stream=True,
                                    extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    ray.kill(driver)
    with pytest.raises(openai.APIError) as e:
        for _ in it:
            pass
    assert e.value.body["code"] == "engine_unavailable"
    # sent while the new driver starts: it waits for it, as requests wait out a restart
    r = oai.completions.create(model=MODEL, prompt="after the driver", max_tokens=20, **GREEDY,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    wait_healthy(app)
    assert driver_handle()._actor_id != old  # one driver again, a new one
    (want,) = target_only(app, [r.model_extra["prompt_token_ids"]], [20])
    assert r.choices[0].model_extra["token_ids"] == want
    wait_idle(app)


def test_dead_draft_is_found_by_the_health_probe(app, oai):
    driver = driver_handle()
    restarts = ray.get(driver.restarts.remote())
    ray.kill(ray.get(driver.actors.remote())["draft"][0])
    deadline = time.monotonic() + 60
    while ray.get(driver.restarts.remote()) == restarts:  # idle: only a probe can notice
        httpx.get(f"{app['url']}/health", timeout=30)
        assert time.monotonic() < deadline, "the probe did not restart the engine"
        time.sleep(0.2)
    wait_healthy(app)
    assert oai.completions.create(model=MODEL, prompt="ok", max_tokens=5).usage.total_tokens


def test_a_frozen_worker_fails_its_requests_and_the_engine_recovers(app, oai):
    """A TP worker stopped (SIGSTOP) mid-stream: its step is overdue, the probe finds the
    worker silent, /health says 503 meanwhile, the stream ends with a clear error, the engine
    restarts its actors (the frozen one killed) and the next request is exact."""
    driver = driver_handle()
    restarts = ray.get(driver.restarts.remote())
    worker = ray.get(driver.actors.remote())["workers"][1]
    pid = ray.get(worker.__ray_call__.remote(lambda self: os.getpid()))
    stream = oai.completions.create(model=MODEL, prompt="frozen", max_tokens=900, stream=True,
                                    extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    seen, stop = [], threading.Event()

    def poll_health() -> None:
        while not stop.is_set():
            r = httpx.get(f"{app['url']}/health", timeout=30)
            seen.append((r.status_code, r.json().get("error", {}).get("message", "")))
            time.sleep(0.2)

    poller = threading.Thread(target=poll_health)
    os.kill(pid, signal.SIGSTOP)
    poller.start()
    try:
        with pytest.raises(openai.APIError) as e:
            for _ in it:
                pass
        assert e.value.body["code"] == "engine_step_failed"
        assert "did not answer" in e.value.message
        wait_healthy(app)
    finally:
        stop.set()
        poller.join()
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
    assert any(status == 503 for status, _ in seen), seen
    assert ray.get(driver.restarts.remote()) == restarts + 1
    r = oai.completions.create(model=MODEL, prompt="after the freeze", max_tokens=20,
                               **GREEDY, extra_body={"ignore_eos": True,
                                                     "return_token_ids": True})
    (want,) = target_only(app, [r.model_extra["prompt_token_ids"]], [20])
    assert r.choices[0].model_extra["token_ids"] == want
    wait_idle(app)


def test_health_answers_503_while_the_driver_is_frozen(app, oai):
    """The driver stopped (SIGSTOP): /health answers 503 (the replica does not wait on the
    driver past its own bound) instead of hanging; once it runs again, all is well."""
    driver = driver_handle()
    pid = ray.get(driver.__ray_call__.remote(lambda self: os.getpid()))
    os.kill(pid, signal.SIGSTOP)
    try:
        r = httpx.get(f"{app['url']}/health", timeout=60)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert r.status_code == 503 and "did not answer" in r.json()["error"]["message"]
    wait_healthy(app)
    assert oai.completions.create(model=MODEL, prompt="ok", max_tokens=3).usage.total_tokens
