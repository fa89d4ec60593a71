"""The API's routes beyond completions (vLLM's /tokenize and /detokenize, /v1/models/{id},
/version), its API key and CORS: uvicorn on 127.0.0.1 over a LocalEngineClient (the tiny demo
target alone)."""

from __future__ import annotations

from pathlib import Path

import httpx2 as httpx
import pytest
from live_server import serve_in_thread

import deploy
from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from deploy.cli import build_parser
from deploy.engine_client import LocalEngineClient
from deploy.openai_api import ApiOptions, build_app
from deploy.tokenizer import load_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"
MODEL = "tiny"


@pytest.fixture(scope="module")
def engine_client():
    client = LocalEngineClient(LLMEngine(EngineConfig(model=str(DEMO / "target"))), MODEL)
    yield client
    client.close()


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(DEMO / "target"))


def serve(engine_client, tokenizer, **options):
    return serve_in_thread(build_app(engine_client, tokenizer, options=ApiOptions(**options)))


@pytest.fixture(scope="module")
def url(engine_client, tokenizer):
    base, stop = serve(engine_client, tokenizer)
    yield base
    stop()


def test_model_by_id_and_version(url):
    r = httpx.get(f"{url}/v1/models/{MODEL}")
    assert r.status_code == 200 and r.json()["id"] == MODEL and r.json()["object"] == "model"
    missing = httpx.get(f"{url}/v1/models/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert httpx.get(f"{url}/version").json() == {"version": deploy.__version__}


def test_tokenize_and_detokenize_are_the_tokenizers(url, tokenizer):
    text = "The quick brown fox"
    r = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": text}).json()
    assert r["tokens"] == tokenizer.encode(text) and r["count"] == len(r["tokens"])
    assert r["max_model_len"] > 0
    messages = [{"role": "user", "content": "hi there"}]
    chat = httpx.post(f"{url}/tokenize", json={"messages": messages}).json()
    assert chat["tokens"] == list(tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    back = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back == {"prompt": tokenizer.decode(r["tokens"])}
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert (info["eos_token"], info["bos_token"], info["pad_token"]) == (
        tokenizer.eos_token, tokenizer.bos_token, tokenizer.pad_token)
    assert info["chat_template"] == tokenizer.chat_template and info["chat_template"]
    assert info["model_max_length"] == r["max_model_len"]


@pytest.mark.parametrize(("route", "body", "param"), [
    ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "a", "truncate_prompt_tokens": 3}, "truncate_prompt_tokens"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
    ("/detokenize", {"tokens": "12"}, "tokens"),
])
def test_bad_tokenize_requests_are_400_naming_the_field(url, route, body, param):
    r = httpx.post(f"{url}{route}", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_tokenize_for_another_model_is_404(url):
    r = httpx.post(f"{url}/tokenize", json={"model": "other", "prompt": "a"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_api_key_guards_every_route_but_health_and_version(engine_client, tokenizer):
    base, stop = serve(engine_client, tokenizer, api_key="sesame")
    try:
        good = {"Authorization": "Bearer sesame"}
        for method, route, body in [("GET", "/v1/models", None), ("GET", "/metrics", None),
                                    ("POST", "/v1/completions",
                                     {"prompt": [1, 2], "max_tokens": 2}),
                                    ("POST", "/tokenize", {"prompt": "a"})]:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "sesame"},
                            {"x-api-key": "wrong"}):
                r = httpx.request(method, f"{base}{route}", json=body, headers=headers)
                assert r.status_code == 401, (route, headers)
                assert r.json()["error"]["code"] == "invalid_api_key"
            for headers in (good, {"x-api-key": "sesame"}):  # (Anthropic's clients: x-api-key)
                assert httpx.request(method, f"{base}{route}", json=body,
                                     headers=headers).status_code == 200, route
        assert httpx.get(f"{base}/health").status_code == 200
        assert httpx.get(f"{base}/version").status_code == 200
        # a browser's preflight carries no key: CORS answers it
        pre = httpx.options(f"{base}/v1/chat/completions", headers={
            "Origin": "http://localhost:3000", "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200 and pre.headers["access-control-allow-origin"] == "*"
    finally:
        stop()


def test_cors_allows_only_the_listed_origins(engine_client, tokenizer):
    base, stop = serve(engine_client, tokenizer, allowed_origins=("http://app.example",))
    try:
        def preflight(origin):
            return httpx.options(f"{base}/v1/completions", headers={
                "Origin": origin, "Access-Control-Request-Method": "POST"})

        ok = preflight("http://app.example")
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "http://app.example"
        denied = preflight("http://evil.example")
        assert denied.status_code == 400
        assert "access-control-allow-origin" not in denied.headers
        r = httpx.get(f"{base}/v1/models", headers={"Origin": "http://app.example"})
        assert r.headers["access-control-allow-origin"] == "http://app.example"
    finally:
        stop()


def test_cli_takes_the_access_flags(monkeypatch):
    monkeypatch.setenv("DFLASH_SERVE_API_KEY", "from-env")
    args = build_parser().parse_args(["serve", "--model", "m", "--allowed-origins",
                                      '["http://a"]'])
    assert args.api_key == "from-env" and args.allowed_origins == ["http://a"]
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--model", "m", "--allowed-origins", "http://a"])
    assert e.value.code == 2


def test_sampling_defaults_come_from_generation_config(tmp_path):
    from deploy.protocol import CompletionRequest, load_sampling_defaults

    (tmp_path / "generation_config.json").write_text(
        '{"temperature": 0.6, "top_p": 0.95, "top_k": 20, "do_sample": true}')
    d = load_sampling_defaults("auto", str(tmp_path))
    assert (d.temperature, d.top_p, d.top_k) == (0.6, 0.95, 20)
    assert load_sampling_defaults("vllm", str(tmp_path)).temperature == 1.0
    assert load_sampling_defaults("auto", str(DEMO / "target")).temperature == 1.0  # sets none
    assert load_sampling_defaults(str(tmp_path), str(DEMO / "target")).top_k == 20
    # a request's own values win; what it leaves out comes from the defaults
    req = CompletionRequest(prompt="a", top_k=5)
    p = req.sampling_params(4, d)
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 5)
    (tmp_path / "generation_config.json").write_text('{"temperature": -1}')
    with pytest.raises(ValueError, match="generation_config.*temperature"):
        load_sampling_defaults("auto", str(tmp_path))
    with pytest.raises(ValueError, match="does not exist"):
        load_sampling_defaults(str(tmp_path / "nowhere"), str(tmp_path))


def test_a_request_without_temperature_decodes_greedily_when_the_defaults_say_so(
        engine_client, tokenizer):
    from deploy.protocol import SamplingDefaults

    app = build_app(engine_client, tokenizer, defaults=SamplingDefaults(temperature=0.0))
    base, stop = serve_in_thread(app)
    try:
        body = {"prompt": [5, 6, 7], "max_tokens": 12, "ignore_eos": True,
                "return_token_ids": True}
        runs = [httpx.post(f"{base}/v1/completions", json={**body, "seed": seed}).json()
                for seed in (1, 2)]
        ids = [r["choices"][0]["token_ids"] for r in runs]
        reference = LLMEngine(EngineConfig(model=str(DEMO / "target")))  # greedy, in process
        want = reference.generate([[5, 6, 7]], SamplingParams(max_tokens=12, ignore_eos=True))
        assert ids[0] == ids[1] == want[0].output_ids
    finally:
        stop()


def test_chat_template_kwargs_reach_the_template(engine_client, tmp_path):
    """A template that reads `enable_thinking` (as Qwen3.5's does): the kwarg changes the
    tokens, in /tokenize and in a chat completion's prompt."""
    import json
    import shutil

    shutil.copytree(DEMO / "target", tmp_path / "target")
    cfg_path = tmp_path / "target" / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["chat_template"] = (
        "{%- for m in messages %}{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
        "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
        "{{- '<|im_start|>assistant\\n' }}{%- if enable_thinking is defined and not "
        "enable_thinking %}{{- 'no thoughts\\n' }}{%- endif %}{%- endif %}")
    cfg_path.write_text(json.dumps(cfg))
    tokenizer = load_tokenizer(str(tmp_path / "target"))
    base, stop = serve_in_thread(build_app(engine_client, tokenizer))
    try:
        messages = [{"role": "user", "content": "hi"}]

        def tokens(**extra):
            r = httpx.post(f"{base}/tokenize", json={"messages": messages, **extra})
            assert r.status_code == 200, r.text
            return r.json()["tokens"]

        plain, off = tokens(), tokens(chat_template_kwargs={"enable_thinking": False})
        assert off[: len(plain)] == plain and len(off) > len(plain)
        assert tokenizer.decode(off[len(plain):]) == "no thoughts\n"
        r = httpx.post(f"{base}/v1/chat/completions", json={
            "messages": messages, "max_tokens": 2, "return_token_ids": True,
            "chat_template_kwargs": {"enable_thinking": False}})
        assert r.status_code == 200 and r.json()["prompt_token_ids"] == off
    finally:
        stop()
