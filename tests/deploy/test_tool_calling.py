"""Tool calls and reasoning through the OpenAI API, with the `openai` SDK: the conversation and
tools render as transformers renders them with Qwen3.5's template; a `required` or named
tool_choice returns calls valid under the tools' schemas whatever the model (the structured
output engine constrains them), streamed in OpenAI's form and reassembled by the SDK to the
same message; with a reasoning parser the reasoning comes apart from the answer, and a forced
call starts after it; bad tools and tool messages are 400s naming the field.

The demo model never writes Qwen3.5's tags by itself, so what the parsers make of the text
the model really emits is tested on reference outputs (tests/deploy/test_chat_parsers.py);
here, the server's plumbing around them."""

from __future__ import annotations

import json

import httpx2 as httpx
import jsonschema
import openai
import pytest
from live_server import ASK, DEMO_MODEL, SCHEMAS, SEARCH, WEATHER, parsing
from openai.lib.streaming.chat import ChatCompletionStreamState

MODEL = DEMO_MODEL
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Forecast.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "search", "description": "Web search.",
                                           "parameters": SEARCH}}]
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
THINK_END = 323  # </think> in the demo tokenizer (</tool_call> is 321)


@pytest.fixture(scope="module")
def server(long_server):
    return long_server


def streamed(oai: openai.OpenAI, **kw):
    """A streamed chat as the SDK reassembles it, and its chunks."""
    state, chunks = ChatCompletionStreamState(), []
    for chunk in oai.chat.completions.create(stream=True, **kw):
        chunks.append(chunk)
        state.handle_chunk(chunk)
    return state.get_final_completion(), chunks


def check_calls(message, names: set[str]) -> list[tuple[str, dict]]:
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls]
    for c in message.tool_calls:
        assert c.id.startswith("call_") and c.type == "function"
    for name, args in calls:
        assert name in names
        jsonschema.validate(args, SCHEMAS[name])
    assert len({c.id for c in message.tool_calls}) == len(calls)
    return calls


def test_a_named_function_returns_a_valid_call_streamed_or_not(oai):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
              tool_choice={"type": "function", "function": {"name": "get_weather"}},
              extra_body=NO_THINKING)
    r = oai.chat.completions.create(**kw)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = check_calls(choice.message, {"get_weather"})
    final, chunks = streamed(oai, **kw)
    assert final.choices[0].finish_reason == "tool_calls"
    assert check_calls(final.choices[0].message, {"get_weather"}) == [call]
    # OpenAI's form: the header (index, id, name, empty arguments) first, then fragments
    first = next(c for c in chunks if c.choices and c.choices[0].delta.tool_calls)
    head = first.choices[0].delta.tool_calls[0]
    assert head.index == 0 and head.id and head.function.name == "get_weather"
    assert head.function.arguments == ""
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 2


@pytest.mark.parametrize("parallel", [False, True])
def test_required_returns_valid_calls_of_the_tools(oai, parallel):
    kw = dict(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=120,
              temperature=0, parallel_tool_calls=parallel, extra_body=NO_THINKING)
    r = oai.chat.completions.create(**kw)
    message = r.choices[0].message
    calls = check_calls(message, {"get_weather", "search"})
    assert r.choices[0].finish_reason == "tool_calls" and calls
    if not parallel:
        assert len(calls) == 1
    final, _ = streamed(oai, **kw)
    assert check_calls(final.choices[0].message, {"get_weather", "search"}) == calls


def test_reasoning_comes_apart_and_a_forced_call_starts_after_it(server, oai):
    plain = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
    with parsing(server, reasoning_parser="qwen3"):
        # Qwen3.5's prompt opens <think>; the demo model never closes it: all reasoning
        r = oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=24,
                                        temperature=0, extra_body={"ignore_eos": True})
        m = r.choices[0].message
        assert m.content is None
        assert m.model_extra["reasoning_content"] == plain.choices[0].message.content.strip()
        assert m.model_extra["reasoning"] == m.model_extra["reasoning_content"]
        chunks = list(oai.chat.completions.create(
            model=MODEL, messages=ASK, max_tokens=24, temperature=0, stream=True,
            extra_body={"ignore_eos": True}))  # (the SDK's reassembly refuses a cut one)
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas) == \
            m.model_extra["reasoning_content"] and not any(d.content for d in deltas)
        # </think> made likely ends the reasoning at once; the call's constraint starts
        # after it (from the first token, </think> would be illegal and the JSON would land
        # in the reasoning)
        r = oai.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0,
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            logit_bias={str(THINK_END): 40})
        m = r.choices[0].message
        assert not m.model_extra.get("reasoning_content")
        check_calls(m, {"get_weather"})
        # with thinking off the template closes the block: the constraint starts at once
        r = oai.chat.completions.create(
            model=MODEL, messages=ASK, tools=TOOLS, max_tokens=120, temperature=0,
            tool_choice="required", extra_body=NO_THINKING)
        check_calls(r.choices[0].message, {"get_weather", "search"})


