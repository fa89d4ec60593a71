"""Log-probabilities, echo, `n` and batched prompts over HTTP (uvicorn over a LocalEngineClient
with the demo target + trained draft, B = 8). Log-probabilities must be the target's own: the
reference is the target-only engine's, which tests/cluster/test_logprobs.py checks against
transformers."""

from __future__ import annotations

import json

import httpx2 as httpx
import pytest
from live_server import DEMO_MODEL, wait_until_idle

from configs.engine import SamplingParams

MODEL = DEMO_MODEL  # the conftest's `server` serves it
TOL = 2e-5


def reference(server, prompt: list[int], max_tokens: int, top: int):
    """The target alone, greedy: its output and log-probabilities (generated and prompt)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, logprobs=top,
                            prompt_logprobs=top)
    return server["reference"].generate([prompt], params)[0]


def post(server, path: str, body: dict) -> dict:
    r = httpx.post(server["url"] + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def sse(server, path: str, body: dict) -> list[dict]:
    with httpx.stream("POST", server["url"] + path, json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def bytes_of(server, token_id: int) -> bytes:
    """A token's own bytes (the demo tokenizer is byte-level BPE: GPT-2's byte table)."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    tok = server["tokenizer"]
    if token_id in tok.added_tokens_decoder:
        return tok.decode([token_id]).encode()
    table = {c: b for b, c in bytes_to_unicode().items()}
    return bytes(table[c] for c in tok.convert_ids_to_tokens(token_id))


def text_of(server, token_id: int) -> str:
    """How the API names a token: its text, or (part of a UTF-8 character) its bytes as
    \\xNN escapes, as OpenAI does."""
    raw = bytes_of(server, token_id)
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return "".join(f"\\x{b:02x}" for b in raw)
    return server["tokenizer"].decode([token_id])


def test_completion_logprobs_are_the_targets(server, oai):
    tok = server["tokenizer"]
    prompt = tok.encode("The quick brown fox")
    want = reference(server, prompt, 12, 3)
    got = oai.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                 logprobs=3, extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert lp.tokens == [text_of(server, t) for t in want.output_ids]
    assert lp.token_logprobs == pytest.approx([x.logprob for x in want.new_logprobs], abs=TOL)
    for alts, x in zip(lp.top_logprobs, want.new_logprobs, strict=True):
        assert alts == pytest.approx({text_of(server, t): v for t, v in x.top}, abs=TOL)
    # offsets into the returned text, token after token (a token's decoded length)
    assert lp.text_offset[0] == 0
    assert all(b - a == len(tok.decode([t])) for a, b, t in zip(
        lp.text_offset, lp.text_offset[1:], want.output_ids, strict=False))
    assert got.choices[0].text == tok.decode(want.output_ids, skip_special_tokens=True)


def test_echo_returns_the_prompt_with_its_logprobs(server):
    """lm-eval's loglikelihood: token-id prompts in a batch, echo, logprobs=1, max_tokens 0
    (the prompt alone) and 1 (one token after it)."""
    tok = server["tokenizer"]
    prompts = [tok.encode("Paris is the capital of"), tok.encode("one two three")]
    refs = [reference(server, p, 1, 1) for p in prompts]
    for max_tokens in (0, 1):
        body = post(server, "/v1/completions", {
            "model": MODEL, "prompt": prompts, "echo": True, "logprobs": 1,
            "max_tokens": max_tokens, "temperature": 0})
        assert [c["index"] for c in body["choices"]] == [0, 1]
        assert body["usage"]["prompt_tokens"] == sum(len(p) for p in prompts)
        assert body["usage"]["completion_tokens"] == max_tokens * len(prompts)
        for choice, prompt, ref in zip(body["choices"], prompts, refs, strict=True):
            lp = choice["logprobs"]
            n = len(prompt)
            assert len(lp["tokens"]) == n + max_tokens
            assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
            assert lp["token_logprobs"][1:n] == pytest.approx(
                [x.logprob for x in ref.prompt_logprobs[1:]], abs=TOL)
            assert choice["text"].startswith(tok.decode(prompt))
            if max_tokens:
                assert lp["token_logprobs"][n] == pytest.approx(ref.new_logprobs[0].logprob,
                                                                abs=TOL)
                assert choice["finish_reason"] == "length"
            else:
                assert choice["text"] == tok.decode(prompt)
    # a text prompt is echoed as given
    body = post(server, "/v1/completions", {"model": MODEL, "prompt": "Hello  world",
                                            "echo": True, "max_tokens": 2, "temperature": 0})
    assert body["choices"][0]["text"].startswith("Hello  world")
    assert body["choices"][0]["logprobs"] is None


