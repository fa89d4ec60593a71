"""What both sides of an engine client share, in process and across the driver actor: errors
(each maps to one HTTP status), snapshots of the engine's state, per-request timing."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from cluster.engine import AcceptanceStats
from cluster.stats import TimeHistogram


class EngineOverloaded(RuntimeError):
    """Too many requests wait for admission; retry later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine is shut down or its loop died (HTTP 503)."""


class EngineDraining(EngineDeadError):
    """The server is shutting down: it takes no new requests, and a request still running at
    the end of the grace period is stopped (HTTP 503)."""


class EngineStepError(RuntimeError):
    """A step raised: every request in flight at that moment fails with this (HTTP 500); or
    a step failed for one request alone (`request_failed`)."""


def request_failed(request_id: str, error: str | None) -> EngineStepError:
    """What a request whose own part of a step failed (finish reason "error") raises."""
    return EngineStepError(f"request {request_id!r} failed in the engine ({error}); other "
                           f"requests were not affected")


@dataclass(frozen=True)
class EngineSnapshot:
    running: int  # sequences being decoded
    waiting: int  # sequences queued for admission
    cache_usage: float  # fraction of KV pages held, 0..1
    acceptance: AcceptanceStats  # cumulative since start; a copy the caller may keep
    # Wall time per proposal (draft) and per verify round, timed where they run (the draft
    # actor, TP rank 0; in process the same calls). None: not measured; /metrics leaves it out.
    draft_time_per_round: TimeHistogram | None = None
    verify_time_per_round: TimeHistogram | None = None


@dataclass
class RequestTiming:
    """Per-request timestamps (time.monotonic of the caller's process). The caller creates it
    when the request arrives; the client stamps tokens as the engine produces them."""

    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    # After the first token: (seconds since the previous batch, tokens in this batch). A
    # speculative round delivers several tokens at once.
    token_batches: list[tuple[float, int]] = field(default_factory=list)

    def record(self, num_tokens: int, now: float) -> None:
        if self.first_token is None:
            self.first_token = now
        else:
            self.token_batches.append((now - self.last_token, num_tokens))
        self.last_token = now
