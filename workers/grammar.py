"""Structured outputs' grammars through xgrammar: a `GrammarSpec` (configs/engine.py) compiled
against the target's tokenizer, and the matcher a sequence walks.

Every process that masks logits (each TP rank, the draft actor, the API that validates a
request) holds one `Grammars` for its model: the tokenizer's vocabulary is read once, and each
distinct spec is compiled once (xgrammar's compiler caches by spec)."""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable

from configs.engine import GrammarSpec

# How far a matcher can be rolled back: a verify block's walk through its drafts (DFlash
# blocks are at most 64 tokens, configs/engine.py).
MAX_ROLLBACK_TOKENS = 64
_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")


class GrammarError(ValueError):
    """A spec that does not compile; the message says why (the API answers 400 with it)."""


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # a dependency of the package: only a broken install lacks it
        raise RuntimeError("structured outputs need the xgrammar package (pip install "
                           "xgrammar)") from e
    return xgrammar


def choice_grammar(choices: Iterable[str]) -> str:
    """EBNF whose only sentences are the choices (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def check_spec_shape(spec: GrammarSpec) -> None:
    """What can be said without the tokenizer: a json spec is a JSON object, a choice a
    non-empty list of non-empty strings. GrammarError otherwise."""
    if spec.kind in ("json", "choice", "structural_tag"):
        try:
            value = json.loads(spec.value)
        except json.JSONDecodeError as e:
            raise GrammarError(f"the {spec.kind} constraint is not valid JSON: {e}") from None
        if spec.kind == "choice" and (not isinstance(value, list) or not value or any(
                not isinstance(c, str) or not c for c in value)):
            raise GrammarError("choice must be a non-empty list of non-empty strings")
        if spec.kind != "choice" and not isinstance(value, dict):
            raise GrammarError(f"the {spec.kind} constraint must be a JSON object")


class Grammars:
    """Compiles specs for one tokenizer. `tokenizer`: a transformers tokenizer; `vocab_size`:
    the logits' width (the model's vocabulary, padded past the tokenizer's)."""

    def __init__(self, tokenizer, vocab_size: int, info=None):
        """`info`: an xgrammar TokenizerInfo to use instead of the tokenizer's (benchmarks
        without the model's tokenizer files)."""
        xgr = _xgrammar()
        self.vocab_size = vocab_size
        self.info = info if info is not None else xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size)
        # Compiles run on the caller's thread (the API's executor, a worker's compile thread);
        # one thread each keeps a worker's compile from taking the cores its step needs.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1)
        self._lock = threading.Lock()

    def compile(self, spec: GrammarSpec):
        """The CompiledGrammar; GrammarError naming the problem if the spec does not compile."""
        check_spec_shape(spec)
        c = self.compiler
        try:
            with self._lock:  # one compile at a time per process: the rest hit its cache
                if spec.kind == "json":
                    return c.compile_grammar(json_schema_grammar(spec.value))
                if spec.kind == "json_object":
                    return c.compile_builtin_json_grammar()
                if spec.kind == "regex":
                    return c.compile_regex(spec.value)
                if spec.kind == "choice":
                    return c.compile_grammar(choice_grammar(json.loads(spec.value)))
                if spec.kind == "grammar":
                    return c.compile_grammar(spec.value)
                return c.compile_structural_tag(spec.value)
        except (RuntimeError, ValueError, TypeError) as e:
            # xgrammar's messages open with "[time] source.cc:line: "
            reason = _SOURCE_PREFIX.sub("", str(e).strip()) or type(e).__name__
            raise GrammarError(f"the {spec.kind} constraint does not compile: {reason}") \
                from None

    def matcher(self, compiled, stop_ids: Iterable[int]):
        """A matcher at the grammar's start; `stop_ids` end the sequence once the grammar is
        complete (the engine's end-of-sequence ids and the request's stop_token_ids)."""
        return _xgrammar().GrammarMatcher(compiled, override_stop_tokens=sorted(stop_ids),
                                          max_rollback_tokens=MAX_ROLLBACK_TOKENS)


# xgrammar's rule for the characters of a string with minLength/maxLength admits the control
# characters U+0000-U+001F, which JSON requires escaped (its other string rules exclude them).
_LENGTH_STRING_CHAR = r'[^\"\\\r\n]'
_JSON_STRING_CHAR = r'[^\0-\x1f\"\\\r\n]'


def json_schema_grammar(schema: str) -> str:
    """EBNF for JSON text valid under `schema` (compact: no whitespace beyond ", " and
    ": "), control characters excluded from every string."""
    grammar = _xgrammar().Grammar.from_json_schema(schema, any_whitespace=False)
    return str(grammar).replace(_LENGTH_STRING_CHAR, _JSON_STRING_CHAR)
