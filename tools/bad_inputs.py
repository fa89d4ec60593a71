"""Bad input against a running server: every request in the catalogue must come back as a 4xx
with OpenAI's error JSON, never a 5xx, and the server must still serve afterwards.

    python -m tools.bad_inputs --base-url http://127.0.0.1:8000 [--out result.json]

Exits 1 if any answer is not a 4xx with an error body, or if a good request fails after them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import httpx2 as httpx

JSON = {"content-type": "application/json"}


def catalogue(model: str) -> list[tuple[str, str, bytes] | tuple[str, str, bytes, dict]]:
    """(name, path, raw body[, headers]): the body as bytes, so malformed JSON can be sent
    too; headers beside the JSON content type."""
    def body(obj: object) -> bytes:
        return json.dumps(obj).encode()

    comp, chat = "/v1/completions", "/v1/chat/completions"
    m = model.encode()
    cases = [
        ("not JSON", comp, b'{"model": '),
        ("JSON array", comp, b"[1, 2]"),
        ("nested 100,000 deep", comp, b'{"a": ' * 100_000 + b"1" + b"}" * 100_000),
        ("array nested 100,000 deep", comp, b"[" * 100_000 + b"]" * 100_000),
        ("lone surrogate, completions", comp,
         b'{"model": "%s", "prompt": "a\\ud800b"}' % m),
        ("lone surrogate, chat", chat,
         b'{"model": "%s", "messages": [{"role": "user", "content": "a\\udfffb"}]}' % m),
        ("invalid UTF-8", comp, b'{"model": "%s", "prompt": "\xff\xfe"}' % m),
        ("20 MB body", comp, b'{"model": "%s", "prompt": "' % m + b"a" * 20_000_000 + b'"}'),
    ]
    fields = [
        ("max_tokens as a string", {"max_tokens": "16"}),
        ("max_tokens true", {"max_tokens": True}),
        ("max_tokens 0", {"max_tokens": 0}),
        ("max_tokens -3", {"max_tokens": -3}),
        ("max_tokens beyond the context", {"max_tokens": 10**9}),
        ("stream as a string", {"stream": "yes"}),
        ("temperature negative", {"temperature": -1}),
        ("temperature a string", {"temperature": "hot"}),
        ("top_p 0", {"top_p": 0}),
        ("top_k -5", {"top_k": -5}),
        ("seed out of range", {"seed": 2**64}),
        ("n 0", {"n": 0}),
        ("logprobs 21", {"logprobs": 21}),
        ("seventeen stop strings", {"stop": list("abcdefghijklmnopq")}),
        ("an empty stop string", {"stop": [""]}),
        ("guided_json a schema of an unknown type", {"guided_json": {"type": "nonsense"}}),
        ("structured_outputs a regex that does not parse", {"structured_outputs": {"regex": "(a"}}),
        ("structured_outputs two constraints", {"structured_outputs": {"regex": "a",
                                                                       "choice": ["a"]}}),
        ("guided_grammar an undefined rule", {"guided_grammar": "root ::= foo"}),
        ("logit_bias a token outside the vocabulary", {"logit_bias": {"1000000000": 1}}),
        ("logit_bias a key that is no token id", {"logit_bias": {"x": 1}}),
        ("allowed_token_ids outside the vocabulary", {"allowed_token_ids": [10**9]}),
        ("repetition_penalty 0", {"repetition_penalty": 0}),
        ("presence_penalty 3", {"presence_penalty": 3}),
        ("min_p 2", {"min_p": 2}),
        ("min_tokens above max_tokens", {"min_tokens": 50, "max_tokens": 5}),
        ("stream_options without stream", {"stream_options": {"include_usage": True}}),
        ("unknown model", {"model": "gpt-4"}),
    ]
    for name, extra in fields:
        cases.append((name, comp, body({"model": model, "prompt": "hi"} | extra)))
    prompts = [
        ("empty prompt", ""),
        ("token id out of the vocabulary", [10**9]),
        ("token ids as floats", [1.5, 2]),
        ("two prompts, one empty", ["a", ""]),
        ("prompt beyond the context", [5] * 10**6),
    ]
    for name, prompt in prompts:
        cases.append((name, comp, body({"model": model, "prompt": prompt})))
    messages = [
        ("no messages", []),
        ("a message without role", [{"content": "x"}]),
        ("role wizard", [{"role": "wizard", "content": "x"}]),
        ("content a number", [{"role": "user", "content": 5}]),
        ("an image part", [{"role": "user", "content": [{"type": "image_url",
                                                          "image_url": {"url": "x"}}]}]),
    ]
    for name, msgs in messages:
        cases.append((name, chat, body({"model": model, "messages": msgs})))
    cases.append(("chat_template_kwargs not an object", chat, body({
        "model": model, "messages": [{"role": "user", "content": "x"}],
        "chat_template_kwargs": "enable_thinking=false"})))
    cases.append(("response_format json_schema without its schema", chat, body({
        "model": model, "messages": [{"role": "user", "content": "x"}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "o"}}})))
    cases.append(("response_format a schema that does not compile, on completions", comp, body({
        "model": model, "prompt": "x", "response_format": {
            "type": "json_schema", "json_schema": {"name": "o", "schema": {
                "type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}})))
    user = [{"role": "user", "content": "x"}]
    template_kwargs = [  # the chat template's inputs are an allow-list
        ("chat_template_kwargs return_tensors pt", {"return_tensors": "pt"}),
        ("chat_template_kwargs return_tensors np", {"return_tensors": "np"}),
        ("chat_template_kwargs replacing the template", {"chat_template": "{{ 'x' }}"}),
        ("chat_template_kwargs tokenizer padding", {"padding": "max_length",
                                                    "max_length": 200_000}),
        ("chat_template_kwargs a list value", {"enable_thinking": [1]}),
    ]
    for name, kwargs in template_kwargs:
        cases.append((name, chat, body({"model": model, "messages": user,
                                        "chat_template_kwargs": kwargs})))
        cases.append((name + ", /tokenize", "/tokenize", body({
            "model": model, "messages": user, "chat_template_kwargs": kwargs})))
    cases += [
        ("a request's own chat template", chat, body({
            "model": model, "messages": user,
            "chat_template": "{% for a in range(99999) %}{% for b in range(99999) %}x"
                             "{% endfor %}{% endfor %}"})),
        ("temperature NaN", comp, b'{"model": "%s", "prompt": "hi", "temperature": NaN}' % m),
        ("top_p Infinity", comp, b'{"model": "%s", "prompt": "hi", "top_p": Infinity}' % m),
        ("temperature 1e400", comp, b'{"model": "%s", "prompt": "hi", "temperature": 1e400}' % m),
        ("a 5,000-digit max_tokens", comp,
         b'{"model": "%s", "prompt": "hi", "max_tokens": %s}' % (m, b"9" * 5000)),
        ("a 5,000-digit template variable", chat,
         b'{"model": "%s", "messages": [{"role": "user", "content": "x"}], '
         b'"chat_template_kwargs": {"enable_thinking": %s}}' % (m, b"9" * 5000)),
        ("seed 2^63-1 with n 2", comp, body({"model": model, "prompt": "hi",
                                             "seed": 2**63 - 1, "n": 2})),
        ("a response of 256 choices x 20 alternatives x the context", comp, body({
            "model": model, "prompt": "hi", "n": 256, "logprobs": 20, "max_tokens": None})),
        ("/detokenize of 3 M ids", "/detokenize",
         b'{"model": "%s", "tokens": [' % m + b"1," * 2_999_999 + b"1]}"),
        ("a gzip body", comp, gzip.compress(body({"model": model, "prompt": "hi"})),
         {"content-encoding": "gzip"}),
    ]
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "string"}}}}}
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{"}}]
    for name, extra in [
        ("tool_choice naming no tool", {"tools": [tool], "tool_choice": {
            "type": "function", "function": {"name": "g"}}}),
        ("tool_choice required without tools", {"tool_choice": "required"}),
        ("a tool whose schema does not compile", {"tool_choice": "required", "tools": [
            {"type": "function", "function": {"name": "f", "parameters": {
                "type": "object", "properties": {"a": {"type": "nonsense"}}}}}]}),
        ("a tool name with a newline", {"tools": [{"type": "function", "function": {
            "name": "f>\n<x"}}], "tool_choice": "none"}),
        ("a tool message answering no call", {"messages": [
            *user, {"role": "tool", "tool_call_id": "nope", "content": "x"}]}),
        ("tool call arguments that are not JSON", {"messages": [
            *user, {"role": "assistant", "tool_calls": calls}]}),
        ("20,000 tools", {"tools": [{"type": "function", "function": {"name": f"f{i}"}}
                                    for i in range(20_000)], "tool_choice": "none"}),
    ]:
        cases.append((name, chat, body({"model": model, "messages": user, "max_tokens": 4,
                                        **extra})))
    msgs, resp = "/v1/messages", "/v1/responses"
    image = {"type": "image", "source": {"type": "url", "url": "http://x/y.png"}}
    cases += [
        ("messages without max_tokens", msgs, body({"model": model, "messages": user})),
        ("messages with an image block", msgs, body({
            "model": model, "max_tokens": 4,
            "messages": [{"role": "user", "content": [image]}]})),
        ("a tool_result answering no tool_use", msgs, body({
            "model": model, "max_tokens": 4, "messages": [{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]})),
        ("count_tokens of no JSON", msgs + "/count_tokens", b"{"),
        ("responses after an unknown response", resp, body({
            "model": model, "input": "hi", "previous_response_id": "resp_nope"})),
        ("responses with an image", resp, body({"model": model, "input": [{
            "role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]})),
        ("responses with truncation auto", resp, body({"model": model, "input": "hi",
                                                       "truncation": "auto"})),
    ]
    return cases


def run(base_url: str, timeout: float = 60.0) -> dict:
    with httpx.Client(timeout=timeout) as client:
        model = client.get(f"{base_url}/v1/models").json()["data"][0]["id"]
        results = []
        for name, path, raw, *headers in catalogue(model):
            r = client.post(base_url + path, content=raw, headers=JSON | dict(*headers))
            try:
                err = r.json().get("error") or {}
            except ValueError:
                err = {}
            ok = 400 <= r.status_code < 500 and bool(err.get("message")) and "type" in err
            results.append({"name": name, "status": r.status_code, "code": err.get("code"),
                            "param": err.get("param"), "ok": ok})
        good = client.post(f"{base_url}/v1/completions", headers=JSON, content=json.dumps(
            {"model": model, "prompt": "still serving", "max_tokens": 2}).encode())
    return {"tried": len(results), "answered_4xx": sum(r["ok"] for r in results),
            "answered_5xx": sum(r["status"] >= 500 for r in results),
            "serving_after": good.status_code == 200, "results": results}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--out")
    args = p.parse_args(argv)
    report = run(args.base_url)
    for r in report["results"]:
        mark = "ok " if r["ok"] else "BAD"
        print(f"{mark} {r['status']} {r['code'] or '-':28s} {r['name']}")
    print(f"{report['answered_4xx']}/{report['tried']} answered 4xx with an OpenAI error, "
          f"{report['answered_5xx']} 5xx; serving afterwards: {report['serving_after']}")
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0 if report["answered_4xx"] == report["tried"] and report["serving_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