def test_n_choices_and_batched_prompts(server, oai):
    tok = server["tokenizer"]
    prompts = ["Once upon a time", "In a galaxy"]
    greedy = oai.completions.create(model=MODEL, prompt=prompts, n=2, max_tokens=10,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    for i, p in enumerate(prompts):  # prompt-major; greedy choices equal the target alone
        want = tok.decode(reference(server, tok.encode(p), 10, 0).output_ids,
                          skip_special_tokens=True)
        assert [greedy.choices[2 * i + j].text for j in (0, 1)] == [want, want]
    assert greedy.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert greedy.usage.completion_tokens == 40

    def sampled():
        return [c.text for c in oai.completions.create(
            model=MODEL, prompt=prompts[0], n=3, max_tokens=12, temperature=1.0, seed=11,
            extra_body={"ignore_eos": True}).choices]

    first = sampled()
    assert sampled() == first  # a seed fixes every choice
    assert len(set(first)) > 1  # and the choices are distinct draws (seed, seed+1, ...)
    chat = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=6,
        temperature=0)
    assert [c.index for c in chat.choices] == [0, 1]
    assert chat.choices[0].message.content == chat.choices[1].message.content
    wait_until_idle(server["url"], 15)


def test_chat_logprobs_with_alternatives(server, oai):
    tok = server["tokenizer"]
    messages = [{"role": "user", "content": "Name a colour"}]
    prompt = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                     return_dict=False)
    want = reference(server, list(prompt), 8, 2)
    got = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=8,
                                      temperature=0, logprobs=True, top_logprobs=2,
                                      extra_body={"ignore_eos": True})
    content = got.choices[0].logprobs.content
    assert [c.token for c in content] == [text_of(server, t) for t in want.output_ids]
    assert [c.logprob for c in content] == pytest.approx(
        [x.logprob for x in want.new_logprobs], abs=TOL)
    for c, tok_id, x in zip(content, want.output_ids, want.new_logprobs, strict=True):
        assert [a.token for a in c.top_logprobs] == [text_of(server, t) for t, _ in x.top]
        assert c.bytes == list(bytes_of(server, tok_id))  # the token's own, not its name's
        assert [a.bytes for a in c.top_logprobs] == [list(bytes_of(server, t)) for t, _ in x.top]
    # the tokens' bytes make up the text
    text = b"".join(bytes(c.bytes) for c in content).decode(errors="replace")
    assert text == tok.decode(want.output_ids)
    plain = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=2,
                                        temperature=0)
    assert plain.choices[0].logprobs is None


def test_streams_carry_logprobs_per_chunk_and_choice(server):
    tok = server["tokenizer"]
    prompt = tok.encode("A B C D")
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 9, "temperature": 0, "n": 2,
            "logprobs": 2, "ignore_eos": True, "echo": True}
    whole = post(server, "/v1/completions", body)
    chunks = sse(server, "/v1/completions", body | {"stream": True})
    for i in (0, 1):
        mine = [c["choices"][0] for c in chunks if c["choices"][0]["index"] == i]
        assert "".join(c["text"] for c in mine) == whole["choices"][i]["text"]
        assert mine[0]["text"] == tok.decode(prompt)  # the echo comes first
        merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "text_offset": []}
        for c in mine:
            for key in merged:
                merged[key] += (c["logprobs"] or {}).get(key, [])
        want = whole["choices"][i]["logprobs"]
        assert merged["tokens"] == want["tokens"]
        assert merged["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=TOL)
        assert merged["text_offset"] == want["text_offset"]
        assert mine[-1]["finish_reason"] == "length"
    chat = sse(server, "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5,
        "temperature": 0, "logprobs": True, "stream": True, "ignore_eos": True})
    tokens = [e["token"] for c in chat if c["choices"] and c["choices"][0]["logprobs"]
              for e in c["choices"][0]["logprobs"]["content"]]
    assert len(tokens) == 5


