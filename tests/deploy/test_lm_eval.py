"""lm-eval's OpenAI-API clients against the tiny demo server over real HTTP (uvicorn on
127.0.0.1 over a LocalEngineClient: demo target + trained draft): `local-completions` runs a
multiple-choice task (loglikelihood: `echo` + `logprobs`, batched token-id prompts) and a
generate_until task, `local-chat-completions` the generate_until task. The tasks are the YAML
files in tests/assets/lm_eval over local jsonl files; HF datasets runs offline.

What must hold: each continuation's log-probability and is-greedy flag equal transformers'
Qwen3.5-MoE run directly on the target, so lm-eval picks the same answers; each generation is
target-only greedy decoding cut at the task's stop string; every document reached the server
once per request lm-eval makes, with the token counts it sent."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from live_server import DEMO_MODEL, demo_api, scrape_metrics, wait_until_idle
from transformers import Qwen3_5MoeForCausalLM

from configs.engine import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "tests" / "assets"
TARGET, DRAFT, TASKS = ASSETS / "tiny" / "target", ASSETS / "tiny" / "draft", ASSETS / "lm_eval"
CHOICE, GENERATE = "dflash_tiny_choice", "dflash_tiny_generate"
GEN_KWARGS = yaml.safe_load((TASKS / f"{GENERATE}.yaml").read_text())["generation_kwargs"]
MODEL = DEMO_MODEL
# A sum of up to 6 fp32 log-probabilities, the engine's against transformers' (1.2e-5 seen).
LL_ATOL = 2e-4


def read_jsonl(name: str) -> list[dict]:
    return [json.loads(line) for line in (TASKS / name).read_text().splitlines() if line]


class RecordingApp:
    """The API app, recording each POST that reaches it as (path, JSON body)."""

    def __init__(self, app) -> None:
        self.app, self.posts = app, []

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            return await self.app(scope, receive, send)
        body = bytearray()

        async def recording_receive():
            message = await receive()
            if message["type"] == "http.request":
                body.extend(message.get("body", b""))
                if not message.get("more_body"):
                    self.posts.append((scope["path"], json.loads(body)))
            return message

        await self.app(scope, recording_receive, send)


@pytest.fixture(scope="module")
def server():
    with demo_api(wrap=RecordingApp) as s:
        yield s


@pytest.fixture(scope="module")
def hf() -> Qwen3_5MoeForCausalLM:
    return Qwen3_5MoeForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def lm_eval(tmp_path_factory):
    """lm_eval and a TaskManager over tests/assets/lm_eval only, with HF datasets offline and
    the working directory at the repository root (the task files name their data from it)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_DATASETS_OFFLINE", "1")
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_DATASETS_CACHE", str(tmp_path_factory.mktemp("hf_datasets")))
        mp.chdir(ROOT)
        import datasets
        import lm_eval
        from lm_eval.tasks import TaskManager

        # datasets reads the environment once, at its import (maybe earlier in the session)
        mp.setattr(datasets.config, "HF_HUB_OFFLINE", True)
        yield lm_eval, TaskManager(include_path=str(TASKS), include_defaults=False)


