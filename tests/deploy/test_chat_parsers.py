"""The chat output parsers (deploy/chat_parsers.py) on the text Qwen3.5 and Qwen3 write: each
reference output, tokenized by the tiny tokenizer and streamed in every split of its tokens (k
tokens a delta for k in 1..16, and irregular splits), gives the message the whole output gives,
and deltas that the openai SDK's own stream reassembly turns into that message. The prompt side
renders with the real Qwen3.5 template."""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk
from transformers import AutoTokenizer

from deploy.chat_parsers import ChatOutputParser
from deploy.reasoning_parser import opens_reasoning
from deploy.tool_parsers import typed_value

TINY = Path(__file__).resolve().parents[1] / "assets" / "tiny" / "target"
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
# Qwen3's (non-3.5) generation prompt: the model opens `<think>` itself
QWEN3_PROMPT = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def function(name: str, properties: dict) -> dict:
    return {"type": "function", "function": {
        "name": name, "description": f"{name} tool",
        "parameters": {"type": "object", "properties": properties}}}


TOOLS = [
    function("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"},
                             "metric": {"type": "boolean"}}),
    function("run", {"code": {"type": "string"}, "timeout": {"type": "number"},
                     "env": {"type": "object"}, "args": {"type": "array"},
                     "zip": {"type": "string"}, "verbose": {"type": "boolean"},
                     "limit": {"type": ["integer", "null"]}, "mode": {"enum": ["a", "b"]},
                     "retries": {"anyOf": [{"type": "string"}, {"type": "integer"}]}}),
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(str(TINY))


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None,
           generation: bool = True, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                         add_generation_prompt=generation, **kwargs)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, str]:
    return {"thinking": render(tokenizer, USER, TOOLS),
            "no_thinking": render(tokenizer, USER, TOOLS, enable_thinking=False),
            "qwen3": QWEN3_PROMPT}


@dataclass(frozen=True)
class Case:
    output: str
    content: str | None
    reasoning: str | None = None
    calls: tuple[tuple[str, dict], ...] = ()  # (name, arguments)
    prompt: str = "thinking"
    reasoning_parser: str | None = "qwen3"
    tool_parser: str | None = "qwen3_coder"
    tools: bool = True


