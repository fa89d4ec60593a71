"""Anthropic's Messages API (/v1/messages, /v1/messages/count_tokens) with the `anthropic` SDK
as the client: a message is the chat completion of the same conversation (its text, stop
reason and usage), and its stream, in Anthropic's events, reassembles in the SDK to the same
message; tool_choice any/tool returns tool_use blocks valid under the tools' schemas, the
chat's calls; with a reasoning parser the output is a thinking block; a tool_use/tool_result
conversation renders the prompt of its OpenAI equivalent; stop sequences, structured output;
errors are Anthropic's JSON naming the field.

This SDK sends no temperature (it has no such argument): greedy decoding is asked for through
extra_body."""

from __future__ import annotations

import json
import re

import anthropic
import httpx2 as httpx
import jsonschema
import pytest
from live_server import ASK, DEMO_MODEL, SEARCH, WEATHER, parsing

from deploy.chat_parsers import ChatOutputParser
from deploy.messages_api import ContentBlocks, anthropic_error, stream_error
from deploy.messages_protocol import MessagesRequest, chat_request
from deploy.protocol import RequestError

MODEL = DEMO_MODEL
GREEDY = {"temperature": 0}
TOOLS = [{"name": "get_weather", "description": "Forecast.", "input_schema": WEATHER},
         {"name": "search", "description": "Web search.", "input_schema": SEARCH}]
OPENAI_TOOLS = [{"type": "function", "function": {
    "name": t["name"], "description": t["description"], "parameters": t["input_schema"]}}
    for t in TOOLS]
NO_THINKING = {"type": "disabled"}


@pytest.fixture(scope="module")
def server(long_server):
    return long_server


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server["url"], api_key="x", max_retries=0)


def view(message) -> dict:
    """A message as both forms must agree on: all but the ids (tool_use ids are checked for
    their form, and are new per request)."""
    blocks = []
    for b in message.content:
        if b.type == "tool_use":
            assert re.fullmatch(r"toolu_[0-9a-f]{24}", b.id), b.id
            blocks.append({"type": "tool_use", "name": b.name, "input": b.input})
        elif b.type == "thinking":
            blocks.append({"type": "thinking", "thinking": b.thinking, "signature": b.signature})
        else:
            blocks.append({"type": b.type, "text": b.text})
    assert message.id.startswith("msg_") and message.type == "message"
    return {"content": blocks, "role": message.role, "model": message.model,
            "stop_reason": message.stop_reason, "stop_sequence": message.stop_sequence,
            # Anthropic's input_tokens leave out those read from the cache
            "usage": (message.usage.input_tokens + message.usage.cache_read_input_tokens,
                      message.usage.output_tokens)}


RAW_EVENTS = {"message_start": "M", "content_block_start": "(", "content_block_delta": "d",
              "content_block_stop": ")", "message_delta": "D", "message_stop": "."}


def both(claude: anthropic.Anthropic, **kw) -> dict:
    """The message, which its stream must reassemble to in the SDK's accumulator; the stream's
    events in Anthropic's order (the SDK adds events of its own: left out)."""
    kw = {"model": MODEL, "extra_body": GREEDY, **kw}
    message = view(claude.messages.create(**kw))
    with claude.messages.stream(**kw) as stream:
        order = "".join(RAW_EVENTS.get(e.type, "") for e in stream)
        assert view(stream.get_final_message()) == message
    assert re.fullmatch(r"M(\(d*\))*D\.", order), order
    assert order.count("(") == len(message["content"])
    return message


@pytest.fixture(scope="module")
def plain(oai):
    """The chat completion of ASK, greedy, 8 tokens at most."""
    return oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=8, temperature=0)


def test_a_message_is_the_chat_completion_of_the_conversation(claude, plain):
    got = both(claude, max_tokens=8, messages=ASK)
    text, finish = plain.choices[0].message.content, plain.choices[0].finish_reason
    assert got["content"] == ([{"type": "text", "text": text}] if text else [])
    assert got["stop_reason"] == {"length": "max_tokens", "stop": "end_turn"}[finish]
    assert got["usage"] == (plain.usage.prompt_tokens, plain.usage.completion_tokens)
    assert got["model"] == MODEL and got["role"] == "assistant"


def test_a_named_tool_returns_a_valid_tool_use_block(claude):
    got = both(claude, max_tokens=60, messages=ASK, tools=TOOLS, thinking=NO_THINKING,
               tool_choice={"type": "tool", "name": "get_weather"})
    (block,) = got["content"]
    assert block["type"] == "tool_use" and block["name"] == "get_weather"
    jsonschema.validate(block["input"], WEATHER)
    assert got["stop_reason"] == "tool_use"


def test_any_tool_is_a_call_of_one_of_the_tools(claude):
    # one tool without parameters: the shortest call the constraint allows
    now = {"name": "now", "description": "The time.",
           "input_schema": {"type": "object", "properties": {}}}
    m = claude.messages.create(model=MODEL, max_tokens=60, messages=ASK, tools=[now],
                               tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               thinking=NO_THINKING, extra_body=GREEDY)
    got = view(m)
    assert got["content"] == [{"type": "tool_use", "name": "now", "input": {}}]
    assert got["stop_reason"] == "tool_use"


