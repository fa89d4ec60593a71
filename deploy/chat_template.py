"""Chat templates as the server renders them: the server's template (the tokenizer's, or
--chat-template) with the variables a request may set, rendered within bounds.

What a request may pass (`chat_template_kwargs`) is an allow-list: the variables the template
itself reads (`enable_thinking` for Qwen3.5), plus `enable_thinking` everywhere so that clients
written for Qwen3.5 work against any model; values are JSON scalars. Everything else is a 400
naming the key: the tokenizer's own arguments (`return_tensors`, `padding`, `max_length`, …)
never reach it, and the template itself comes from the server's configuration unless the server
was started with `trust_request_chat_template` (vLLM's --trust-request-chat-template).

Rendering is bounded: the text it writes (RenderLimits.max_chars) and the time it takes
(RenderLimits.timeout_s), checked as it goes: at every piece of output, call, attribute or item
lookup, range step, and before a `*`, `**` or `%` that would build a value past the size limit.
A template is still code the server runs: the bounds stop runaway renders of the server's
template on large inputs, and make a trusted client's template fail rather than stall the
replica; they do not make a hostile template harmless (hence the opt-in).

The environment matches transformers' `apply_chat_template` (sandboxed Jinja with trim_blocks,
lstrip_blocks, loop controls, the `generation` tag, `tojson`, `raise_exception`,
`strftime_now`, `dict`, `namespace`; the tokenizer's special tokens as variables), and the ids
are the rendered text encoded without added special tokens, as there: the same ids
(tests/deploy/test_chat_template.py)."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache, wraps
from typing import Any

import jinja2
import jinja2.ext
import jinja2.meta
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment, safe_range

from deploy.protocol import HugeInteger, RequestError

# Variables the server sets itself, and the tokenizer arguments apply_chat_template would take:
# a request may set none of them.
RESERVED = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt",
    "continue_final_message", "chat_template", "tokenize", "return_dict", "return_tensors",
    "padding", "truncation", "max_length", "tokenizer_kwargs", "return_assistant_tokens_mask",
    "sanitize_control_tokens", "raise_exception", "strftime_now", "dict", "namespace", "range",
})
ALWAYS_ALLOWED = frozenset({"enable_thinking"})
MAX_KWARG_CHARS = 4096  # a string value of chat_template_kwargs


@dataclass(frozen=True)
class RenderLimits:
    max_chars: int  # of the rendered text (and of any value built on the way)
    timeout_s: float = 10.0


class RenderLimitExceeded(Exception):
    pass


class _Budget(threading.local):
    deadline: float = float("inf")
    max_chars: int = 1 << 62

    @contextmanager
    def limited(self, limits: RenderLimits) -> Iterator[None]:
        self.deadline = time.monotonic() + limits.timeout_s
        self.max_chars = limits.max_chars
        try:
            yield
        finally:
            self.deadline, self.max_chars = float("inf"), 1 << 62

    def tick(self) -> None:
        if time.monotonic() > self.deadline:
            raise RenderLimitExceeded("rendering took too long")

    def size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise RenderLimitExceeded(f"{what} of {n} characters is past the limit")


_WIDTH = re.compile(r"\d+")


class _BoundedRange:
    """The sandbox's `range` whose iteration checks the time at every step."""

    def __init__(self, budget: _Budget, *args: int):
        self.budget, self.r = budget, safe_range(*args)

    def _checked(self, items: Iterator[int]) -> Iterator[int]:
        for i in items:
            self.budget.tick()
            yield i

    def __iter__(self) -> Iterator[int]:
        return self._checked(iter(self.r))

    def __reversed__(self) -> Iterator[int]:
        return self._checked(reversed(self.r))

    def __len__(self) -> int:
        return len(self.r)

    def __getitem__(self, i):
        return self.r[i]

    def __contains__(self, x) -> bool:
        return x in self.r


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """transformers' chat-template environment, with the render's budget checked as it goes."""

    intercepted_binops = frozenset({"*", "**", "%"})

    def __init__(self) -> None:
        super().__init__(trim_blocks=True, lstrip_blocks=True,
                         extensions=[_GenerationTag, jinja2.ext.loopcontrols])
        self.budget = _Budget()
        self.filters = {name: self._guard_filter(f) for name, f in self.filters.items()}
        self.filters["tojson"] = self._guard_filter(_tojson)
        self.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now,
                            dict=_TemplateDict(), namespace=_namespace_class(self.budget),
                            range=lambda *args: _BoundedRange(self.budget, *args))

    def _guard_filter(self, f):
        @wraps(f)  # keeps jinja's pass_context / pass_environment marks
        def guarded(*args, **kwargs):
            self._check_args(args, kwargs)
            out = f(*args, **kwargs)
            if isinstance(out, str):
                self.budget.size(len(out), "a filter's result")
            return out
        return guarded

    def _check_args(self, args: tuple, kwargs: dict) -> None:
        self.budget.tick()
        for a in (*args, *kwargs.values()):
            if type(a) is int and a > self.budget.max_chars:
                self.budget.size(a, "an argument")

    def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 (jinja's signature)
        __self._check_args(args, kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):  # a string's .format / .format_map, as looked up
        if isinstance(getattr(value, "__self__", None), str):
            self._check_format(value.__self__)
        return super().wrap_str_format(value)

    def getattr(self, obj, attribute):
        self.budget.tick()
        return super().getattr(obj, attribute)

    def getitem(self, obj, argument):
        self.budget.tick()
        return super().getitem(obj, argument)

    def call_binop(self, context, operator: str, left, right):
        self.budget.tick()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int):
                    self.budget.size(len(seq) * n, "a repeated value")
        elif operator == "**" and isinstance(left, int) and isinstance(right, int):
            if abs(left) > 1 and right * max(abs(left).bit_length(), 1) > 8 * self.budget.max_chars:
                raise RenderLimitExceeded("a power past the limit")
        elif operator == "%" and isinstance(left, str):
            self._check_format(left)
        return super().call_binop(context, operator, left, right)

    def _check_format(self, fmt: str) -> None:
        """A format string's widths and precisions may not build a value past the limit."""
        for m in _WIDTH.finditer(fmt):
            self.budget.size(int(m.group()), "a format width")


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}…{% endgeneration %}`: transformers marks assistant text with it; when
    rendering a prompt it writes its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller) -> str:
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _TemplateDict:
    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs) -> dict:
        return dict.fromkeys(*args, **kwargs)


def _namespace_class(budget: _Budget) -> type:
    class TemplateNamespace(jinja2.utils.Namespace):
        """jinja's namespace without underscore-prefixed names (no way to CPython internals),
        its values within the render's size limit (a namespace is a template's only
        accumulator across loop iterations)."""

        def __init__(*args, **kwargs):  # noqa: N805 (jinja's Namespace signature)
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name, value in attrs.items():
                TemplateNamespace._check(name, value)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name, value) -> None:
            TemplateNamespace._check(name, value)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name, value) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"a chat template may not set underscore-prefixed names, got {name!r}")
            if isinstance(value, (str, list, tuple, dict)):
                budget.size(len(value), "a namespace value")

    return TemplateNamespace


@lru_cache(maxsize=32)
def _compiled(source: str, limits: RenderLimits
              ) -> tuple[BoundedEnvironment, jinja2.Template, frozenset[str]]:
    """The template in its own environment (which holds its renders' budgets, one per thread)
    and the variables it reads. Compiled within the limits: compiling evaluates constant
    expressions."""
    env = BoundedEnvironment()
    with env.budget.limited(limits):
        tree = env.parse(source)
        # what it reads before it sets, less what it sets itself somewhere (jinja counts a
        # name set inside a block and read outside it as read): the template's inputs
        assigned = {n.name for n in tree.find_all(jinja2.nodes.Name) if n.ctx == "store"}
        variables = frozenset(jinja2.meta.find_undeclared_variables(tree) - assigned)
        return env, env.from_string(source), variables


class ChatTemplate:
    """The server's chat template for `tokenizer`: `ids(messages, …)` renders and tokenizes a
    conversation; `template` replaces the server's only where `trust_request_template`."""

    def __init__(self, tokenizer, limits: RenderLimits, trust_request_template: bool = False):
        self.tokenizer, self.limits = tokenizer, limits
        self.trust_request_template = trust_request_template
        self.source: str | None = getattr(tokenizer, "chat_template", None)
        if self.source is not None:
            _compiled(self.source, limits)  # a broken template fails at start-up

    def allowed_kwargs(self, source: str | None = None) -> frozenset[str]:
        _, _, variables = _compiled(source or self.source, self.limits)
        return (variables | ALWAYS_ALLOWED) - RESERVED - self._special_tokens().keys()

    def check_request(self, kwargs: dict[str, Any] | None, template: str | None,
                      param: str = "chat_template_kwargs") -> str:
        """The template this request renders with; RequestError (400) for a key of kwargs that
        is not allowed, a value that is not a JSON scalar, or a template the server does not
        take from requests."""
        kwargs = dict(kwargs or {})
        param_t = "chat_template"
        if "chat_template" in kwargs:
            if template is not None:
                raise RequestError("give the chat template once: chat_template or "
                                   "chat_template_kwargs.chat_template", "chat_template")
            template, param_t = kwargs.pop("chat_template"), f"{param}.chat_template"
        if template is not None:
            if not self.trust_request_template:
                raise RequestError("this server renders its own chat template only (start it "
                                   "with --trust-request-chat-template to take one from "
                                   "requests)", param_t)
            if not isinstance(template, str):
                raise RequestError("the chat template must be a string", param_t)
            with self._errors(param_t, "is not valid Jinja"):
                _compiled(template, self.limits)
        source = template if template is not None else self.source
        if source is None:
            raise RequestError("this model's tokenizer has no chat template; send a prompt to "
                               "/v1/completions", "messages")
        allowed = self.allowed_kwargs(source)
        for key, value in kwargs.items():
            where = f"{param}.{key}"
            if key not in allowed:
                raise RequestError(
                    f"{key!r} is not a variable of this server's chat template; allowed: "
                    f"{sorted(allowed) or 'none'}", where)
            if isinstance(value, HugeInteger):
                raise RequestError(f"{key}: {value!r} is out of range", where)
            if value is not None and type(value) not in (bool, int, float, str):
                raise RequestError(f"{key} must be a JSON scalar (boolean, number, string or "
                                   f"null), got {type(value).__name__}", where)
            if isinstance(value, str) and len(value) > MAX_KWARG_CHARS:
                raise RequestError(f"{key} is longer than {MAX_KWARG_CHARS} characters", where)
        return source

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
               kwargs: dict[str, Any] | None = None, source: str | None = None,
               tools: list[dict[str, Any]] | None = None) -> str:
        """The conversation as text (kwargs already checked by `check_request`). Raises
        RequestError when the template fails or passes its limits."""
        env, template, _ = _compiled(source or self.source, self.limits)
        variables = {**self._special_tokens(), **(kwargs or {})}
        parts, size = [], 0
        with self._errors("messages", "rejected the messages"), env.budget.limited(self.limits):
            for part in template.generate(messages=messages, tools=tools, documents=None,
                                          add_generation_prompt=add_generation_prompt,
                                          **variables):
                size += len(part)
                env.budget.size(size, "the rendered conversation")
                env.budget.tick()
                parts.append(part)
        return "".join(parts)

    @contextmanager
    def _errors(self, param: str, failed: str) -> Iterator[None]:
        """What a template raises, as the request's 400."""
        try:
            yield
        except RenderLimitExceeded as e:
            raise RequestError(
                f"the chat template stopped: {e} (at most {self.limits.max_chars} characters "
                f"in {self.limits.timeout_s:g} s)", param, "chat_template_limit") from None
        except RecursionError:
            raise RequestError("the chat template recursed too deeply", param) from None
        except Exception as e:  # a syntax error, the template's raise_exception, a type error
            raise RequestError(f"the chat template {failed}: {e}", param) from None

    def ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
            kwargs: dict[str, Any] | None = None, template: str | None = None,
            tools: list[dict[str, Any]] | None = None) -> list[int]:
        return self.text_and_ids(messages, add_generation_prompt, kwargs, template, tools)[1]

    def text_and_ids(self, messages: list[dict[str, Any]], add_generation_prompt: bool,
                     kwargs: dict[str, Any] | None = None, template: str | None = None,
                     tools: list[dict[str, Any]] | None = None) -> tuple[str, list[int]]:
        """Rendered, then tokenized as apply_chat_template does (no added special tokens: the
        template writes them)."""
        source = self.check_request(kwargs, template)
        kwargs = {k: v for k, v in (kwargs or {}).items() if k != "chat_template"}
        text = self.render(messages, add_generation_prompt, kwargs, source, tools)
        return text, list(self.tokenizer.encode(text, add_special_tokens=False))

    def _special_tokens(self) -> dict[str, Any]:
        return dict(getattr(self.tokenizer, "special_tokens_map", {}) or {})
