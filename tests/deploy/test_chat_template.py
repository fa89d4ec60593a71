"""The chat template as the server renders it (deploy/chat_template.py): the same ids as
transformers' apply_chat_template, only the variables the template reads, no template from a
request unless the server trusts them, and renders that stop at their limits."""

from __future__ import annotations

from pathlib import Path

import pytest

from deploy.chat_template import ChatTemplate, RenderLimits
from deploy.protocol import HugeInteger, RequestError
from deploy.tokenizer import load_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"
MESSAGES = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": "héllo <b>wörld</b>"},
            {"role": "assistant", "content": "Hi."},
            {"role": "user", "content": "And now?"}]
# A Qwen-style template: enable_thinking, loop.last, a namespace, tojson, the generation tag,
# raise_exception and the special tokens as variables.
QWEN_STYLE = (
    "{%- set ns = namespace(last_user=0) %}"
    "{%- for m in messages %}{%- if m.role == 'user' %}{%- set ns.last_user = loop.index0 %}"
    "{%- endif %}{%- endfor %}"
    "{%- for m in messages %}"
    "{%- if m.role not in ['system', 'user', 'assistant'] %}"
    "{{- raise_exception('unknown role ' + m.role) }}{%- endif %}"
    "{{- '<|im_start|>' + m.role + '\\n' }}"
    "{%- if m.role == 'assistant' %}{% generation %}{{- m.content }}{% endgeneration %}"
    "{%- else %}{{- m.content }}{%- endif %}"
    "{%- if loop.index0 == ns.last_user %}{{- ' ' ~ ({'n': loop.length}|tojson) }}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and not enable_thinking %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}{%- endif %}{{- eos_token if false else '' }}")


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(str(DEMO / "target"))


LIMITS = RenderLimits(max_chars=1 << 16)


def template(tokenizer, source: str | None = None, trust: bool = False,
             limits: RenderLimits = LIMITS) -> ChatTemplate:
    if source is not None:
        tokenizer = _with_template(tokenizer, source)
    return ChatTemplate(tokenizer, limits, trust)


def _with_template(tokenizer, source: str):
    import copy

    t = copy.copy(tokenizer)
    t.chat_template = source
    return t


@pytest.mark.parametrize("source", [None, QWEN_STYLE])
@pytest.mark.parametrize("kwargs", [{}, {"enable_thinking": False}])
def test_the_ids_are_apply_chat_templates(tokenizer, source, kwargs):
    t = _with_template(tokenizer, source) if source else tokenizer
    for generation_prompt in (True, False):
        want = t.apply_chat_template(MESSAGES, add_generation_prompt=generation_prompt,
                                     tokenize=True, return_dict=False, **kwargs)
        got = template(t).ids(MESSAGES, generation_prompt, kwargs)
        assert got == list(want)
    if source and kwargs:  # the variable reached the template
        assert template(t).ids(MESSAGES, True, kwargs) != template(t).ids(MESSAGES, True)


@pytest.mark.parametrize(("kwargs", "param"), [
    ({"return_tensors": "pt"}, "chat_template_kwargs.return_tensors"),
    ({"return_tensors": "np"}, "chat_template_kwargs.return_tensors"),
    ({"padding": "max_length", "max_length": 200000}, "chat_template_kwargs.padding"),
    ({"tokenize": False}, "chat_template_kwargs.tokenize"),
    ({"add_generation_prompt": False}, "chat_template_kwargs.add_generation_prompt"),
    ({"messages": []}, "chat_template_kwargs.messages"),
    ({"eos_token": "x"}, "chat_template_kwargs.eos_token"),
    ({"something_else": 1}, "chat_template_kwargs.something_else"),
    ({"enable_thinking": [1, 2]}, "chat_template_kwargs.enable_thinking"),
    ({"enable_thinking": {"a": 1}}, "chat_template_kwargs.enable_thinking"),
    ({"enable_thinking": HugeInteger("9" * 5000)}, "chat_template_kwargs.enable_thinking"),
    ({"enable_thinking": "x" * 5000}, "chat_template_kwargs.enable_thinking"),
    ({"chat_template": "{{ 'injected' }}"}, "chat_template_kwargs.chat_template"),
])
def test_only_the_templates_own_variables_pass(tokenizer, kwargs, param):
    with pytest.raises(RequestError) as e:
        template(tokenizer).ids(MESSAGES, True, kwargs)
    assert e.value.param == param and e.value.status == 400