def xml_call(name: str, *params: tuple[str, str]) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params)
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def hermes_call(name: str, arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


PARIS = xml_call("get_weather", ("city", "Paris"), ("days", "3"))
ROME = xml_call("get_weather", ("city", "Rome"), ("metric", "false"))
PARIS_CALL = ("get_weather", {"city": "Paris", "days": 3})
ROME_CALL = ("get_weather", {"city": "Rome", "metric": False})
CODE = 'print("a\\\\b \\"q\\"")\n\n    x = \'it\\\'s\'  # </think> <b>\n'
VALUES = xml_call(
    "run", ("code", CODE), ("timeout", "2.5"),
    ("env", '{"PATH": "/bin", "opts": {"deep": [1, 2.5, {"k": null}], "s": "a\\"b"}}'),
    ("args", '["-v", 3, true]'), ("zip", "007"), ("verbose", "true"), ("limit", "null"),
    ("mode", "b"), ("retries", "5"), ("seed", "42"), ("colour", "blue"))
VALUES_ARGS = {"code": CODE, "timeout": 2.5,
               "env": {"PATH": "/bin", "opts": {"deep": [1, 2.5, {"k": None}], "s": 'a"b'}},
               "args": ["-v", 3, True], "zip": "007", "verbose": True, "limit": None,
               "mode": "b", "retries": 5, "seed": "42", "colour": "blue"}

CASES = {
    "reasoning_alone": Case("The user asks about weather.\nI should  check \n\n", None,
                            "The user asks about weather.\nI should  check"),
    "reasoning_then_answer": Case("\nThe user greets me.\n\n</think>\n\nHello! How can I help?\n",
                                  "Hello! How can I help?\n", "The user greets me."),
    "empty_reasoning": Case("\n</think>\n\nHi.", "Hi."),
    "no_thinking_prompt": Case("Hello there. A </think> is text here.",
                               "Hello there. A </think> is text here.", prompt="no_thinking"),
    "no_reasoning_parser": Case("Thinking.\n</think>\n\nHi.", "Thinking.\n</think>\n\nHi.",
                                reasoning_parser=None, tool_parser=None),
    "qwen3_opens_think": Case("\n<think>\nHmm, a greeting.\n</think>\n\nHi <b>!", "Hi <b>!",
                              "Hmm, a greeting.", prompt="qwen3"),
    "qwen3_no_think": Case("  <thin>k < 3 <tool", "  <thin>k < 3 <tool", prompt="qwen3"),
    "tools_alone": Case(PARIS, None, calls=(PARIS_CALL,), reasoning_parser=None),
    "reasoning_then_parallel_calls": Case(
        "Two cities.\n</think>\n\nLet me check both.\n\n" + PARIS + "\n" + ROME + "\n",
        "Let me check both.", "Two cities.", (PARIS_CALL, ROME_CALL)),
    "call_ends_reasoning": Case("I need the weather.\n\n" + PARIS, None, "I need the weather.",
                                (PARIS_CALL,)),
    "values": Case("Run it.\n</think>\n\n" + VALUES, None, "Run it.", (("run", VALUES_ARGS),)),
    "value_newlines": Case(xml_call("run", ("code", "\n  two\n"), ("zip", "")), None,
                           calls=(("run", {"code": "\n  two\n", "zip": ""}),)),
    "untyped_fallbacks": Case(
        xml_call("get_weather", ("days", "three"), ("metric", "maybe")) + "\n"
        + xml_call("unknown_tool", ("days", "3")), None,
        calls=(("get_weather", {"days": "three", "metric": "maybe"}),
               ("unknown_tool", {"days": "3"}))),
    "no_parameters": Case("<tool_call>\n<function=get_weather>\n</function>\n</tool_call>", None,
                          calls=(("get_weather", {}),)),
    "content_after_calls": Case("Checking.\n\n" + PARIS + "\n\nDone, see above.",
                                "Checking.\n\nDone, see above.", calls=(PARIS_CALL,),
                                prompt="no_thinking"),
    "content_only_after_calls": Case(PARIS + "\nDone.", "Done.", calls=(PARIS_CALL,)),
    "not_a_call": Case('Use <tool_call> tags like <tool_call>{"x": 1}</tool_call> then.',
                       'Use <tool_call> tags like <tool_call>{"x": 1}</tool_call> then.',
                       prompt="no_thinking"),
    "loose_calls": Case(
        "<tool_call>\n<function= get_weather >\nnoise\n<parameter= city >\nParis\n</parameter>"
        "\nmore\n</function>\ntrailing\n\n" + ROME + "\n<tool_call>\n<function= >\n</tool_call>",
        "<tool_call>\n<function= >\n</tool_call>",
        calls=(("get_weather", {"city": "Paris"}), ROME_CALL)),
    "cut_in_value": Case(PARIS.split("\n3\n")[0] + "\n3", None,
                         calls=(("get_weather", {"city": "Paris"}),)),
    "cut_after_header": Case("<tool_call>\n<function=get_weather>\n<param", None,
                             calls=(("get_weather", {}),)),
    "cut_before_name": Case("Let me check.\n\n<tool_call>\n<function=get_wea",
                            "Let me check.\n\n<tool_call>\n<function=get_wea",
                            prompt="no_thinking"),
    "cut_before_end_tag": Case(PARIS[:-4], None, calls=(PARIS_CALL,)),
    "calls_without_tools": Case(PARIS, PARIS, reasoning_parser=None, tools=False),
    "calls_without_tool_parser": Case("Ok.\n</think>\n\n" + PARIS, PARIS, "Ok.",
                                      tool_parser=None),
    "non_ascii": Case("Grüße aus Zürich ✓\n</think>\n\n東京? " + xml_call(
        "get_weather", ("city", "Zürich, 東京")), "東京?", "Grüße aus Zürich ✓",
        (("get_weather", {"city": "Zürich, 東京"}),)),
    "hermes": Case("<think>\nOk.\n</think>\n\n" + hermes_call("get_weather", {"city": "Paris"}),
                   None, "Ok.", (("get_weather", {"city": "Paris"}),), prompt="qwen3",
                   tool_parser="hermes"),
    "hermes_parallel": Case(
        "Both.\n" + hermes_call("get_weather", {"city": "Paris", "days": 3}) + "\n"
        + hermes_call("run", {"env": {"a": [1, "x\ny"]}}) + "\n", "Both.",
        calls=(PARIS_CALL, ("run", {"env": {"a": [1, "x\ny"]}})),
        reasoning_parser=None, tool_parser="hermes"),
    "hermes_string_arguments": Case(
        '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}\n'
        '</tool_call>', None, calls=(("get_weather", {"city": "Rome"}),),
        reasoning_parser=None, tool_parser="hermes"),
    "hermes_invalid_json": Case(
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": }\n</tool_call>',
        reasoning_parser=None, tool_parser="hermes"),
    "hermes_cut": Case('<tool_call>\n{"name": "get_weather", "argu',
                       '<tool_call>\n{"name": "get_weather", "argu', reasoning_parser=None,
                       tool_parser="hermes"),
}


def new_parser(case: Case, prompts: dict[str, str]) -> ChatOutputParser:
    ids = (f"call_{i}" for i in itertools.count())
    return ChatOutputParser(case.reasoning_parser, case.tool_parser,
                            TOOLS if case.tools else None, prompts[case.prompt],
                            new_call_id=lambda: next(ids))


def stream(parser: ChatOutputParser, pieces: list[str]) -> list[dict]:
    return [d for piece in pieces for d in parser.feed(piece)] + parser.finish()


def splits(n: int) -> list[list[int]]:
    """Token boundaries: k tokens a delta for k in 1..16, then irregular deltas."""
    cuts = [[*range(0, n, k), n] for k in range(1, 17)]
    rng = random.Random(n)
    for _ in range(6):
        cut = [0]
        while cut[-1] < n:
            cut.append(min(n, cut[-1] + rng.choice((1, 1, 2, 3, 5, 8, 13, 20))))
        cuts.append(cut)
    return cuts


def check_form(delta: dict) -> None:
    """A delta is one of the four forms the server sends."""
    if "reasoning" in delta:
        assert delta == {"reasoning": delta["reasoning"], "reasoning_content": delta["reasoning"]}
        assert delta["reasoning"]
    elif "content" in delta:
        assert delta.keys() == {"content"} and delta["content"]
    else:
        [call] = delta["tool_calls"]
        if "id" in call:
            assert call.keys() == {"index", "id", "type", "function"}
            assert call["type"] == "function" and call["function"]["arguments"] == ""
            assert call["function"].keys() == {"name", "arguments"}
        else:
            assert call.keys() == {"index", "function"} and call["function"]["arguments"]
            assert call["function"].keys() == {"arguments"}


def reassembled(deltas: list[dict], finish_reason: str):
    """The message and finish reason the openai SDK builds from the stream's chunks."""
    state = ChatCompletionStreamState()
    chunks = [({"role": "assistant"}, None), *((d, None) for d in deltas), ({}, finish_reason)]
    for delta, finish in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}))
    choice = state.get_final_completion().choices[0]
    return choice.message, choice.finish_reason