def test_more_choices_than_the_queue_takes_are_served_when_nothing_waits(server, monkeypatch):
    """n = 30 against a queue of 10 while nothing else waits: the choices are admitted
    together and served (a request that cannot fit beside others is refused whole, at once:
    tests/deploy/test_engine_client.py)."""
    monkeypatch.setattr(server["client"], "max_waiting", 10)
    r = post(server, "/v1/completions", {"model": MODEL, "prompt": "hi", "n": 30,
                                         "max_tokens": 5, "ignore_eos": True})
    assert [c["index"] for c in r["choices"]] == list(range(30))
    assert all(c["finish_reason"] == "length" for c in r["choices"])
    wait_until_idle(server["url"], 30)


def test_vllm_prompt_logprobs(server):
    """vLLM's extension: per prompt token after the first, {id: {logprob, rank,
    decoded_token}} for the token itself and the k most likely; completions per choice (also
    next to echo's own, which keep their logprobs count), chat at the top; not with stream."""
    tok = server["tokenizer"]
    prompt = tok.encode("Paris is the capital of France")
    ref = reference(server, prompt, 1, 3)
    body = post(server, "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0,
        "prompt_logprobs": 3, "echo": True, "logprobs": 1})
    choice = body["choices"][0]
    assert all(len(alts) <= 1 for alts in choice["logprobs"]["top_logprobs"][1:])
    got = choice["prompt_logprobs"]
    assert got[0] is None and len(got) == len(prompt)
    for j, (entries, want) in enumerate(zip(got[1:], ref.prompt_logprobs[1:], strict=True)):
        mine = entries[str(prompt[j + 1])]
        assert mine["logprob"] == pytest.approx(want.logprob, abs=TOL)
        assert mine["rank"] == want.rank and mine["decoded_token"] == text_of(server, prompt[j + 1])
        for r, (t, v) in enumerate(want.top, start=1):
            assert entries[str(t)]["logprob"] == pytest.approx(v, abs=TOL)
            assert entries[str(t)]["rank"] == (r if t != prompt[j + 1] else want.rank)
        assert len(entries) == len({*map(str, (t for t, _ in want.top)), str(prompt[j + 1])})
    messages = [{"role": "user", "content": "hi"}]
    chat = post(server, "/v1/chat/completions", {"model": MODEL, "messages": messages,
                                                 "max_tokens": 2, "prompt_logprobs": 0})
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                  return_dict=False)
    assert len(chat["prompt_logprobs"]) == len(ids) and chat["prompt_logprobs"][0] is None
    assert all(list(e) == [str(t)] for e, t in zip(chat["prompt_logprobs"][1:], ids[1:],
                                                    strict=True))
    plain = post(server, "/v1/completions", {"model": MODEL, "prompt": prompt, "max_tokens": 1})
    assert "prompt_logprobs" not in plain["choices"][0]
    r = httpx.post(server["url"] + "/v1/completions", json={
        "model": MODEL, "prompt": prompt, "prompt_logprobs": 1, "stream": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs"


def test_twenty_alternatives_are_twenty_keys(server, oai):
    """Legacy completions key alternatives by token name: tokens that hold part of a UTF-8
    character (which decode alike, to U+FFFD) are named by their bytes, so none is lost."""
    got = oai.completions.create(model=MODEL, prompt="naïve café", max_tokens=16,
                                 temperature=0, logprobs=20, extra_body={"ignore_eos": True})
    tops = got.choices[0].logprobs.top_logprobs
    assert len(tops) == 16 and all(len(alts) == 20 for alts in tops)
    assert any("\\x" in name for alts in tops for name in alts)  # the demo's vocabulary has some