def evaluate(lm_eval, model: str, task: str, **model_args) -> tuple[dict, list[dict]]:
    """One task through lm-eval's client `model`; its metrics and its samples in doc order."""
    module, tasks = lm_eval
    out = module.simple_evaluate(
        model=model, model_args={"model": MODEL, "max_length": 1024, "max_retries": 1,
                                 **model_args},
        tasks=[task], task_manager=tasks, apply_chat_template=model == "local-chat-completions",
        bootstrap_iters=0, random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    return out["results"][task], sorted(out["samples"][task], key=lambda s: s["doc_id"])


def metric_sum(m: dict, name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in m.items()
               if n == name and all((k, v_) in lab for k, v_ in labels.items()))


def lm_eval_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The token ids local-completions sends for a (context, continuation) request: the
    context's, then the rest of the whole string's (its _encode_pair for causal models)."""
    assert not context.endswith(" ")  # else it moves the trailing spaces to the continuation
    context_ids = tokenizer.encode(context, add_special_tokens=False)
    whole = tokenizer.encode(context + continuation, add_special_tokens=False)
    return context_ids, whole[len(context_ids):]


@torch.inference_mode()
def reference_loglikelihood(hf, context: list[int], continuation: list[int]) -> tuple[float, bool]:
    ids = context + continuation
    logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)  # [T-1, V]
    rows = logp[len(context) - 1:]  # [C, V]: row i predicts continuation[i]
    want = torch.tensor(continuation)
    return rows.gather(1, want[:, None]).sum().item(), bool((rows.argmax(-1) == want).all())


def greedy_text(server, prompt_ids: list[int], until: list[str]) -> str:
    """Target-only greedy decoding (EOS honoured) of the task's max_gen_toks tokens, as text
    cut before the first stop string."""
    params = SamplingParams(max_tokens=GEN_KWARGS["max_gen_toks"])
    (out,) = server["reference"].generate([prompt_ids], [params])
    text = server["tokenizer"].decode(out.output_ids, skip_special_tokens=True)
    cut = min((i for i in (text.find(s) for s in until) if i >= 0), default=len(text))
    return text[:cut]


@pytest.mark.parametrize("batch_size,num_concurrent,backend",
                         [(1, 1, "huggingface"), (4, 2, "huggingface"), (4, 1, "remote")],
                         ids=["one-prompt-per-request", "batched-concurrent",
                              "server-tokenizer"])
def test_local_completions_loglikelihood_matches_the_target(server, hf, lm_eval, batch_size,
                                                            num_concurrent, backend):
    """"server-tokenizer": lm-eval tokenizes through /tokenizer_info, /tokenize and
    /detokenize instead of a local tokenizer."""
    docs = read_jsonl("choice.jsonl")
    tok = server["tokenizer"]
    before, first_post = scrape_metrics(server["url"]), len(server["app"].posts)
    results, samples = evaluate(
        lm_eval, "local-completions", CHOICE, base_url=f"{server['url']}/v1/completions",
        batch_size=batch_size, num_concurrent=num_concurrent, tokenizer_backend=backend,
        **({"tokenizer": str(TARGET)} if backend == "huggingface" else {}))
    after = wait_until_idle(server["url"], 15)

    assert [s["doc"] for s in samples] == docs
    correct, greedy_answers, sent = [], [], []
    for s, doc in zip(samples, docs, strict=True):
        assert [c for _, c in s["arguments"]] == [" " + c for c in doc["choices"]]
        got, want = [], []
        for (context, continuation), (resp,) in zip(s["arguments"], s["resps"], strict=True):
            ctx, cont = lm_eval_pair(tok, context, continuation)
            sent.append(ctx + cont)
            got.append(resp)
            want.append(reference_loglikelihood(hf, ctx, cont))
        for (ll, greedy), (ll_want, greedy_want) in zip(got, want, strict=True):
            assert math.isfinite(ll) and ll <= 0
            assert ll == pytest.approx(ll_want, abs=LL_ATOL)
            assert greedy == greedy_want
        pick = max(range(len(want)), key=lambda i: want[i][0])
        assert max(range(len(got)), key=lambda i: got[i][0]) == pick  # lm-eval's answer
        correct.append(pick == doc["answer"])
        greedy_answers.append(got[doc["answer"]][1])
        assert s["acc"] == float(pick == doc["answer"])
    assert results["acc,none"] == pytest.approx(sum(correct) / len(docs))
    assert 0 < results["acc,none"] < 1
    # the last two documents' answers are the target's greedy continuations (choice.jsonl):
    # the server's top-1 log-probability equals the token's own there, bit for bit
    assert greedy_answers[-2:] == [True, True] and not any(greedy_answers[:-2])

    # what went over the wire: batches of token-id prompts, one greedy token, the prompt echoed
    # with the top-1 log-probability at each position
    if backend == "remote":  # lm-eval counted tokens through the server's tokenizer
        assert "/tokenize" in {path for path, _ in server["app"].posts[first_post:]}
    posts = [p for p in server["app"].posts[first_post:] if p[0] == "/v1/completions"]
    assert len(posts) == math.ceil(len(sent) / batch_size)
    for path, body in posts:
        assert path == "/v1/completions" and 1 <= len(body["prompt"]) <= batch_size
        assert {k: body[k] for k in ("model", "max_tokens", "temperature", "logprobs", "echo")} \
            == {"model": MODEL, "max_tokens": 1, "temperature": 0, "logprobs": 1, "echo": True}
    assert sorted(p for _, body in posts for p in body["prompt"]) == sorted(sent)
    # every prompt ran once, and generated the one token asked for
    assert metric_sum(after, "dflash_prompt_tokens_total") - metric_sum(
        before, "dflash_prompt_tokens_total") == sum(map(len, sent))
    assert metric_sum(after, "dflash_generation_tokens_total") - metric_sum(
        before, "dflash_generation_tokens_total") == len(sent)
    assert metric_sum(after, "dflash_request_errors_total") == metric_sum(
        before, "dflash_request_errors_total")


@pytest.mark.parametrize("tokenized_requests,batch_size,num_concurrent",
                         [(True, 1, 1), (False, 1, 1), (True, 2, 2)],
                         ids=["token-ids", "text", "token-ids-batched-concurrent"])
def test_local_completions_generate_until_is_greedy(server, lm_eval, tokenized_requests,
                                                    batch_size, num_concurrent):
    docs = read_jsonl("generate.jsonl")
    tok = server["tokenizer"]
    before, first_post = scrape_metrics(server["url"]), len(server["app"].posts)
    results, samples = evaluate(
        lm_eval, "local-completions", GENERATE, base_url=f"{server['url']}/v1/completions",
        tokenizer_backend="huggingface", tokenizer=str(TARGET),
        tokenized_requests=tokenized_requests, batch_size=batch_size,
        num_concurrent=num_concurrent)
    after = wait_until_idle(server["url"], 15)

    assert [s["doc"] for s in samples] == docs
    prompts = [tok.encode(d["prompt"], add_special_tokens=False) for d in docs]
    for s, doc, ids in zip(samples, docs, prompts, strict=True):
        ((context, gen_kwargs),) = s["arguments"]
        assert context == doc["prompt"] and gen_kwargs["until"] == GEN_KWARGS["until"]
        want = greedy_text(server, ids, GEN_KWARGS["until"])
        assert s["resps"] == [[want]] and s["filtered_resps"] == [want]
    matches = [s["resps"][0][0] == d["answer"] for s, d in zip(samples, docs, strict=True)]
    assert results["exact_match,none"] == pytest.approx(sum(matches) / len(docs))

    posts = server["app"].posts[first_post:]
    assert len(posts) == math.ceil(len(docs) / batch_size)
    for path, body in posts:
        assert path == "/v1/completions" and body["model"] == MODEL
        assert (body["max_tokens"], body["temperature"]) == (GEN_KWARGS["max_gen_toks"], 0)
        # the task's stop strings, and with num_concurrent 1 the EOS text (a no-op here: the
        # EOS token ends the run first, and special tokens are not in the text)
        assert set(GEN_KWARGS["until"]) <= set(body["stop"]) <= {*GEN_KWARGS["until"],
                                                                 tok.eos_token}
    sent = [p for _, body in posts for p in
            (body["prompt"] if tokenized_requests else [body["prompt"]])]
    assert sorted(sent) == sorted(prompts if tokenized_requests else [d["prompt"] for d in docs])
    assert metric_sum(after, "dflash_requests_total", endpoint="completions") - metric_sum(
        before, "dflash_requests_total", endpoint="completions") == len(docs)
    assert metric_sum(after, "dflash_prompt_tokens_total") - metric_sum(
        before, "dflash_prompt_tokens_total") == sum(map(len, prompts))


def test_local_chat_completions_generate_until_is_greedy(server, lm_eval):
    docs = read_jsonl("generate.jsonl")
    tok = server["tokenizer"]
    before, first_post = scrape_metrics(server["url"]), len(server["app"].posts)
    results, samples = evaluate(
        lm_eval, "local-chat-completions", GENERATE,
        base_url=f"{server['url']}/v1/chat/completions", num_concurrent=1)
    after = wait_until_idle(server["url"], 15)

    assert [s["doc"] for s in samples] == docs
    prompts, chats = [], []
    for s, doc in zip(samples, docs, strict=True):
        (((chat,), _),) = s["arguments"]  # chat: the messages lm-eval posts, as JSON text
        messages = [{"role": "user", "content": doc["prompt"]}]
        assert json.loads(chat) == messages
        chats.append(messages)
        ids = list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                           return_dict=False))
        prompts.append(ids)
        # without a tokenizer lm-eval sends only the task's stop strings
        want = greedy_text(server, ids, GEN_KWARGS["until"])
        assert s["resps"] == [[want]] and s["filtered_resps"] == [want]
    matches = [s["resps"][0][0] == d["answer"] for s, d in zip(samples, docs, strict=True)]
    assert results["exact_match,none"] == pytest.approx(sum(matches) / len(docs))

    posts = server["app"].posts[first_post:]
    assert sorted(((path, body["messages"]) for path, body in posts), key=json.dumps) == sorted(
        (("/v1/chat/completions", m) for m in chats), key=json.dumps)  # one per document
    for _, body in posts:
        assert body["model"] == MODEL and body["stop"] == GEN_KWARGS["until"]
        assert (body["max_tokens"], body["temperature"]) == (GEN_KWARGS["max_gen_toks"], 0)
    assert metric_sum(after, "dflash_requests_total", endpoint="chat_completions") - metric_sum(
        before, "dflash_requests_total", endpoint="chat_completions") == len(docs)
    assert metric_sum(after, "dflash_prompt_tokens_total") - metric_sum(
        before, "dflash_prompt_tokens_total") == sum(map(len, prompts))