def summary(message: dict) -> tuple:
    calls = tuple((c["function"]["name"], json.loads(c["function"]["arguments"]))
                  for c in message["tool_calls"])
    return message["content"], message["reasoning_content"], calls


def exact(calls) -> str:
    """JSON equality that tells 1 from 1.0 and True (Python's == does not)."""
    return json.dumps(calls, sort_keys=True)


@pytest.mark.parametrize("name", CASES)
def test_any_split_streams_the_whole_message(name, tokenizer, prompts):
    case = CASES[name]
    whole = new_parser(case, prompts)
    stream(whole, [case.output])
    message = whole.message()
    content, reasoning, calls = summary(message)
    assert (content, reasoning) == (case.content, case.reasoning)
    assert exact(calls) == exact(case.calls)
    assert message["reasoning"] == reasoning
    assert whole.tool_called == bool(case.calls)

    ids = tokenizer.encode(case.output, add_special_tokens=False)
    # the text of each prefix of the tokens; the server sends none that ends inside a character
    texts = [tokenizer.decode(ids[:b]) for b in range(len(ids) + 1)]
    assert texts[-1] == case.output
    for cut in splits(len(ids)):
        ends = [len(texts[b]) for b in cut if case.output.startswith(texts[b])]
        pieces = [case.output[a:b] for a, b in itertools.pairwise(ends)]
        parser = new_parser(case, prompts)
        deltas = stream(parser, pieces)
        assert parser.message() == message, cut
        assert parser.tool_called == whole.tool_called
        for d in deltas:
            check_form(d)
        got, finish_reason = reassembled(deltas, "tool_calls" if parser.tool_called else "stop")
        assert finish_reason == ("tool_calls" if case.calls else "stop")
        assert got.content == message["content"]
        assert getattr(got, "reasoning_content", None) == message["reasoning_content"]
        assert getattr(got, "reasoning", None) == message["reasoning"]
        assert [(c.id, c.type, c.function.name, c.function.arguments)
                for c in got.tool_calls or []] == [
            (c["id"], c["type"], c["function"]["name"], c["function"]["arguments"])
            for c in message["tool_calls"]]


