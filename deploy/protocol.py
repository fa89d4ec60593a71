"""The subset of the OpenAI API we serve, as pydantic models, and its error shape.

Requests are parsed leniently where OpenAI's clients send extras (unknown fields are ignored)
but strictly where silence would mislead: a feature we do not implement (beam search, the
deprecated `functions`, ...) is a 400 naming the field, never quietly dropped, and a value of
the wrong JSON type is a 400, never coerced ("16" is not a max_tokens).
Extensions (vLLM's names): `top_k`, `stop_token_ids`, `ignore_eos`, `return_token_ids`,
`prompt_logprobs`, the sampling controls (`repetition_penalty`, `min_p`, `min_tokens`,
`bad_words`, `allowed_token_ids`) and structured outputs (`structured_outputs`, and the older
`guided_json`/`guided_regex`/`guided_choice`/`guided_grammar`). OpenAI fields clients send
routinely (`user`, and in chat `reasoning_effort`, `metadata`, `service_tier`) are typed and
accepted without effect;
`store: true` is refused in chat (docs/API.md).
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from configs.engine import MAX_LOGPROBS, GrammarSpec, SamplingParams

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default, unless generation_config.json has one
GREEDY_BELOW = 1e-5  # temperatures below this decode greedily (1/T would overflow the logits)
# OpenAI allows 4; lm-eval sends a task's stop strings plus the EOS text (5 and more).
MAX_STOP_STRINGS = 16
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Choices one request may ask for: its prompts × n (each is an engine request of its own).
MAX_CHOICES = 256
# Request bodies above this many bytes are a 413 before they are read on (ServeArgs, CLI).
DEFAULT_MAX_REQUEST_BYTES = 16 << 20
# Graceful shutdown: how long requests in flight may run on after SIGTERM (then they end with
# an error event); also Serve's graceful_shutdown_timeout_s, plus a margin.
DEFAULT_SHUTDOWN_GRACE_S = 30.0


@dataclass(frozen=True)
class SamplingDefaults:
    """What a request that leaves temperature, top_p or top_k out gets."""

    temperature: float = DEFAULT_TEMPERATURE
    top_p: float = 1.0
    top_k: int = 0
    source: str = "OpenAI's defaults"


OPENAI_DEFAULTS = SamplingDefaults()
GENERATION_CONFIGS = ("auto", "vllm")  # or a directory holding generation_config.json


def load_sampling_defaults(generation_config: str, model_dir: str) -> SamplingDefaults:
    """vLLM's --generation-config: "auto" takes temperature, top_p and top_k from the model's
    generation_config.json where it sets them; "vllm" ignores the file; a directory: its
    generation_config.json. A missing file gives OpenAI's defaults; a broken one raises
    ValueError naming it."""
    if generation_config == "vllm":
        return SamplingDefaults()
    folder = Path(model_dir if generation_config == "auto" else generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ValueError(f"generation_config: {path} does not exist")
        return SamplingDefaults()
    try:
        raw = json.loads(path.read_text())
        base = SamplingDefaults()
        got = {k: raw[k] for k in ("temperature", "top_p", "top_k") if raw.get(k) is not None}
        out = SamplingDefaults(
            temperature=float(got.get("temperature", base.temperature)),
            top_p=float(got.get("top_p", base.top_p)), top_k=int(got.get("top_k", base.top_k)),
            source=f"{path}" if got else base.source)
        SamplingParams(temperature=out.temperature, top_p=out.top_p, top_k=out.top_k)
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"generation_config: {path} is not usable: {e}") from None
    return out


def _absent(v: Any) -> bool:
    return v is None


class RequestError(Exception):
    """An error the client caused or must react to, rendered as OpenAI's error JSON."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None,
                 status: int = 400, type: str = "invalid_request_error"):
        super().__init__(message)
        self.message, self.param, self.code, self.status, self.type = (
            message, param, code, status, type)

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


# ---- requests --------------------------------------------------------------------------------

# Fields OpenAI (or vLLM, as extensions) defines that we do not implement → 400 unless
# neutral: absent, null, false, 0, {}, [] (NEUTRAL), or the field's own no-op value.
UNSUPPORTED = ("top_logprobs", "echo", "suffix", "functions", "audio", "prediction",
               # vLLM's extensions
               "use_beam_search", "length_penalty", "logits_processors")
