"""What both sides of an engine client share, in process and across the driver actor: errors
(each maps to one HTTP status), snapshots of the engine's state, per-request timing, and the
requests and their output streams."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from cluster.engine import AcceptanceStats, RequestOutput
from cluster.prefix_cache import PrefixCacheSnapshot
from cluster.stats import TimeHistogram
from configs.engine import SamplingParams


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
    # Wall time per step as the driver sees it ("round", "prefill"): submission to result
    step_time: dict[str, TimeHistogram] = field(default_factory=dict)
    # Requests the engine ended since start, by how: stop, length, abort (its consumer left,
    # or met a stop string), error (it failed, or a drain or shutdown stopped it).
    finished: dict[str, int] = field(default_factory=dict)
    prefix_cache: PrefixCacheSnapshot | None = None  # None: prefix caching is off


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


@dataclass(frozen=True)
class EngineRequest:
    """One engine request (a choice of an API request): what `generate_many` admits."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    timing: RequestTiming | None = None


class RequestStream:
    """One admitted request's outputs, in order, until one is finished (or the exception that
    ends it). `end(request_id, early)` runs once: when the stream has seen the request's end
    (early False), or when `aclose()` comes first (early True: the client aborts the request).
    Whoever admits requests closes every stream it got, whether it read from it or not."""

    def __init__(self, request_id: str, items: asyncio.Queue,
                 end: Callable[[str, bool], None], timing: RequestTiming | None = None):
        self.request_id, self._items, self._end = request_id, items, end
        self._timing = timing  # stamped here when the engine's side cannot (across Ray)
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._items.get()
        if isinstance(item, Exception):
            self._finish(early=False)  # the engine's side has ended the request already
            raise item
        if self._timing is not None:
            now = time.monotonic()
            if item.new_token_ids:
                self._timing.record(len(item.new_token_ids), now)
            if item.finished:
                self._timing.finished = now
        if item.finished:
            self._finish(early=False)
        return item

    async def aclose(self) -> None:
        self._finish(early=True)

    def _finish(self, early: bool) -> None:
        if not self._done:
            self._done = True
            self._end(self.request_id, early)


async def generate_one(client, request: EngineRequest) -> AsyncIterator[RequestOutput]:
    """`generate` of both engine clients: one request through `generate_many`."""
    (stream,) = await client.generate_many([request])
    try:
        async for out in stream:
            yield out
    finally:
        await stream.aclose()