@pytest.mark.parametrize("name", CASES)
def test_any_split_of_the_characters(name, prompts):
    """Tags split anywhere (one token each in the tiny vocabulary, byte tokens elsewhere)."""
    case = CASES[name]
    whole = new_parser(case, prompts)
    stream(whole, [case.output])
    rng = random.Random(name)
    n = len(case.output)
    for ends in ([*range(n + 1)], *(sorted({0, n, *rng.sample(range(n), n // 4)})
                                     for _ in range(3))):
        parser = new_parser(case, prompts)
        deltas = stream(parser, [case.output[a:b] for a, b in itertools.pairwise(ends)])
        assert parser.message() == whole.message(), ends
        for d in deltas:
            check_form(d)


def test_a_tag_spelt_in_pieces_is_held_back(prompts):
    """A tag may arrive a character at a time: nothing of it is sent as text meanwhile."""
    case = CASES["reasoning_then_parallel_calls"]
    parser = new_parser(case, prompts)
    sent = [d for ch in case.output for d in parser.feed(ch)]
    assert "".join(d.get("reasoning", "") for d in sent) == "Two cities."
    assert "".join(d.get("content", "") for d in sent) == "Let me check both."
    assert parser.finish() == []


def test_empty_output(prompts):
    for case in (Case("", "", prompt="qwen3"), Case("", "")):
        parser = new_parser(case, prompts)
        assert stream(parser, [""]) == []
        assert parser.message() == {"content": "", "reasoning_content": None, "reasoning": None,
                                    "tool_calls": []}
        assert not parser.tool_called


def test_unknown_parser_names():
    with pytest.raises(ValueError, match="reasoning_parser"):
        ChatOutputParser("deepseek_r1", None, None, "")
    with pytest.raises(ValueError, match="tool_parser"):
        ChatOutputParser(None, "mistral", TOOLS, "")


@pytest.mark.parametrize("raw,schema,value", [
    ("42", {"type": "string"}, "42"),
    ("42", {"type": "integer"}, 42),
    ("4.0", {"type": "integer"}, 4),
    ("4.5", {"type": "integer"}, "4.5"),
    ("4.5", {"type": "number"}, 4.5),
    ("NaN", {"type": "number"}, "NaN"),
    ("1e999", {"type": "number"}, "1e999"),
    ("True", {"type": "boolean"}, True),
    ("None", {"type": "null"}, None),
    ("null", {"type": ["string", "null"]}, None),
    ("42", {"type": ["string", "integer"]}, 42),
    ("abc", {"type": ["integer", "string"]}, "abc"),
    ("[1]", {"anyOf": [{"type": "object"}, {"type": "array"}]}, [1]),
    ("{bad", {"type": "object"}, "{bad"),
    (" [1, 2] ", {"type": "array"}, [1, 2]),
    ("7", {"enum": [1, 7]}, 7),
    ("7", {"const": "7"}, "7"),
    ("{}", {}, "{}"),
    ("5", None, "5"),
    ("[" * 100_000, {"type": "array"}, "[" * 100_000),
])
def test_typed_value(raw, schema, value):
    assert exact(typed_value(raw, schema)) == exact(value)


def test_the_template_decides_where_the_output_starts(tokenizer):
    thinking = render(tokenizer, USER)
    assert opens_reasoning(thinking)
    assert opens_reasoning(render(tokenizer, USER, TOOLS))
    assert not opens_reasoning(render(tokenizer, USER, enable_thinking=False))
    assert not opens_reasoning(render(tokenizer, USER, generation=False))
    # an earlier turn's closed reasoning, a user's `<think>`: only the last turn counts
    turns = [*USER, {"role": "assistant", "content": "Sunny.", "reasoning_content": "Look."},
             {"role": "user", "content": "Explain <think> tags"}]
    assert opens_reasoning(render(tokenizer, turns))
    assert not opens_reasoning(render(tokenizer, turns, enable_thinking=False))
    assert not opens_reasoning("<|im_start|>user\nExplain <think> tags<|im_end|>\n"
                               "<|im_start|>assistant\n")
    wants = {True: ("Hi.", "Hmm."), False: ("Hmm.\n</think>\n\nHi.", None)}
    for enable_thinking, want in wants.items():
        parser = ChatOutputParser("qwen3", None, None,
                                  render(tokenizer, USER, enable_thinking=enable_thinking))
        stream(parser, ["Hmm.\n</think>\n\nHi."])
        assert (parser.message()["content"], parser.message()["reasoning_content"]) == want


def test_parsed_turn_renders_back_as_written(tokenizer, prompts):
    """The parser inverts the template: the message, sent back as the assistant's turn,
    renders as the prompt followed by the output."""
    output = ("Two cities.\n</think>\n\nLet me check both.\n\n" + PARIS + "\n"
              + xml_call("run", ("env", '{"a": [1, "x"]}'), ("code", "x = 1\ny = 2")))
    parser = new_parser(Case(output, None), prompts)
    stream(parser, [output])
    m = parser.message()
    turn = {"role": "assistant", "content": m["content"],
            "reasoning_content": m["reasoning_content"],
            "tool_calls": [{**c, "function": {**c["function"], "arguments": json.loads(
                c["function"]["arguments"])}} for c in m["tool_calls"]]}
    rendered = render(tokenizer, [*USER, turn], TOOLS, generation=False)
    assert rendered == prompts["thinking"] + output + "<|im_end|>\n"
