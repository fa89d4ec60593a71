"""The OpenAI API end to end: uvicorn on 127.0.0.1 over a LocalEngineClient (demo target +
trained draft, B = 8), driven by the real `openai` client. Greedy outputs must equal
target-only greedy decoding token for token; errors come back as OpenAI's error JSON."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx2 as httpx
import openai
import pytest
import torch
from live_server import DEMO_MODEL, scrape_metrics, wait_until_idle

from configs.engine import SamplingParams
from deploy import openai_api, openai_server
from deploy.detokenizer import TextStream
from deploy.engine_client import EngineDeadError, EngineOverloaded
from deploy.metrics import VLLM_NAMES

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"
MODEL = DEMO_MODEL  # the conftest's `server` serves it
GREEDY = {"temperature": 0.0}


def target_only(server, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, ignore_eos=True) for m in max_tokens]
    return [o.output_ids for o in server["reference"].generate(prompts, params)]


def decode(server, ids: list[int]) -> str:
    return server["tokenizer"].decode(ids, skip_special_tokens=True)


def metrics(server) -> dict[tuple[str, tuple], float]:
    return scrape_metrics(server["url"])


def wait_idle(server, timeout: float = 15.0) -> dict:
    return wait_until_idle(server["url"], timeout)


def test_text_stream_releases_only_stable_text(server):
    tok = server["tokenizer"]
    text = "héllo wörld, 5€ and 7€ more"
    ids = tok.encode(text)
    assert len(ids) > len(text.split())  # multi-byte characters span several tokens
    stream, pieces = TextStream(tok, []), []
    for t in ids:
        stream.add([t])
        pieces.append(stream.release(final=False))
    pieces.append(stream.release(final=True))
    assert "".join(pieces) == text and not any("\ufffd" in p for p in pieces)

    stream, pieces, taken = TextStream(tok, ["7€", "never"]), [], 0
    for t in ids:
        taken += stream.add([t])
        pieces.append(stream.release(final=stream.stopped))
        if stream.stopped:
            break
    # nothing of "7€" leaked out before the match: a possible stop prefix is held back
    assert stream.stopped and "".join(pieces) == "héllo wörld, 5€ and "
    assert tok.decode(ids[:taken]).endswith("7€")  # stops at the token completing the string


def test_models_health_and_metrics_endpoints(server, oai, monkeypatch):
    (card,) = oai.models.list().data
    assert card.id == MODEL and card.model_extra["max_model_len"] == 1024
    assert httpx.get(f"{server['url']}/health").status_code == 200

    async def dead():
        raise EngineDeadError("engine gone")

    monkeypatch.setattr(server["client"], "check_health", dead)
    r = httpx.get(f"{server['url']}/health")
    assert r.status_code == 503 and "engine gone" in r.json()["error"]["message"]
    monkeypatch.undo()
    assert httpx.get(f"{server['url']}/health").status_code == 200
    r = httpx.get(f"{server['url']}/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")


def test_completion_greedy_equals_target_only(server, oai):
    prompt = "The quick brown fox"
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=40, **GREEDY,
                               extra_body={"ignore_eos": True, "return_token_ids": True})
    prompt_ids = server["tokenizer"].encode(prompt)
    (want,) = target_only(server, [prompt_ids], [40])
    (choice,) = r.choices
    assert choice.model_extra["token_ids"] == want
    assert choice.text == decode(server, want)
    assert choice.finish_reason == "length"
    assert r.model_extra["prompt_token_ids"] == prompt_ids
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (
        len(prompt_ids), 40, len(prompt_ids) + 40)
    assert r.object == "text_completion" and r.model == MODEL and r.id.startswith("cmpl-")


def test_seeded_sampling_reproduces(server, oai):
    kw = dict(model=MODEL, prompt="Sample me", max_tokens=24, seed=3, top_p=0.9,
              extra_body={"top_k": 50, "ignore_eos": True, "return_token_ids": True})
    runs = [oai.completions.create(**kw).choices[0].model_extra["token_ids"] for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 24  # temperature left out: OpenAI's 1.0


def test_completion_stream_of_token_ids_with_usage(server, oai):
    prompt_ids = [72, 101, 108, 108, 111, 44, 32, 119]
    (want,) = target_only(server, [prompt_ids], [33])
    chunks = list(oai.completions.create(
        model=MODEL, prompt=prompt_ids, max_tokens=33, **GREEDY, stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True, "return_token_ids": True}))
    *content, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 33
    assert last.usage.prompt_tokens == len(prompt_ids)
    assert all(c.usage is None for c in content)
    assert [c.choices[0].finish_reason for c in content][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in content[:-1])
    assert sum((c.choices[0].model_extra["token_ids"] for c in content), []) == want
    assert "".join(c.choices[0].text for c in content) == decode(server, want)
    assert len(content) > 1  # really streamed


def test_chat_greedy_equals_target_only(server, oai):
    messages = [{"role": "system", "content": "You are terse."},
                {"role": "user", "content": "Name a colour."}]
    prompt_ids = server["tokenizer"].apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    (want,) = target_only(server, [list(prompt_ids)], [30])
    r = oai.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=30,
                                    **GREEDY, extra_body={"ignore_eos": True})
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == decode(server, want)
    assert r.choices[0].finish_reason == "length" and r.object == "chat.completion"
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == 30

    stream = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=30,
                                         **GREEDY, stream=True,
                                         extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == decode(server, want)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" and c.usage is None for c in chunks)


def test_sixteen_concurrent_streams(server):
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 300, (int(n),), generator=g).tolist()
               for n in torch.randint(2, 40, (16,), generator=g)]
    lengths = [4 + 4 * i for i in range(16)]
    want = target_only(server, prompts, lengths)
    aoai = openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key="x", max_retries=0)

    async def one(prompt, n):
        ids, text, finish = [], [], None
        async for c in await aoai.completions.create(
                model=MODEL, prompt=prompt, max_tokens=n, **GREEDY, stream=True,
                extra_body={"ignore_eos": True, "return_token_ids": True}):
            ids += c.choices[0].model_extra["token_ids"]
            text.append(c.choices[0].text)
            finish = c.choices[0].finish_reason
        return ids, "".join(text), finish

    async def run():
        async with aoai:
            return await asyncio.gather(*(one(p, n) for p, n in zip(prompts, lengths,
                                                                    strict=True)))

    got = asyncio.run(run())
    assert [ids for ids, _, _ in got] == want
    assert [text for _, text, _ in got] == [decode(server, w) for w in want]
    assert {finish for _, _, finish in got} == {"length"}
    wait_idle(server)


def stop_string_in(text: str) -> tuple[str, int]:
    """A 3-character stop string whose first occurrence is past the start of `text`."""
    for i in range(8, len(text) - 3):
        s = text[i : i + 3]
        if "\ufffd" not in s and text.find(s) == i:
            return s, i
    raise AssertionError("no usable stop string")


def test_stop_strings_cut_the_text_and_abort_the_engine_request(server, oai):
    prompt = [80, 81, 82, 83]
    (want,) = target_only(server, [prompt], [60])
    full = decode(server, want)
    stop, at = stop_string_in(full)
    before = metrics(server)
    r = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=400, **GREEDY,
                               stop=[stop, "never-there"], extra_body={"ignore_eos": True})
    assert r.choices[0].text == full[:at] and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 60  # the engine did not run on to max_tokens

    stream = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=400, **GREEDY,
                                    stop=stop, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == full[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"
    after = wait_idle(server)
    key = ("dflash_requests_total", (("endpoint", "completions"), ("finish_reason", "stop")))
    assert after[key] - before.get(key, 0) == 2
    generated = "dflash_generation_tokens_total", ()
    assert after[generated] - before[generated] < 120


def test_cancelled_stream_returns_the_engine_to_idle(server, oai):
    before = metrics(server)
    stream = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Tell me everything."}],
        max_tokens=900, **GREEDY, stream=True, extra_body={"ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 3:
            break
    assert metrics(server)[("dflash_num_requests_running", ())] == 1
    stream.close()
    after = wait_idle(server)
    key = ("dflash_requests_total", (("endpoint", "chat_completions"),
                                     ("finish_reason", "abort")))
    assert after[key] - before.get(key, 0) == 1
    generated = "dflash_generation_tokens_total", ()
    assert after[generated] - before[generated] < 900


def test_client_leaving_a_non_streaming_request_aborts_it(server):
    before = metrics(server)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server['url']}/v1/completions", timeout=0.3,
                   json={"model": MODEL, "prompt": "Go on", "max_tokens": 900, **GREEDY,
                         "ignore_eos": True})
    after = wait_idle(server)
    key = ("dflash_requests_total", (("endpoint", "completions"), ("finish_reason", "abort")))
    assert after[key] - before.get(key, 0) == 1
    generated = "dflash_generation_tokens_total", ()
    assert after[generated] - before[generated] < 900


BAD_COMPLETIONS = [  # (body, status, param, code)
    ({"model": "gpt-4", "prompt": "hi"}, 404, "model", "model_not_found"),
    ({"model": MODEL, "prompt": [5] * 1100}, 400, "prompt", "context_length_exceeded"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 1024}, 400, "max_tokens",
     "context_length_exceeded"),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 0}, 400, "max_tokens", None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": -3}, 400, "max_tokens", None),
    ({"model": MODEL, "prompt": "hi", "temperature": -1}, 400, "temperature", None),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature", None),
    ({"model": MODEL, "prompt": "hi", "top_p": 0}, 400, "top_p", None),
    ({"model": MODEL, "prompt": "hi", "top_k": -5}, 400, "top_k", None),
    ({"model": MODEL, "prompt": "hi", "n": 0}, 400, "n", None),
    ({"model": MODEL, "prompt": "hi", "n": 257}, 400, "n", None),
    ({"model": MODEL, "prompt": "hi", "best_of": 3}, 400, "best_of", None),
    ({"model": MODEL, "prompt": ["hi"] * 130, "n": 2}, 400, "prompt", None),
    ({"model": MODEL, "prompt": "hi", "logprobs": 21}, 400, "logprobs", None),
    ({"model": MODEL, "prompt": "hi", "logprobs": -1}, 400, "logprobs", None),
    ({"model": MODEL, "prompt": "hi", "logprobs": True}, 400, "logprobs", None),
    ({"model": MODEL, "prompt": "hi", "top_logprobs": 2}, 400, "top_logprobs", None),
    ({"model": MODEL, "prompt": "hi", "echo": "yes"}, 400, "echo", None),
    ({"model": MODEL, "prompt": [[1, 2], []]}, 400, "prompt", None),
    ({"model": MODEL, "prompt": []}, 400, "prompt", None),
    ({"model": MODEL, "prompt": [[1, 2], [1000]]}, 400, "prompt", None),
    ({"model": MODEL, "prompt": "hi", "stop": list("abcdefghijklmnopq")}, 400, "stop", None),
    ({"model": MODEL, "prompt": [1000]}, 400, "prompt", None),
    ({"model": MODEL, "prompt": ""}, 400, "prompt", None),
    ({"model": MODEL, "prompt": ["a", ""]}, 400, "prompt", None),
    ({"model": MODEL}, 400, "prompt", None),
    # wrong JSON types are refused, never coerced
    ({"model": MODEL, "prompt": "hi", "max_tokens": "16"}, 400, "max_tokens", None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": True}, 400, "max_tokens", None),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 16.5}, 400, "max_tokens", None),
    ({"model": MODEL, "prompt": "hi", "stream": "yes"}, 400, "stream", None),
    ({"model": MODEL, "prompt": "hi", "seed": "7"}, 400, "seed", None),
    ({"model": MODEL, "prompt": [1.5, 2]}, 400, "prompt", None),
    ({"model": MODEL, "prompt": "hi", "stream_options": {"include_usage": "yes"},
      "stream": True}, 400, "stream_options.include_usage", None),
    # vLLM's extensions we do not implement
    ({"model": MODEL, "prompt": "hi", "use_beam_search": True}, 400, "use_beam_search", None),
    # structured outputs and sampling controls: refused before the engine, naming the reason
    *(({"model": MODEL, "prompt": "hi", **extra}, 400, param, None) for extra, param in (
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        ({"guided_regex": "(a"}, "guided_regex"),
        ({"guided_grammar": "root ::= foo"}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_decoding_backend": "outlines"}, "guided_decoding_backend"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"logit_bias": {"1000": 1}}, "logit_bias"), ({"logit_bias": {"a": 1}}, "logit_bias"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"allowed_token_ids": [384]}, "allowed_token_ids"),
        ({"allowed_token_ids": []}, "allowed_token_ids"),
        ({"bad_words": [" "]}, "bad_words"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": "1"}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
        ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
        ({"min_tokens": -1}, "min_tokens"))),
    ({"model": MODEL, "prompt": "hi", "user": 5}, 400, "user", None),
]
BAD_CHATS = [
    ({"model": MODEL}, 400, "messages", None),
    ({"model": MODEL, "messages": []}, 400, "messages", None),
    ({"model": MODEL, "messages": [{"content": "no role"}]}, 400, "messages.0.role", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "max_completion_tokens": 0}, 400, "max_completion_tokens", None),
    ({"model": MODEL, "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages.0.role",
     None),
    ({"model": MODEL, "messages": [{"role": "user", "content": 5}]}, 400, "messages.0.content",
     None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": "enable_thinking"}, 400, "chat_template_kwargs", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}],
      "chat_template_kwargs": {"tokenize": False}}, 400, "chat_template_kwargs.tokenize", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 3},
     400, "top_logprobs", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": True,
      "top_logprobs": 30}, 400, "top_logprobs", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "logprobs": 2},
     400, "logprobs", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "echo": True},
     400, "echo", None),
    ({"model": MODEL, "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n", None),
    # OpenAI's fields we accept but do not act on (docs/API.md): their types and values
    *(({"model": MODEL, "messages": [{"role": "user", "content": "x"}], **extra}, 400, param,
       None) for extra, param in (
        ({"user": ["x"]}, "user"), ({"reasoning_effort": "extreme"}, "reasoning_effort"),
        ({"reasoning_effort": 3}, "reasoning_effort"), ({"metadata": "x"}, "metadata"),
        ({"metadata": {"a": 1}}, "metadata.a"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"store": True}, "store"), ({"store": "no"}, "store"),
        ({"service_tier": "turbo"}, "service_tier"), ({"service_tier": 1}, "service_tier"))),
]


def test_bad_inputs_return_openai_errors_and_the_server_keeps_serving(server, oai):
    url = server["url"]
    before = metrics(server)
    for path, cases in (("/v1/completions", BAD_COMPLETIONS),
                        ("/v1/chat/completions", BAD_CHATS)):
        for body, status, param, code in cases:
            r = httpx.post(url + path, json=body)
            assert r.status_code == status, (body, r.text)
            err = r.json()["error"]
            assert (err["param"], err["code"]) == (param, code), (body, err)
            assert err["type"] == "invalid_request_error" and err["message"]
    r = httpx.post(url + "/v1/completions", content=b'{"model": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert httpx.post(url + "/v1/completions", json=[1, 2]).status_code == 400
    for path, raw in (  # a lone surrogate; a body nested 100,000 levels deep
            ("/v1/completions", b'{"model": "%s", "prompt": "a\\ud800b"}' % MODEL.encode()),
            ("/v1/chat/completions", b'{"model": "%s", "messages": [{"role": "user", '
                                     b'"content": "a\\udfffb"}]}' % MODEL.encode()),
            ("/v1/completions", b'{"a": ' * 100_000 + b"1" + b"}" * 100_000),
            ("/v1/completions", b"[" * 100_000 + b"]" * 100_000)):
        r = httpx.post(url + path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    pair = b'{"model": "%s", "prompt": "a\\ud83d\\ude00b", "max_tokens": 2}' % MODEL.encode()
    r = httpx.post(url + "/v1/completions", content=pair,  # a pair is one character: fine
                   headers={"content-type": "application/json"})
    assert r.status_code == 200, r.text
    r = httpx.get(url + "/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    errors = metrics(server)
    key = ("dflash_request_errors_total", (("code", "400"), ("endpoint", "completions")))
    assert errors[key] - before.get(key, 0) >= len(BAD_COMPLETIONS) - 1

    with pytest.raises(openai.BadRequestError) as e:  # what an SDK user sees
        oai.completions.create(model=MODEL, prompt="hi", temperature=-0.5)
    assert e.value.body["param"] == "temperature" and "temperature" in e.value.message
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])

    r = oai.completions.create(model=MODEL, prompt="still alive", max_tokens=5, **GREEDY)
    assert r.usage.completion_tokens >= 1
    wait_idle(server)


def test_openais_unused_fields_are_accepted_and_service_tier_is_answered(server, oai):
    """user, reasoning_effort, metadata, store: false, service_tier: accepted, no effect; a
    named tier is answered as "default" (the one way every request is served)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
            **GREEDY}
    plain = oai.chat.completions.create(**chat)
    assert plain.service_tier is None and "service_tier" not in plain.model_dump(
        exclude_unset=True)
    for effort in ("none", "minimal", "low", "medium", "high", "xhigh", "max"):
        r = oai.chat.completions.create(**chat, reasoning_effort=effort)
        assert r.choices[0].message.content == plain.choices[0].message.content
    for tier in ("auto", "default", "flex", "scale", "priority", "fast"):
        assert oai.chat.completions.create(**chat, service_tier=tier).service_tier == "default"
    r = oai.chat.completions.create(**chat, user="u-1", metadata={"team": "a" * 512},
                                    store=False)
    assert r.choices[0].message.content == plain.choices[0].message.content
    r = httpx.post(server["url"] + "/v1/chat/completions", json={**chat, "store": None,
                                                                   "metadata": None})
    assert r.status_code == 200, r.text
    chunks = list(oai.chat.completions.create(**chat, stream=True, service_tier="priority"))
    assert chunks and {c.service_tier for c in chunks} == {"default"}
    r = oai.completions.create(model=MODEL, prompt="hi", max_tokens=2, user="u-1")
    assert r.usage.completion_tokens == 2
    wait_idle(server)