def test_auto_tool_choice_needs_the_servers_parser(server, oai):
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=4)
    assert e.value.body["param"] == "tool_choice" and "--enable-auto-tool-choice" in \
        e.value.body["message"]
    with parsing(server, enable_auto_tool_choice=True, tool_call_parser="qwen3_coder"):
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=8,
                                        temperature=0, extra_body={"ignore_eos": True})
        assert r.choices[0].finish_reason == "length" and r.choices[0].message.content
        # parallel_tool_calls false: generation stops where the first call ends (here at
        # once: </tool_call> made likely)
        ends = {"logit_bias": {str(THINK_END - 2): 50}, "max_tokens": 8, "temperature": 0}
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS,
                                        parallel_tool_calls=False, **ends)
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens == 1
        r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, **ends)
        assert r.choices[0].finish_reason == "length"
    # tool_choice none: the tools are in the prompt, nothing is parsed
    r = oai.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, tool_choice="none",
                                    max_tokens=4, temperature=0)
    assert r.choices[0].message.tool_calls is None


def test_a_two_turn_tool_conversation_renders_as_transformers_does(server):
    """The assistant's call (arguments as OpenAI's JSON text), the tool's result and the
    reasoning sent back render as transformers renders them with the arguments as objects."""
    args = {"city": "Paris", "days": 3}
    sent = [{"role": "system", "content": "Be brief."}, *ASK,
            {"role": "assistant", "content": "", "reasoning_content": "Need the forecast.",
             "tool_calls": [{"id": "call_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
            {"role": "user", "content": "And tomorrow?"}]
    r = httpx.post(f"{server['url']}/tokenize", json={"model": MODEL, "messages": sent,
                                                       "tools": TOOLS}, timeout=30)
    assert r.status_code == 200, r.text
    want_messages = json.loads(json.dumps(sent))
    want_messages[2]["tool_calls"][0]["function"]["arguments"] = args
    tok = server["tokenizer"]
    want = tok.apply_chat_template(want_messages, tools=TOOLS, add_generation_prompt=True,
                                   tokenize=True, return_dict=False)
    assert r.json()["tokens"] == list(want)
    text = tok.decode(r.json()["tokens"])
    assert "<function=get_weather>\n<parameter=city>\nParis\n</parameter>" in text
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>" in text
    assert '"name": "search"' in text  # the tools, in the system turn


@pytest.mark.parametrize(("body", "param"), [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "retrieval"}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]},
     "tools.0.function.name"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools[1].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}], "tool_choice": "none"},
     "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
        "type": "array"}}}], "tool_choice": "none"}, "tools[0].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required",
      "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_9", "content": "x"}]},
     "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
    ({"messages": [*ASK, {"role": "assistant", "tool_calls": [{
        "id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tools_and_tool_messages_are_400s_naming_the_field(server, body, param):
    r = httpx.post(f"{server['url']}/v1/chat/completions",
                   json={"model": MODEL, "messages": ASK, "max_tokens": 4, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


@pytest.mark.parametrize("named", [None, "get_weather"])
def test_a_forced_calls_json_parses_the_same_however_it_is_split(named):
    """The constraint's JSON (a named function's arguments, or required's array of calls)
    read in pieces of any size gives the same calls, and the deltas reassemble to them."""
    import random

    from deploy.chat_parsers import ChatOutputParser
    from deploy.tool_calls import ForcedCallParser

    args = [{"city": "Pa}\"ris[", "days": [3, {"a": "]"}]}, {"query": "x, y"}]
    if named:
        text, want = json.dumps(args[0]), [("get_weather", args[0])]
    else:
        calls = [{"name": "get_weather", "parameters": args[0]},
                 {"name": "search", "parameters": args[1]}]
        text, want = json.dumps(calls), [(c["name"], c["parameters"]) for c in calls]
    prompt = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    for seed in range(40):
        ids = (f"call_{k}" for k in range(100))
        p = ForcedCallParser(ChatOutputParser("qwen3", None, None, prompt), named,
                             ids.__next__)
        rng, deltas, i = random.Random(seed), [], 0
        while i < len(text):
            k = rng.randint(1, 16) if seed else len(text)
            deltas += p.feed(text[i:i + k])
            i += k
        deltas += p.finish()
        m = p.message()
        assert [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                for c in m["tool_calls"]] == want and m["content"] is None and p.tool_called
        rebuilt: dict[int, dict] = {}
        for d in deltas:
            (call,) = d["tool_calls"]
            entry = rebuilt.setdefault(call["index"], {"name": None, "arguments": ""})
            if "id" in call:  # the header: first, once, with an empty arguments string
                assert entry["name"] is None and call["function"]["arguments"] == ""
                entry["name"] = call["function"]["name"]
            entry["arguments"] += call["function"]["arguments"]
        assert [(e["name"], json.loads(e["arguments"])) for e in rebuilt.values()] == want
