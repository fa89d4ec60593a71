"""OpenAI's Responses API (/v1/responses) with the `openai` SDK: a response is the chat
completion of the same conversation (greedy output and token counts equal the chat's), written
as output items; streamed, the typed events come in order and add up to the same response; a
forced call returns function_call items valid under the tools' schemas; with a reasoning
parser the reasoning is its own item; previous_response_id continues a stored conversation as
the equivalent chat messages render it; errors name the Responses field.

The demo model never closes its reasoning nor writes Qwen3.5's tags by itself: calls are forced
(tool_choice), with thinking off (reasoning effort "none")."""

from __future__ import annotations

import asyncio
import json

import httpx2 as httpx
import jsonschema
import openai
import pytest
from live_server import ASK, DEMO_MODEL, SCHEMAS, SEARCH, WEATHER, parsing
from openai.types.responses import Response, ResponseFailedEvent, ResponseStreamEvent
from pydantic import TypeAdapter

from deploy.protocol import RequestError
from deploy.response_store import ResponseStore
from deploy.responses_api import _Call

MODEL = DEMO_MODEL
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"model": MODEL, "temperature": 0}
TOOLS = [{"type": "function", "name": "get_weather", "description": "Forecast.",
          "parameters": WEATHER, "strict": True},
         {"type": "function", "name": "search", "description": "Web search.",
          "parameters": SEARCH}]
CHAT_TOOLS = [{"type": "function", "function": {k: t[k] for k in t if k != "type"}}
              for t in TOOLS]
NO_REASONING = {"effort": "none"}
EVENT = TypeAdapter(ResponseStreamEvent)
RANK = {"type": "object", "additionalProperties": False, "required": ["rank"],
        "properties": {"rank": {"type": "integer", "minimum": 1, "maximum": 9}}}


@pytest.fixture(scope="module")
def server(long_server):
    return long_server


def comparable(response) -> dict:
    """A response without what differs between two runs (ids, also the calls', times, and
    the prompt tokens a later run has from the prefix cache) nor what the SDK's stream helper
    adds (parsed)."""
    d = response.model_dump(mode="json")
    for key in ("id", "created_at", "completed_at"):
        d.pop(key)
    if d.get("usage"):
        d["usage"]["input_tokens_details"].pop("cached_tokens")
    d["output"] = [{k: v for k, v in item.items()
                    if k not in ("id", "call_id", "parsed_arguments")} for item in d["output"]]
    for item in d["output"]:
        for part in item.get("content") or []:
            part.pop("parsed", None)
    return d


def check_calls(response, names: set[str]) -> list[tuple[str, dict]]:
    calls = []
    for item in response.output:
        assert item.type == "function_call" and item.status == "completed"
        assert item.id.startswith("fc_") and item.call_id.startswith("call_")
        assert item.name in names
        args = json.loads(item.arguments)
        jsonschema.validate(args, SCHEMAS[item.name])
        calls.append((item.name, args))
    return calls


def test_a_text_input_is_the_chat_completion_of_it(server, oai):
    kw = dict(max_tokens=12, extra_body={"ignore_eos": True})
    chat = oai.chat.completions.create(**GREEDY, messages=ASK, **kw)
    r = oai.responses.create(**GREEDY, input=ASK[0]["content"], max_output_tokens=12,
                             extra_body={"ignore_eos": True})
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    (message,) = r.output
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert r.output_text == chat.choices[0].message.content
    # cut by max_output_tokens: incomplete, and so is its last item
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert message.status == "incomplete"
    u = r.usage
    assert (u.input_tokens, u.output_tokens, u.total_tokens) == (
        chat.usage.prompt_tokens, chat.usage.completion_tokens, chat.usage.total_tokens)
    assert u.output_tokens_details.reasoning_tokens == 0
    # stored (the default): retrieved as it was returned, until deleted
    assert oai.responses.retrieve(r.id) == r
    oai.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(r.id)
    unstored = oai.responses.create(**GREEDY, input="x", max_output_tokens=1, store=False)
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)