def test_reasoning_comes_as_a_thinking_block(server, claude, plain):
    with parsing(server, reasoning_parser="qwen3"):
        # Qwen3.5's prompt opens <think>; the demo model never closes it: all thinking
        got = both(claude, max_tokens=8, messages=ASK)
    text = plain.choices[0].message.content.strip()
    assert got["content"] == [{"type": "thinking", "thinking": text, "signature": ""}]
    assert got["stop_reason"] == "max_tokens"


def test_a_conversation_with_tools_renders_as_its_openai_equivalent(server, claude):
    """System, several turns, text blocks, a tool_use with its thinking, a tool_result: the
    prompt of the OpenAI messages they stand for (/tokenize's count), counted or generated."""
    args = {"city": "Paris", "days": 3}
    messages = [*ASK, {"role": "assistant", "content": "Sunny."},
                {"role": "user", "content": [{"type": "text", "text": "And "},
                                             {"type": "text", "text": "tomorrow?"}]},
                {"role": "assistant", "content": [
                    {"type": "thinking", "thinking": "Need the forecast.", "signature": ""},
                    {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": args}]},
                {"role": "user", "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                        {"type": "text", "text": '{"temp": 21}'}]},
                    {"type": "text", "text": "Thanks. Lima?"}]}]
    chat = [{"role": "system", "content": "Be brief."}, *ASK,
            {"role": "assistant", "content": "Sunny."},
            {"role": "user", "content": "And tomorrow?"},
            {"role": "assistant", "content": "", "reasoning_content": "Need the forecast.",
             "tool_calls": [{"id": "toolu_1", "type": "function", "function": {
                 "name": "get_weather", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "toolu_1", "content": '{"temp": 21}'},
            {"role": "user", "content": "Thanks. Lima?"}]

    def tokenized(**kw) -> int:
        r = httpx.post(f"{server['url']}/tokenize", json={
            "model": MODEL, "messages": chat, "tools": OPENAI_TOOLS, **kw}, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["count"]

    want = tokenized()
    for system in ("Be brief.", [{"type": "text", "text": "Be brief."}]):
        assert claude.messages.count_tokens(model=MODEL, system=system, messages=messages,
                                            tools=TOOLS).input_tokens == want
    assert claude.messages.count_tokens(
        model=MODEL, system="Be brief.", messages=messages, tools=TOOLS,
        thinking=NO_THINKING).input_tokens == tokenized(
            chat_template_kwargs={"enable_thinking": False})
    m = claude.messages.create(model=MODEL, system="Be brief.", messages=messages, tools=TOOLS,
                               tool_choice={"type": "none"}, max_tokens=1)
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == want


def test_a_stop_sequence_ends_the_message_with_it(claude, plain):
    text = plain.choices[0].message.content
    stop = re.search(r"[ -~]{2}", text[1:]).group()  # printable: no partial character
    got = both(claude, max_tokens=8, messages=ASK, stop_sequences=["never seen", stop])
    assert got["stop_reason"] == "stop_sequence" and got["stop_sequence"] == stop
    assert got["content"] == [{"type": "text", "text": text[:text.index(stop)]}]


def test_output_config_format_constrains_the_text(claude):
    schema = {"type": "object", "required": ["city"], "additionalProperties": False,
              "properties": {"city": {"type": "string", "enum": ["Paris", "Lima"]}}}
    m = claude.messages.create(
        model=MODEL, max_tokens=30, messages=ASK, thinking=NO_THINKING, extra_body=GREEDY,
        output_config={"format": {"type": "json_schema", "schema": schema}})
    jsonschema.validate(json.loads(m.content[0].text), schema)
    assert m.stop_reason == "end_turn"


IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                     "data": "AA=="}}


@pytest.mark.parametrize(("body", "param"), [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": "16"}, "max_tokens"),
    ({"messages": [{"role": "user", "content": [IMAGE]}]}, "messages[0].content[0]"),
    ({"system": [IMAGE]}, "system[0]"),
    ({"messages": [*ASK, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "search", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t",
                                      "content": [IMAGE]}]}]},
     "messages[2].content[0].content[0]"),
    ({"tools": TOOLS, "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS}, "tool_choice"),  # auto, without the server's tool parser
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": {"type": "any"}}, "tools[1].name"),
    ({"tools": [{**TOOLS[0], "input_schema": {"type": "array"}}], "tool_choice": {
        "type": "none"}}, "tools[0].input_schema"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": "toolu_9", "content": "x"}]}]},
     "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [
        {"type": "thinking", "thinking": "x", "signature": ""}]}]}, "messages[0].content[0]"),
    ({"messages": [*ASK, {"role": "assistant", "content": "It is"}]}, "messages"),
    ({"stop_sequences": [""]}, "stop_sequences"),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens"),
    ({"mcp_servers": [{"type": "url", "url": "http://x", "name": "x"}]}, "mcp_servers"),
])
def test_errors_are_anthropics_json_naming_the_field(server, body, param):
    sent = {k: v for k, v in {"model": MODEL, "max_tokens": 4, "messages": ASK,
                              **body}.items() if v is not None}
    r = httpx.post(f"{server['url']}/v1/messages", json=sent, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()
    assert set(err) == {"type", "error"} and err["type"] == "error"
    assert err["error"]["type"] == "invalid_request_error"
    assert err["error"]["message"].startswith(param + ":"), err


def test_the_sdk_reads_the_errors(claude):
    with pytest.raises(anthropic.BadRequestError) as e:
        claude.messages.create(model=MODEL, max_tokens=4,
                               messages=[{"role": "user", "content": [IMAGE]}])
    assert "not supported" in e.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        claude.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": [IMAGE]}])
    with pytest.raises(anthropic.NotFoundError) as e:
        claude.messages.create(model="claude-x", max_tokens=4, messages=ASK)
    assert e.value.body["error"]["type"] == "not_found_error"


@pytest.mark.parametrize(("status", "kind"), [
    (400, "invalid_request_error"), (404, "not_found_error"), (413, "request_too_large"),
    (415, "invalid_request_error"), (429, "rate_limit_error"), (500, "api_error"),
    (503, "overloaded_error")])
def test_error_types_follow_the_status(status, kind):
    err = RequestError("at most 16 stop strings", "stop", None, status)
    assert anthropic_error(err) == {"type": "error", "error": {
        "type": kind, "message": "stop_sequences: at most 16 stop strings"}}
    event = stream_error(err)
    assert event.startswith("event: error\ndata: ") and event.endswith("\n\n")
    assert json.loads(event.split("data: ", 1)[1]) == anthropic_error(err)


def test_the_blocks_are_the_same_however_the_output_is_split():
    """Reasoning, text and a qwen3_coder call (which the demo model never writes) as blocks:
    the events, reassembled, are the message's content whatever the split of the text."""
    import random

    text = ("Let me check.</think>\n\nSure.\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
            "</function>\n</tool_call>")
    want = [{"type": "thinking", "thinking": "Let me check.", "signature": ""},
            {"type": "text", "text": "Sure."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
             "input": {"city": "Paris", "days": 3}}]
    for seed in range(30):
        parser = ChatOutputParser("qwen3", "qwen3_coder", OPENAI_TOOLS,
                                  "<|im_start|>assistant\n<think>\n", lambda: "call_1")
        blocks, events, rng, i = ContentBlocks(), [], random.Random(seed), 0
        while i < len(text):
            k = rng.randint(1, 12) if seed else len(text)
            for d in parser.feed(text[i:i + k]):
                events += blocks.add(d)
            i += k
        for d in parser.finish():
            events += blocks.add(d)
        events += blocks.close()
        assert blocks.content() == want
        rebuilt, inputs = [], {}
        for kind, e in events:
            if kind == "content_block_start":
                rebuilt.append(dict(e["content_block"]))
            elif kind == "content_block_delta":
                delta, block = e["delta"], rebuilt[e["index"]]
                if delta["type"] == "input_json_delta":
                    inputs[e["index"]] = inputs.get(e["index"], "") + delta["partial_json"]
                elif delta["type"] == "signature_delta":  # the SDK replaces it
                    block["signature"] = delta["signature"]
                else:  # thinking_delta, text_delta
                    field = delta["type"].removesuffix("_delta")
                    block[field] += delta[field]
        for index, partial in inputs.items():
            rebuilt[index]["input"] = json.loads(partial)
        assert rebuilt == want


def test_a_user_turn_splits_around_its_tool_results():
    req = MessagesRequest.model_validate({"max_tokens": 4, "messages": [
        *ASK, {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_1", "name": "search", "input": {"query": "x"}},
            {"type": "tool_use", "id": "toolu_2", "name": "search", "input": {"query": "y"}}]},
        {"role": "user", "content": [
            {"type": "text", "text": "Here:"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "1"},
            {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
             "content": [{"type": "text", "text": "timeout"}]},
            {"type": "text", "text": "Go on."}]}], "tools": TOOLS,
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "thinking": {"type": "enabled", "budget_tokens": 1024}})
    req.check()
    chat = chat_request(req)
    assert [(m.role, m.text(), m.tool_call_id) for m in chat.messages] == [
        ("user", ASK[0]["content"], None), ("assistant", "", None), ("user", "Here:", None),
        ("tool", "1", "toolu_1"), ("tool", "Error: timeout", "toolu_2"),
        ("user", "Go on.", None)]
    assert [json.loads(c.function.arguments) for c in chat.messages[1].tool_calls] == [
        {"query": "x"}, {"query": "y"}]
    assert chat.tool_choice == "required" and chat.parallel_tool_calls is False
    assert chat.chat_template_kwargs == {"enable_thinking": True} and chat.max_tokens == 4