def test_enable_thinking_passes_everywhere_and_the_templates_variables_too(tokenizer):
    plain = template(tokenizer)  # Qwen3.5's: its inputs, not the names it sets itself
    assert plain.allowed_kwargs() == {"enable_thinking", "add_vision_id"}
    quiet = plain.render(MESSAGES, True, {"enable_thinking": False})
    assert quiet.endswith("<think>\n\n</think>\n\n")
    assert plain.render(MESSAGES, True).endswith("assistant\n<think>\n")
    custom = template(tokenizer, "{{ messages[0].content }}{{ flavour }}")
    assert custom.allowed_kwargs() == {"enable_thinking", "flavour"}
    assert custom.render(MESSAGES, True, {"flavour": "!"}) == "Be brief.!"


def test_a_requests_template_needs_the_servers_trust(tokenizer):
    with pytest.raises(RequestError) as e:
        template(tokenizer).ids(MESSAGES, True, None, "{{ 'injected' }}")
    assert e.value.param == "chat_template" and "trust-request-chat-template" in e.value.message
    trusted = template(tokenizer, trust=True)
    assert trusted.ids(MESSAGES, True, None, "injected") == tokenizer.encode(
        "injected", add_special_tokens=False)
    assert trusted.ids(MESSAGES, True, {"chat_template": "x"}) == tokenizer.encode(
        "x", add_special_tokens=False)
    with pytest.raises(RequestError) as e:
        trusted.ids(MESSAGES, True, None, "{% if %}")
    assert e.value.param == "chat_template" and "not valid Jinja" in e.value.message


@pytest.mark.parametrize("source", [
    "{% for a in range(100000) %}{% for b in range(100000) %}x{% endfor %}{% endfor %}",
    "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for a in range(100000) %}{% for b in range(100) %}"
    "{{ m.content }}{% endfor %}{% endfor %}{% endfor %}",
    "{{ 'x' * 1000000000 }}",
    "{{ [1] * 1000000000 }}",
    "{{ 'x'|center(1000000000) }}",
    "{{ 'x'|indent(1000000000, true) }}",
    "{{ '%1000000000s' % 'a' }}",
    "{{ '{:>1000000000}'.format('a') }}",
    "{{ 10 ** 100000000 }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
])
def test_a_render_stops_at_its_limits(tokenizer, source):
    limits = RenderLimits(max_chars=1 << 20, timeout_s=1.0)
    t = template(tokenizer, trust=True, limits=limits)
    with pytest.raises(RequestError) as e:  # the limit stopped it (its own error code)
        t.ids(MESSAGES, True, None, source)
    assert e.value.code == "chat_template_limit" and e.value.status == 400, e.value.message


def test_template_errors_are_400s_naming_messages(tokenizer):
    t = template(tokenizer, QWEN_STYLE)
    with pytest.raises(RequestError) as e:
        t.ids([{"role": "tool", "content": "x"}], True)
    assert e.value.param == "messages" and "unknown role tool" in e.value.message
    recursive = "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}"
    with pytest.raises(RequestError) as e:
        template(tokenizer, trust=True).ids(MESSAGES, True, None, recursive)
    assert e.value.status == 400
    with pytest.raises(RequestError) as e:  # a namespace may not reach CPython's internals
        template(tokenizer, trust=True).ids(MESSAGES, True, None,
                                            "{% set ns = namespace(__class__=1) %}")
    assert e.value.status == 400