def test_overload_is_429_and_unexpected_errors_are_500(server, oai, monkeypatch):
    def full(requests):
        raise EngineOverloaded("3 requests are already waiting; retry later")

    monkeypatch.setattr(server["client"], "submit_many", full)
    with pytest.raises(openai.RateLimitError) as e:
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=4)
    assert e.value.status_code == 429 and e.value.body["code"] == "engine_overloaded"
    monkeypatch.undo()

    def broken(req):
        raise RuntimeError("boom")

    monkeypatch.setattr(server["server"], "_prompts", broken)
    r = httpx.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
    monkeypatch.undo()
    assert oai.completions.create(model=MODEL, prompt="ok", max_tokens=3).usage.total_tokens


def test_metrics_report_latency_and_acceptance(server, oai):
    oai.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, **GREEDY,
                           extra_body={"ignore_eos": True})
    m = metrics(server)
    for name in ("dflash_time_to_first_token_seconds_count",
                 "dflash_inter_token_latency_seconds_count",
                 "dflash_e2e_request_latency_seconds_count", "dflash_acceptance_length_count",
                 "dflash_prompt_tokens_total", "dflash_generation_tokens_total"):
        assert m[(name, ())] > 0, name
    rounds = m[("dflash_spec_decode_num_drafts_total", ())]
    accepted = m[("dflash_spec_decode_num_accepted_tokens_total", ())]
    assert m[("dflash_acceptance_length_bucket", (("le", "+Inf"),))] == rounds
    assert m[("dflash_acceptance_length_sum", ())] == accepted + rounds  # + the bonus token
    assert m[("dflash_spec_decode_num_draft_tokens_total", ())] == 7 * rounds  # B = 8
    by_length = {dict(k[1])["drafts"]: v for k, v in m.items()
                 if k[0] == "dflash_spec_decode_rounds_by_draft_length_total"}
    assert by_length == {"7": rounds}  # a fixed block: B − 1 every round
    per_pos = {int(dict(k[1])["position"]): v for k, v in m.items()
               if k[0] == "dflash_spec_decode_num_accepted_tokens_per_pos_total"}
    assert sorted(per_pos) == list(range(7)) and sum(per_pos.values()) == accepted
    assert per_pos[0] >= per_pos[6] > 0  # the trained draft gets whole blocks accepted
    # every series is labelled with the served model
    labelled = scrape_metrics(server["url"], model_name=True)
    assert {dict(k[1]).get("model_name") for k in labelled} == {MODEL}
    # one propose and one verify per batched round (rounds above count per sequence)
    drafts = m[("dflash_draft_time_per_round_seconds_count", ())]
    assert 0 < drafts == m[("dflash_verify_time_per_round_seconds_count", ())] <= rounds
    # the driver's wall time per step: one per batched round (at least the draft's and the
    # verify's), and the prefill steps
    step = {(dict(k[1])["kind"], k[0].rsplit("_", 1)[1]): v for k, v in m.items()
            if k[0].startswith("dflash_engine_step_seconds_") and "le" not in dict(k[1])}
    assert step[("round", "count")] == drafts and step[("prefill", "count")] > 0
    assert step[("round", "sum")] >= m[("dflash_verify_time_per_round_seconds_sum", ())]

    # vLLM's names: each series equals its dflash_ twin sample for sample (one scrape)
    twins = {vllm: ours for ours, names in VLLM_NAMES.items() for vllm in names}
    assert set(twins) >= {"vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                          "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds",
                          "vllm:spec_decode_num_accepted_tokens_per_pos"}
    copies = 0
    for (name, labels), value in m.items():
        if name.startswith("vllm:") and not name.startswith(("vllm:request_success",
                                                             "vllm:num_preemptions")):
            family = max((v for v in twins if name.startswith(v)), key=len)
            assert value == m[(twins[family] + name.removeprefix(family), labels)], name
            copies += 1
    assert copies > 100 and all(any(n.startswith(v) for n, _ in m) for v in twins)
    by_reason: dict[str, float] = {}
    for (name, labels), value in m.items():
        if name == "dflash_requests_total":
            reason = dict(labels)["finish_reason"]
            by_reason[reason] = by_reason.get(reason, 0) + value
    assert {dict(k[1])["finished_reason"]: v for k, v in m.items()
            if k[0] == "vllm:request_success_total"} == by_reason
    assert m[("vllm:num_preemptions_total", ())] == 0  # admission never over-commits pages
    assert m[("vllm:request_generation_tokens_sum", ())] == m[
        ("dflash_generation_tokens_total", ())]