def test_items_and_instructions_render_as_the_chat_messages(server, oai):
    items = [{"role": "user", "content": [{"type": "input_text", "text": "Hi"}]},
             {"type": "message", "role": "assistant",
              "content": [{"type": "output_text", "text": "Hello!", "annotations": []}]},
             {"role": "user", "content": "How are you?"}]
    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                {"role": "user", "content": "How are you?"}]
    chat = oai.chat.completions.create(**GREEDY, messages=messages, max_tokens=4,
                                       extra_body={"ignore_eos": True})
    r = oai.responses.create(**GREEDY, input=items, instructions="Be brief.",
                             max_output_tokens=4, extra_body={"ignore_eos": True})
    assert r.output_text == chat.choices[0].message.content and r.instructions == "Be brief."
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    # reasoning, a call and its output, after the last user turn: one assistant message with
    # reasoning_content and tool_calls, then a tool message
    args = json.dumps({"city": "Paris", "days": 3})
    items = [*ASK, {"type": "reasoning", "summary": [],
                    "content": [{"type": "reasoning_text", "text": "Need the forecast."}]},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather",
              "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'}]
    messages = [*ASK, {"role": "assistant", "content": "", "reasoning_content":
                       "Need the forecast.", "tool_calls": [{"id": "call_1", "type": "function",
                                                             "function": {"name": "get_weather",
                                                                          "arguments": args}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    chat = oai.chat.completions.create(**GREEDY, messages=messages, tools=CHAT_TOOLS,
                                       tool_choice="none", max_tokens=1)
    r = oai.responses.create(**GREEDY, input=items, tools=TOOLS, tool_choice="none",
                             max_output_tokens=1)
    assert r.usage.input_tokens == chat.usage.prompt_tokens


def test_a_stream_is_ordered_events_adding_up_to_the_response(server, oai):
    """The SDK's stream helper builds the same response as the plain request (a constrained
    answer: it completes); raw, the events carry their type in `event:` and the data, with
    sequence numbers from 0, in OpenAI's order."""
    kw = dict(**GREEDY, input="A rank?", max_output_tokens=24,
              text={"format": {"type": "json_schema", "name": "rank", "schema": RANK,
                               "strict": True}})
    r = oai.responses.create(**kw)
    assert r.status == "completed" and r.incomplete_details is None
    jsonschema.validate(json.loads(r.output_text), RANK)
    assert r.text.format.type == "json_schema" and r.output[0].status == "completed"
    with oai.responses.stream(**kw) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert comparable(final) == comparable(r) and "".join(deltas) == r.output_text

    with httpx.stream("POST", f"{server['url']}/v1/responses", timeout=30, json={
            **GREEDY, "input": "Hi", "max_output_tokens": 8, "stream": True,
            "ignore_eos": True}) as resp:
        blocks = [b for b in resp.read().decode().split("\n\n") if b]
    events = []
    for block in blocks:
        head, data = block.split("\n")
        events.append(json.loads(data.removeprefix("data: ")))
        assert head == f"event: {events[-1]['type']}"
        EVENT.validate_python(events[-1])  # every field the SDK's types require
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    kinds = [e["type"] for e in events]
    n = kinds.count("response.output_text.delta")
    assert n >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added",
        "response.content_part.added", *["response.output_text.delta"] * n,
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.incomplete"]
    final = events[-1]["response"]
    Response.model_validate(final)
    assert events[0]["response"]["id"] == final["id"] and final["status"] == "incomplete"
    text = final["output"][0]["content"][0]["text"]
    assert "".join(e["delta"] for e in events if "delta" in e) == text == events[-4]["text"]
    assert {e["item_id"] for e in events if "item_id" in e} == {final["output"][0]["id"]}


def test_a_forced_call_returns_valid_function_calls_streamed_or_not(server, oai):
    kw = dict(**GREEDY, input=ASK, tools=TOOLS, max_output_tokens=60, reasoning=NO_REASONING,
              tool_choice={"type": "function", "name": "get_weather"})
    r = oai.responses.create(**kw)
    assert r.status == "completed" and r.tool_choice.name == "get_weather"
    (call,) = check_calls(r, {"get_weather"})
    with oai.responses.stream(**kw) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert comparable(final) == comparable(r)
    assert final.output[0].parsed_arguments == call[1]  # the SDK's, for a strict tool
    for e in events:
        EVENT.validate_python(e.to_dict())
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and kinds[-3:] == [
        "response.function_call_arguments.done", "response.output_item.done",
        "response.completed"]
    assert events[2].item.arguments == "" and events[2].item.status == "in_progress"
    assert "".join(e.delta for e in events
                   if e.type == "response.function_call_arguments.delta") == \
        r.output[0].arguments
    # required, one call at most: a call of either tool
    r = oai.responses.create(**{**kw, "tool_choice": "required", "tools": TOOLS[:1],
                                "max_output_tokens": 80}, parallel_tool_calls=False)
    assert len(check_calls(r, {"get_weather"})) == 1
    assert r.parallel_tool_calls is False


def test_the_reasoning_parser_makes_a_reasoning_item(server, oai):
    kw = dict(**GREEDY, input=ASK, max_output_tokens=16, extra_body={"ignore_eos": True})
    plain = oai.responses.create(**kw)
    with parsing(server, reasoning_parser="qwen3"):
        # Qwen3.5's prompt opens <think>; the demo model never closes it: all reasoning
        r = oai.responses.create(**kw)
        (item,) = r.output
        assert item.type == "reasoning" and item.id.startswith("rs_") and item.summary == []
        assert item.content[0].type == "reasoning_text"
        assert item.content[0].text == plain.output_text.strip()
        assert item.status == "incomplete" and r.output_text == ""
        assert r.usage.output_tokens_details.reasoning_tokens == r.usage.output_tokens == 16
        events = list(oai.responses.create(**kw, stream=True))
    for e in events:
        EVENT.validate_python(e.to_dict())
    assert events[-1].type == "response.incomplete"
    assert comparable(events[-1].response) == comparable(r)
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == \
        item.content[0].text
    assert [e.type for e in events if "done" in e.type] == [
        "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done"]


def test_previous_response_id_continues_as_the_chat_messages_render(server, oai):
    first = oai.responses.create(**GREEDY, input=ASK, tools=TOOLS, max_output_tokens=60,
                                 reasoning=NO_REASONING,
                                 tool_choice={"type": "function", "name": "get_weather"})
    (call,) = first.output
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 21}'}
    r = oai.responses.create(**GREEDY, previous_response_id=first.id, input=[result],
                             tools=TOOLS, tool_choice="none", reasoning=NO_REASONING,
                             max_output_tokens=6, extra_body={"ignore_eos": True})
    assert r.previous_response_id == first.id
    messages = [*ASK, {"role": "assistant", "content": None, "tool_calls": [{
        "id": call.call_id, "type": "function",
        "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": '{"temp": 21}'}]
    chat = oai.chat.completions.create(**GREEDY, messages=messages, tools=CHAT_TOOLS,
                                       tool_choice="none", max_tokens=6,
                                       extra_body={"ignore_eos": True, **NO_THINKING})
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content
    # the call's output needs the call: not without the stored conversation
    with pytest.raises(openai.BadRequestError) as e:
        oai.responses.create(**GREEDY, input=[result], tools=TOOLS, tool_choice="none",
                             max_output_tokens=1)
    assert e.value.body["param"] == "input[0].call_id"
    with pytest.raises(openai.NotFoundError) as e:
        oai.responses.create(**GREEDY, previous_response_id="resp_nope", input="Hi")
    assert e.value.body["param"] == "previous_response_id"
    assert e.value.body["code"] == "previous_response_not_found"


IMAGE = {"type": "input_image", "image_url": "https://example.com/a.png"}


@pytest.mark.parametrize(("body", "param"), [
    ({"input": [{"role": "user", "content": [IMAGE]}]}, "input[0].content[0]"),
    ({"input": [*ASK, {"role": "user", "content": [{"type": "input_text", "text": "a"},
                                                   IMAGE]}]}, "input[1].content[1]"),
    ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"type": "function", "description": "no name"}]}, "tools[0].name"),
    ({"tools": [TOOLS[0], TOOLS[0]], "tool_choice": "required"}, "tools[1].name"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [*ASK, {"type": "function_call", "call_id": "c", "name": "f",
                       "arguments": "[1]"}]}, "input[1].arguments"),
    ({"input": [*ASK, {"type": "function_call", "name": "f", "arguments": "{}"}]},
     "input[1].call_id"),
    ({"input": []}, "input"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
    ({"text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"truncation": "auto"}, "truncation"),
    ({"reasoning": {"effort": "extreme"}}, "reasoning.effort"),
    ({"background": True}, "background"),
])
def test_bad_requests_are_400s_naming_the_responses_field(server, body, param):
    r = httpx.post(f"{server['url']}/v1/responses",
                   json={"model": MODEL, "input": ASK, "max_output_tokens": 4, **body},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_the_store_keeps_the_most_recently_used_within_its_bounds():
    store = ResponseStore(max_responses=2, max_chars=10_000)
    for name in "abc"[:2]:
        store.put({"id": name, "output": []}, [])
    assert store.get("a") is not None  # used: "b" is now the least recently used
    store.put({"id": "c", "output": []}, [])
    assert [store.get(k) is not None for k in "abc"] == [True, False, True]
    store.put({"id": "d", "output": []}, [{"content": "x" * 20_000}])  # past max_chars alone
    assert [store.get(k) is not None for k in "acd"] == [True, True, False]
    assert store.delete("a") is True and store.get("a") is None and store.delete("a") is False


def test_an_error_once_streaming_is_a_response_failed_event(server):
    """What the server sends when generation fails after the stream started: the response,
    failed, with OpenAI's error codes and the items written so far."""
    call = _Call(server["server"], ResponseStore(), {})
    body = json.dumps({"model": MODEL, "input": "Hi", "stream": True}).encode()
    asyncio.run(call.make_job(body))
    call.output.add({"content": "Hel"})
    call.id, call.sequence_number = "resp_1", 7
    sent = call.stream_error(RequestError("engine step failed", status=500))
    head, data = sent.split("\n")[:2]
    event = ResponseFailedEvent.model_validate(json.loads(data.removeprefix("data: ")))
    assert head == "event: response.failed" and event.sequence_number == 7
    assert event.response.status == "failed" and event.response.id == "resp_1"
    assert (event.response.error.code, event.response.error.message) == (
        "server_error", "engine step failed")
    assert event.response.output[0].content[0].text == "Hel"
