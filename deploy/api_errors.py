"""Any failure as the API reports it: a `RequestError` (OpenAI's error JSON and its status)
whose message a client may read. Engine errors are logged whole and shown without what
their text may carry about the cluster."""

from __future__ import annotations

import logging
import re

from deploy.engine_client import (
    EngineDeadError,
    EngineDraining,
    EngineOverloaded,
    EngineStepError,
)
from deploy.protocol import RequestError, value_error

log = logging.getLogger(__name__)

# What an engine error's text may carry that clients must not see: node addresses, process
# ids, Ray's actor/task/job ids and namespace.
_PRIVATE = [
    (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<address>"),
    (re.compile(r"\[[0-9a-fA-F:]{3,}\](?::\d+)?"), "<address>"),
    (re.compile(r"\b(pid|PID|Process|process)([=: ]+)\d+"), r"\1\2<pid>"),
    (re.compile(r"\b[0-9a-f]{16,}\b"), "<id>"),
    (re.compile(r"\b0x[0-9a-fA-F]{6,}\b"), "<pointer>"),
    (re.compile(r"(namespace[=: ]+)\S+", re.IGNORECASE), r"\1<namespace>"),
]
MAX_PUBLIC_MESSAGE = 400


def public_message(text: str) -> str:
    """An engine error as a client may read it: its first line (Ray appends advice and
    tracebacks after it), no addresses, pids or Ray ids, at most MAX_PUBLIC_MESSAGE chars. The
    whole text goes to the server's log."""
    line = text.strip().splitlines()[0] if text.strip() else ""
    for pattern, repl in _PRIVATE:
        line = pattern.sub(repl, line)
    return line if len(line) <= MAX_PUBLIC_MESSAGE else line[: MAX_PUBLIC_MESSAGE - 1] + "…"


def as_request_error(e: Exception) -> RequestError:
    if isinstance(e, RequestError):
        return e
    if isinstance(e, ValueError):
        return value_error(e)
    if isinstance(e, EngineOverloaded):
        return RequestError(str(e), None, "engine_overloaded", 429, "rate_limit_error")
    if isinstance(e, EngineDraining):
        return RequestError(str(e), None, "server_shutting_down", 503, "service_unavailable")
    if isinstance(e, EngineDeadError):
        log.warning("engine unavailable: %s", e)
        return RequestError(public_message(str(e)), None, "engine_unavailable", 503,
                            "service_unavailable")
    if isinstance(e, EngineStepError):
        log.warning("engine step failed: %s", e)
        return RequestError(public_message(str(e)), None, "engine_step_failed", 500,
                            "internal_server_error")
    log.error("unexpected error", exc_info=e)
    return RequestError(public_message(f"internal server error ({type(e).__name__}: {e})"),
                        None, "internal_error", 500, "internal_server_error")