def test_a_repeated_prompt_is_served_from_the_prefix_cache(server, oai):
    """The same greedy completion twice: the second prefills only the prompt's last page's
    tokens, answers the same, and says so in usage and /metrics (vLLM's names too)."""
    prompt = "A prefix cache keeps the pages of earlier prompts for later ones. " * 3
    before = metrics(server)
    runs = [oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, **GREEDY,
                                   extra_body={"ignore_eos": True}) for _ in range(2)]
    assert runs[0].choices[0].text == runs[1].choices[0].text
    n = runs[0].usage.prompt_tokens
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in runs]
    assert cached[0] == 0 and 0 < n - cached[1] <= 8  # the demo server's pages hold 8 tokens
    after = metrics(server)
    for ours, vllm, grew in (("dflash_prefix_cache_hits_total", "vllm:prefix_cache_hits_total",
                              cached[1]),
                             ("dflash_prefix_cache_queries_total",
                              "vllm:prefix_cache_queries_total", 2 * n),
                             ("dflash_prefix_cache_hit_requests_total", None, 1)):
        assert after[(ours, ())] - before.get((ours, ()), 0) == grew, ours
        assert vllm is None or after[(vllm, ())] == after[(ours, ())]
    assert 0 < after[("dflash_prefix_cache_hit_rate", ())] <= 1
    assert after[("dflash_prefix_cache_snapshots", ())] > 0
    assert after[("dflash_prefix_cache_boundary_slots", ())] == 0  # both came back at their end