NEUTRAL = (None, False, 0, {}, [])
NO_OP = {"length_penalty": 1}
# vLLM's guided_decoding_backend values that name what serves structured outputs here
GRAMMAR_BACKENDS = ("auto", "xgrammar")
ROLES = ("system", "developer", "user", "assistant", "tool")
# OpenAI's values (openai-python's ReasoningEffort): accepted in chat without effect (Qwen3.5
# thinks unless chat_template_kwargs={"enable_thinking": false}); /v1/responses maps them.
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh", "max")
# OpenAI's tiers: every request is served the one way, which responses name "default"
SERVICE_TIERS = ("auto", "default", "flex", "scale", "priority", "fast")
METADATA_LIMITS = (16, 64, 512)  # OpenAI's: pairs, characters per key, characters per value


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's response_format: text, json_object or json_schema; and vLLM's
    structural_tag."""

    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(BaseModel):
    """vLLM's structured_outputs: exactly one constraint."""

    model_config = ConfigDict(extra="forbid", strict=True)
    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    # vLLM's options that change nothing here
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None


def _schema_text(schema: dict[str, Any] | str) -> str:
    return schema if isinstance(schema, str) else json.dumps(schema, sort_keys=True)


class _SamplingRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None  # None → the served model
    temperature: float | None = Field(None, allow_inf_nan=False)  # None → DEFAULT_TEMPERATURE
    top_p: float | None = Field(None, allow_inf_nan=False)
    top_k: int | None = None  # extension; 0 or -1 → disabled
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # extension
    n: int | None = 1
    best_of: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool | None = False  # extension
    return_token_ids: bool | None = False  # extension: prompt_token_ids and choices' token_ids
    prompt_logprobs: int | None = None  # extension: each prompt token's, with this many others
    user: str | None = None  # accepted, unused (as in vLLM)
    # the sampling controls (configs/engine.py SamplingParams; vLLM's semantics)
    presence_penalty: float | None = Field(None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(None, allow_inf_nan=False)
    repetition_penalty: float | None = Field(None, allow_inf_nan=False)  # extension
    min_p: float | None = Field(None, allow_inf_nan=False)  # extension
    min_tokens: int | None = None  # extension
    logit_bias: dict[str, float] | None = None  # token id (as a string) → bias
    bad_words: str | list[str] | None = None  # extension: tokenized by the server
    allowed_token_ids: list[int] | None = None  # extension
    # structured outputs: one of these
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # extension
    guided_json: dict[str, Any] | str | None = None  # extension (vLLM's older spelling)
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def check(self) -> None:
        if not 1 <= self.num_choices <= MAX_CHOICES:
            raise RequestError(f"n must be in [1, {MAX_CHOICES}], got {self.n}", "n")
        if self.seed is not None and self.seed + self.num_choices - 1 >= 2**63:
            # choice j samples with seed + j: past 2^63 - 1 it would wrap onto another seed's
            raise RequestError(f"seed + n - 1 must be below 2^63 (choice j samples with seed + "
                               f"j), got seed {self.seed} with n={self.num_choices}", "seed")
        if self.best_of not in (None, 1, self.n):
            raise RequestError(f"best_of must equal n (no candidates are ranked), got "
                               f"{self.best_of}", "best_of")
        for name in UNSUPPORTED:
            value = (self.model_extra or {}).get(name)
            if value not in NEUTRAL and not (name in NO_OP and value == NO_OP[name]):
                raise RequestError(f"{name} is not supported by this server", name)
        if self.guided_decoding_backend not in (None, *GRAMMAR_BACKENDS):
            raise RequestError(f"guided_decoding_backend must be one of {GRAMMAR_BACKENDS} "
                               f"(xgrammar serves structured outputs), got "
                               f"{self.guided_decoding_backend!r}", "guided_decoding_backend")
        self.grammar_spec()  # one constraint, well formed
        if self.logit_bias is not None:
            self.logit_bias_pairs()
        if len(self.stop_strings) > MAX_STOP_STRINGS:
            raise RequestError(f"at most {MAX_STOP_STRINGS} stop strings, got "
                               f"{len(self.stop_strings)}", "stop")
        if any(s == "" for s in self.stop_strings):
            raise RequestError("stop strings must not be empty", "stop")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream=true",
                               "stream_options")
        _check_logprobs(self.prompt_logprobs, "prompt_logprobs")
        if self.prompt_logprobs is not None and self.stream:
            raise RequestError("prompt_logprobs is not available with stream=true (as in vLLM)",
                               "prompt_logprobs")

    @property
    def num_choices(self) -> int:
        return 1 if self.n is None else self.n

    def grammar_spec(self) -> tuple[GrammarSpec, str] | None:
        """The structured output's constraint and the field that asked for it; None for free
        text. More than one constraint is a 400."""
        found: list[tuple[GrammarSpec, str]] = []
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append((GrammarSpec("json_object", ""), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise RequestError("response_format json_schema needs json_schema.schema",
                                   "response_format")
            found.append((GrammarSpec("json", _schema_text(fmt.json_schema.schema_)),
                          "response_format"))
        elif fmt is not None and fmt.type == "structural_tag":
            tag = dict(fmt.model_extra or {})
            found.append((GrammarSpec("structural_tag", json.dumps(
                {"type": "structural_tag", **tag} if "format" in tag else tag)),
                "response_format"))
        so = self.structured_outputs
        if so is not None:
            kinds = [(k, v) for k, v in (
                ("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                ("grammar", so.grammar), ("json_object", so.json_object or None),
                ("structural_tag", so.structural_tag)) if v is not None]
            if len(kinds) != 1:
                raise RequestError("structured_outputs takes exactly one of json, regex, "
                                   "choice, grammar, json_object, structural_tag",
                                   "structured_outputs")
            kind, value = kinds[0]
            found.append((GrammarSpec(kind, _grammar_text(kind, value)), "structured_outputs"))
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"),
                           ("guided_choice", "choice"), ("guided_grammar", "grammar")):
            value = getattr(self, name)
            if value is not None:
                found.append((GrammarSpec(kind, _grammar_text(kind, value)), name))
        if len(found) > 1:
            raise RequestError(f"give one structured-output constraint, got "
                               f"{', '.join(name for _, name in found)}", found[1][1])
        if not found:
            return None
        from workers.grammar import GrammarError, check_spec_shape

        try:
            check_spec_shape(found[0][0])
        except GrammarError as e:
            raise RequestError(str(e), found[0][1]) from None
        return found[0]

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            try:
                token = int(key)
            except ValueError:
                raise RequestError(f"logit_bias keys must be token ids, got {key!r}",
                                   "logit_bias") from None
            pairs.append((token, bias))
        return tuple(pairs)

    def logprob_counts(self) -> tuple[int | None, int | None]:
        """(alternatives per generated token, per prompt token); None: not asked for."""
        return None, self.prompt_logprobs

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling_params(self, max_tokens: int,
                        defaults: SamplingDefaults = OPENAI_DEFAULTS,
                        bad_words_token_ids: tuple[tuple[int, ...], ...] = ()) -> SamplingParams:
        """`bad_words_token_ids`: bad_words as the tokenizer spells them (the server's)."""
        temperature = defaults.temperature if self.temperature is None else self.temperature
        logprobs, prompt_logprobs = self.logprob_counts()
        spec = self.grammar_spec()
        controls = {name: value for name, value in (
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
            ("repetition_penalty", self.repetition_penalty), ("min_p", self.min_p),
            ("min_tokens", self.min_tokens)) if value is not None}
        try:
            return SamplingParams(
                **controls, logit_bias=self.logit_bias_pairs(),
                bad_words_token_ids=bad_words_token_ids,
                allowed_token_ids=None if self.allowed_token_ids is None
                else tuple(self.allowed_token_ids),
                grammar=None if spec is None else spec[0],
                max_tokens=max_tokens,
                temperature=0.0 if 0 <= temperature < GREEDY_BELOW else temperature,
                top_p=defaults.top_p if self.top_p is None else self.top_p,
                top_k=defaults.top_k if self.top_k is None else self.top_k, seed=self.seed,
                stop_token_ids=tuple(self.stop_token_ids or ()),
                ignore_eos=bool(self.ignore_eos), logprobs=logprobs,
                prompt_logprobs=prompt_logprobs)
        except ValueError as e:
            raise value_error(e) from None


def _check_logprobs(value: int | None, param: str) -> None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise RequestError(f"{param} must be in [0, {MAX_LOGPROBS}], got {value}", param)


class CompletionRequest(_SamplingRequest):
    # one text, one token-id list, or a batch of either: a choice (n of them) per prompt
    prompt: str | list[int] | list[str] | list[list[int]]
    # None → the rest of the context; 0 only with echo (the prompt's log-probabilities alone)
    max_tokens: int | None = COMPLETION_DEFAULT_MAX_TOKENS
    logprobs: int | None = None  # the most likely alternatives listed per token
    echo: bool | None = False  # the prompt before the completion (with its logprobs)

    def check(self) -> None:
        super().check()
        _check_logprobs(self.logprobs, "logprobs")
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens must be a positive integer, got 0 (0 is only "
                               "allowed with echo)", "max_tokens")
        prompts = self.prompts
        if not prompts or any(isinstance(p, list) and not p for p in prompts):
            raise RequestError("prompt is empty", "prompt")
        if len(prompts) * self.num_choices > MAX_CHOICES:
            raise RequestError(f"{len(prompts)} prompts × n={self.num_choices} choices: at most "
                               f"{MAX_CHOICES} in one request", "prompt")

    @property
    def prompts(self) -> list[str | list[int]]:
        """The batch: text prompts or token-id prompts."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)

    def logprob_counts(self) -> tuple[int | None, int | None]:
        # the prompt's serve both echo (with logprobs) and prompt_logprobs
        asked = [k for k in (self.prompt_logprobs, self.logprobs if self.echo else None)
                 if k is not None]
        return self.logprobs, max(asked) if asked else None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of type object
    strict: bool | None = None


class ToolDefinition(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal[ROLES]
    content: str | list[ContentPart] | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool result: the call it answers
    reasoning_content: str | None = None  # an assistant's reasoning (vLLM's old name)
    reasoning: str | None = None  # the same (vLLM's new name)

    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            return self.content or ""
        if any(p.type != "text" or p.text is None for p in self.content):
            raise RequestError("only text content parts are supported", "messages")
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # extra variables for the chat template (vLLM's; e.g. Qwen3.5's {"enable_thinking": false});
    # an allow-list (deploy/chat_template.py)
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # only with trust_request_chat_template (vLLM's)
    max_tokens: int | None = None  # deprecated by OpenAI, still sent by many clients
    max_completion_tokens: int | None = None  # wins over max_tokens; None → rest of context
    logprobs: bool | None = False  # each output token's log-probability
    top_logprobs: int | None = None  # with logprobs: the most likely alternatives per token
    reasoning_effort: Literal[REASONING_EFFORTS] | None = None  # accepted, no effect
    metadata: dict[str, str] | None = None  # accepted, unused (nothing is stored)
    store: bool | None = None  # true → 400: nothing is stored to retrieve
    service_tier: Literal[SERVICE_TIERS] | None = None  # named: responses say "default"
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # None → true

    def check(self) -> None:
        from deploy.tool_calls import check_tools

        check_tools(self)  # first: the forced call's constraint reads the tools
        super().check()
        _check_logprobs(self.top_logprobs, "top_logprobs")
        if self.store:
            raise RequestError("store is not supported: this server keeps no completions to "
                               "retrieve; send store: false or leave it out", "store")
        pairs, key_len, value_len = METADATA_LIMITS
        if self.metadata and (len(self.metadata) > pairs or any(
                len(k) > key_len or len(v) > value_len for k, v in self.metadata.items())):
            raise RequestError(f"metadata holds at most {pairs} pairs, keys of at most "
                               f"{key_len} characters and values of at most {value_len}",
                               "metadata")
        if self.top_logprobs and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true", "top_logprobs")

    def logprob_counts(self) -> tuple[int | None, int | None]:
        return (self.top_logprobs or 0) if self.logprobs else None, self.prompt_logprobs

    @property
    def effective_tool_choice(self) -> str | NamedToolChoice:
        """OpenAI's default: "auto" with tools, "none" without."""
        if self.tool_choice is not None:
            return self.tool_choice
        return "auto" if self.tools else "none"

    def grammar_spec(self) -> tuple[GrammarSpec, str] | None:
        """A `required` or named tool_choice is a constraint too (the tools' schemas), and
        one more constraint than the response_format or structured outputs may bring."""
        from deploy.tool_calls import forced_call_spec

        found = super().grammar_spec()
        forced = forced_call_spec(self)
        if forced is None:
            return found
        if found is not None:
            raise RequestError(f"tool_choice {self.tool_choice_name} constrains the output "
                               f"to a tool call; it cannot be combined with {found[1]}",
                               found[1])
        return forced, "tool_choice"

    @property
    def tool_choice_name(self) -> str:
        c = self.effective_tool_choice
        return repr(c) if isinstance(c, str) else f"function {c.function.name!r}"

    @property
    def requested_max_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's): a text prompt, or chat messages through the template."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # prompt: the tokenizer's BOS/EOS rules
    add_generation_prompt: bool = True  # messages: end with the assistant's turn opened
    chat_template_kwargs: dict[str, Any] | None = None  # messages: as in chat completions
    chat_template: str | None = None  # messages: as in chat completions
    tools: list[ToolDefinition] | None = None  # messages: as in chat completions

    def check(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise RequestError("give exactly one of prompt and messages", "prompt")


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's): token ids back to text."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None
    tokens: list[int]

    def check(self) -> None:
        pass


# A JSON escape of a UTF-16 surrogate (\ud800-\udfff): only then can a string hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def _union_tag(part: str | int) -> bool:
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "none")
                                      or "[" in part or part.startswith("function-"))


class HugeInteger:
    """A JSON integer of more digits than Python parses (sys.get_int_max_str_digits): kept as
    a value no field accepts, so that validation names the field it was sent in."""

    def __init__(self, digits: str):
        self.num_digits = len(digits.lstrip("-"))

    def __repr__(self) -> str:
        return f"an integer of {self.num_digits} digits"


def _parse_int(digits: str) -> int | HugeInteger:
    try:
        return int(digits)
    except ValueError:  # past the interpreter's digit limit
        return HugeInteger(digits)


def parse_request(model: type[BaseModel], raw: bytes) -> Any:
    try:
        data = json.loads(raw, parse_int=_parse_int)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}", code="invalid_json") \
            from None
    except RecursionError:
        raise RequestError("the request body is nested too deeply", code="invalid_json") \
            from None
    if not isinstance(data, dict):
        raise RequestError("the request body must be a JSON object")
    if _SURROGATE_ESCAPE.search(raw):
        try:  # a pair is one character; a lone surrogate cannot be encoded (nor tokenized)
            json.dumps(data, ensure_ascii=False).encode("utf-8")
        except UnicodeEncodeError:
            raise RequestError("the request holds a lone UTF-16 surrogate (\\ud800-\\udfff "
                               "without its pair): not valid Unicode text",
                               code="invalid_json") from None
    try:
        req = model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        # the field's path without a union's member tags (str, list[int], function-…)
        path = ".".join(str(p) for p in err["loc"] if not _union_tag(p))
        param = path or None
        msg = err["msg"] if not isinstance(err.get("input"), HugeInteger) else \
            f"{err['input']!r} is out of range"
        raise RequestError(f"{path}: {msg}" if path else msg, param) from None
    req.check()
    return req


SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p",
                   "min_tokens", "logit_bias", "bad_words", "allowed_token_ids")


def value_error(e: ValueError) -> RequestError:
    """A ValueError from SamplingParams or the engine; its message starts with the field."""
    msg = str(e)
    first = msg.split(" ", 1)[0].rstrip(":")
    param = first if first in SAMPLING_FIELDS else "prompt" if first == "prompt" else None
    return RequestError(msg, param)


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class _Response(BaseModel):
    id: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_absent)  # return_token_ids


class CompletionLogprobs(BaseModel):
    """OpenAI's legacy completions form: per token its text, log-probability (None for the
    prompt's first), the alternatives {text: log-probability}, and its offset in the text."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's prompt_logprobs entry: a token's log-probability, its rank in the vocabulary
    (1: the most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str


# Per prompt token: None for the first, else {token id: PromptLogprob} for the prompt's token
# and the most likely others (vLLM's form; the ids are JSON strings).
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_absent)  # return_token_ids
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_absent)  # return_token_ids
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_absent)


class CompletionResponse(_Response):
    # OpenAI uses the same object name for the response and its stream chunks.
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    # with a reasoning parser: the reasoning, under vLLM's old and new names
    reasoning_content: str | None = Field(None, exclude_if=_absent)
    reasoning: str | None = Field(None, exclude_if=_absent)
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_absent)


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None  # the token text's UTF-8 bytes


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int = 0
    message: AssistantMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_absent)


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    service_tier: str | None = Field(None, exclude_if=_absent)  # "default" if one was asked
    prompt_logprobs: PromptLogprobs | None = Field(None, exclude_if=_absent)


class DeltaMessage(BaseModel):
    role: str | None = Field(None, exclude_if=_absent)
    content: str | None = Field(None, exclude_if=_absent)
    reasoning_content: str | None = Field(None, exclude_if=_absent)
    reasoning: str | None = Field(None, exclude_if=_absent)
    # OpenAI's streamed calls: {index, id, type, function: {name, arguments: ""}} first, then
    # {index, function: {arguments: fragment}}
    tool_calls: list[dict[str, Any]] | None = Field(None, exclude_if=_absent)


class ChatChunkChoice(BaseModel):
    index: int = 0
    delta: DeltaMessage
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_absent)


class ChatCompletionChunk(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    service_tier: str | None = Field(None, exclude_if=_absent)  # "default" if one was asked


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "dflash-serve"
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


def _grammar_text(kind: str, value: Any) -> str:
    """A structured_outputs / guided_* value as GrammarSpec text."""
    if kind == "json":
        return _schema_text(value)
    if kind == "choice":
        return json.dumps(value)
    return "" if kind == "json_object" else value