def test_oversized_requests_are_refused_before_they_are_read_or_tokenized(server, oai):
    """A body over max_request_bytes is a 413 (by its Content-Length, or while it streams in
    without one); a text prompt that cannot fit the context is a 400 before tokenizing."""
    url = server["url"] + "/v1/completions"
    big = b'{"model": "%s", "prompt": "' % MODEL.encode() + b"a" * 20_000_000 + b'"}'
    r = httpx.post(url, content=big, headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"

    def chunked():  # no Content-Length: refused once the bytes read pass the limit
        for _ in range(20):
            yield b" " * 1_000_000

    r = httpx.post(url, content=chunked(), headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    server_obj = server["server"]
    limit = server_obj.client.max_model_len * openai_server.MAX_CHARS_PER_TOKEN
    for path, body in (("/v1/completions", {"model": MODEL, "prompt": "a" * (limit + 1)}),
                       ("/v1/chat/completions", {"model": MODEL, "messages": [
                           {"role": "user", "content": "a" * (limit // 2 + 1)},
                           {"role": "user", "content": "a" * (limit // 2 + 1)}]})):
        r = httpx.post(server["url"] + path, json=body)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
    r = oai.completions.create(model=MODEL, prompt="still serving", max_tokens=3)
    assert r.usage.completion_tokens >= 1


RAY_TEXTS = [  # what Ray and CUDA put in an engine error's text
    "engine step failed: ActorDied: rank 0: OutOfMemoryError: CUDA out of memory. Tried to "
    "allocate 12.00 GiB. Process 48213 has 138 GiB memory in use.\nTo see more information "
    "about memory usage on this node, use `ray logs raylet.out -ip 10.0.3.17`",
    "engine step failed: RayTaskError(RuntimeError): ray::TargetWorker.serve_steps() "
    "(pid=7711, ip=10.0.3.17, actor_id=1b2c3d4e5f60718293a4b5c6d7e8f901, repr=<TargetWorker "
    "object at 0x7f3a2b1c0d9e>) namespace=serve-abc",
    "the engine driver died: class_name: EngineDriver actor_id: 0123456789abcdef01234567 "
    "pid: 1234 namespace: serve ip: 192.168.1.5 [fe80::1]:6379",
]


@pytest.mark.parametrize("text", RAY_TEXTS)
def test_engine_errors_reach_clients_without_addresses_pids_or_ray_ids(server, monkeypatch,
                                                                       text):
    from deploy.engine_client import EngineStepError

    def failing(req):
        raise EngineStepError(text)

    monkeypatch.setattr(server["server"], "_prompts", failing)
    r = httpx.post(server["url"] + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
    assert r.status_code == 500 and r.json()["error"]["code"] == "engine_step_failed"
    message = r.json()["error"]["message"]
    for private in ("10.0.3.17", "192.168.1.5", "fe80::1", "48213", "7711", "1234",
                    "1b2c3d4e5f60718293a4b5c6d7e8f901", "0123456789abcdef01234567",
                    "0x7f3a2b1c0d9e", "serve-abc", "raylet", "\n"):
        assert private not in message, (private, message)
    assert message.startswith(text.split(":")[0])  # what failed is still said


def test_the_grafana_dashboard_reads_only_series_the_server_exports(server, oai):
    """deploy/grafana-dashboard.json: valid JSON, and every dflash_ series its queries name is
    one /metrics serves (after a speculative request and a refused one, so every series
    exists)."""
    import json
    import re

    oai.completions.create(model=MODEL, prompt="dashboards", max_tokens=8, **GREEDY,
                           extra_body={"ignore_eos": True})
    assert httpx.post(f"{server['url']}/v1/completions", json={"prompt": ""}).status_code == 400
    exported = {name for name, _ in scrape_metrics(server["url"])}
    dash = json.loads((DEMO.parents[2] / "deploy" / "grafana-dashboard.json").read_text())
    # $prefix picks /metrics' names (dflash_) or Ray's export of them (ray_dflash_)
    exprs = [t["expr"].replace("${prefix}", "dflash_") for p in dash["panels"]
             for t in p["targets"]]
    named = {n for e in exprs for n in re.findall(r"dflash_[a-z0-9_]+", e)}
    assert len(dash["panels"]) >= 10 and named and named <= exported, named - exported
    assert all('model_name=~"$model_name"' in e for e in exprs)


class _EndlessClient:
    """An engine client whose every request streams one token per output and never ends;
    `closed` names the requests whose stream was closed (which aborts them)."""

    model_name, max_model_len, vocab_size = "endless", 4096, 100

    def __init__(self):
        self.closed: list[str] = []

    def snapshot(self):  # (read only by /metrics)
        raise EngineDeadError("no engine")

    async def generate_many(self, requests):
        return [_EndlessStream(self, r) for r in requests]


class _EndlessStream:
    def __init__(self, client: _EndlessClient, request):
        self.client, self.request = client, request

    def __aiter__(self):
        return self

    async def __anext__(self):
        from cluster.engine import RequestOutput

        await asyncio.sleep(0)
        r = self.request
        return RequestOutput(r.request_id, list(r.prompt_ids), [7], [], False, None, [])

    async def aclose(self) -> None:
        if self.request.request_id not in self.client.closed:
            self.client.closed.append(self.request.request_id)


@pytest.mark.parametrize("leaves", ["send_fails", "cancelled"])
def test_a_stream_whose_client_leaves_is_closed_at_once(leaves):
    """The streamed body is closed, and with it the engine request, as the response ends,
    however it ends: a send failing because the client left (ASGI 2.4), or the handler
    cancelled (as Ray Serve cancels a replica's request when its client leaves). Checked with
    the garbage collector off and before the event loop runs again: no finalizer does it."""
    import gc
    import json

    from starlette.requests import ClientDisconnect

    client = _EndlessClient()
    app = openai_api.build_app(client, None)
    body = json.dumps({"model": "endless", "prompt": [1, 2, 3], "max_tokens": 900,
                       "stream": True, "ignore_eos": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/completions", "raw_path": b"/v1/completions", "query_string": b"",
             "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80),
             "headers": [(b"content-type", b"application/json"),
                         (b"content-length", str(len(body)).encode())]}

    async def run() -> list[str]:
        requests = [{"type": "http.request", "body": body, "more_body": False}]
        third_chunk = asyncio.Event()
        chunks = 0

        async def receive():
            if requests:
                return requests.pop()
            await asyncio.Event().wait()  # the client says nothing more

        async def send(message):
            nonlocal chunks
            if message["type"] == "http.response.body":
                chunks += 1
                if chunks == 3:
                    third_chunk.set()
                    if leaves == "send_fails":
                        raise OSError("the client is gone")
                    await asyncio.Event().wait()  # blocked until cancelled

        task = asyncio.ensure_future(app(scope, receive, send))
        await third_chunk.wait()
        if leaves == "cancelled":
            task.cancel()
        with pytest.raises(ClientDisconnect if leaves == "send_fails" else asyncio.CancelledError):
            await task
        return list(client.closed)  # before the loop runs a finalizer

    gc.disable()
    try:
        closed = asyncio.run(run())
    finally:
        gc.enable()
    assert len(closed) == 1


def test_conflicting_framing_is_a_400_and_idle_connections_starve_nothing(server):
    """Held up in the second red-team pass and kept: a body with both Content-Length and
    Transfer-Encoding is refused by the HTTP server (400), and 1,000 connections held open
    without a request do not keep a request from being served."""
    import resource
    import socket
    from urllib.parse import urlsplit

    host, port = urlsplit(server["url"]).hostname, urlsplit(server["url"]).port
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                  b"\r\nContent-Length: 5\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\n")
        assert s.recv(64).split(b" ")[1] == b"400"
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(max(soft, 4096), hard), hard))
    idle = []
    try:
        for _ in range(1000):
            idle.append(socket.create_connection((host, port), timeout=30))
        r = httpx.post(server["url"] + "/v1/completions", timeout=60,
                       json={"model": MODEL, "prompt": "still here", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    finally:
        for s in idle:
            s.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_sixty_four_requests_near_the_context_all_finish(server):
    """Held up and kept: 64 prompts 4 tokens short of the context at once (four times the
    sequences the engine runs together): each is served to the end of the context."""
    context = server["client"].max_model_len
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(0, 300, (context - 4,), generator=g).tolist() for _ in range(64)]

    async def run():
        async with openai.AsyncOpenAI(base_url=f"{server['url']}/v1", api_key="x",
                                      max_retries=0, timeout=300) as aoai:
            return await asyncio.gather(*(aoai.completions.create(
                model=MODEL, prompt=p, max_tokens=4, **GREEDY, extra_body={"ignore_eos": True})
                for p in prompts))

    for r in asyncio.run(run()):
        assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 4
    wait_idle(server)


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["city", "rank"],
          "properties": {"city": {"type": "string", "maxLength": 10},
                         "rank": {"type": "integer", "minimum": 1, "maximum": 9}}}


def test_structured_outputs_and_controls_through_the_sdk(server, oai):
    """Each spelling of a constraint on both endpoints, streamed and not, n > 1: the output is
    valid, and greedy output equals the target-only engine's under the same parameters."""
    import json
    import re

    import jsonschema

    from configs.engine import GrammarSpec

    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A city?"}], max_tokens=40, **GREEDY,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "city", "schema": SCHEMA, "strict": True}})
    assert chat.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(chat.choices[0].message.content), SCHEMA)
    obj = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON?"}], max_tokens=40,
        **GREEDY, response_format={"type": "json_object"}, extra_body={"min_tokens": 2})
    assert obj.choices[0].message.content.startswith("{")

    choices = ["the river", "an oak", "bread"]
    many = oai.completions.create(model=MODEL, prompt="The library", max_tokens=20, n=4,
                                  temperature=1.0, seed=5,
                                  extra_body={"structured_outputs": {"choice": choices}})
    assert [c.finish_reason for c in many.choices] == ["stop"] * 4
    assert all(c.text in choices for c in many.choices)

    regex = r"[0-9]{3}-[a-z]{2,4}"
    stream = oai.completions.create(model=MODEL, prompt="Code:", max_tokens=20, stream=True,
                                    **GREEDY, extra_body={"guided_regex": regex,
                                                          "return_token_ids": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert re.fullmatch(regex, text), text

    # greedy with controls equals the target-only engine's output under the same params
    tok = server["tokenizer"]
    prompt = tok.encode("To make bread, mix")
    body = {"repetition_penalty": 1.3, "frequency_penalty": 0.5, "presence_penalty": 0.2,
            "logit_bias": {"264": -100, "17": 2.5}, "bad_words": ["the"], "min_tokens": 10,
            "guided_grammar": 'root ::= [a-z ]+ "."', "max_tokens": 30, "temperature": 0.0,
            "return_token_ids": True}
    r = httpx.post(f"{server['url']}/v1/completions",
                   json={"model": MODEL, "prompt": prompt, **body}).json()
    from deploy.sampling_controls import bad_words_token_ids

    params = SamplingParams(max_tokens=30, repetition_penalty=1.3, frequency_penalty=0.5,
                            presence_penalty=0.2, logit_bias=((264, -100.0), (17, 2.5)),
                            bad_words_token_ids=bad_words_token_ids(tok, ["the"]), min_tokens=10,
                            grammar=GrammarSpec("grammar", 'root ::= [a-z ]+ "."'))
    want = server["reference"].generate([prompt], params)[0].output_ids
    assert r["choices"][0]["token_ids"] == want
    # the grammar's prefix (the random model may not reach its end in 30 tokens)
    assert re.fullmatch(r"[a-z ]+\.?", r["choices"][0]["text"])
    wait_idle(server)
