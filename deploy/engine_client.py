"""What the HTTP layer needs from an engine: `EngineClient`. Implemented by the in-process
`LocalEngineClient` (cluster/engine_loop.py) and by `RayEngineClient` (deploy/ray_client.py,
over the driver actor); nothing in the HTTP layer (`deploy/openai_api.py` and the handlers it
routes to) may reach past this protocol."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Protocol

from cluster.engine import RequestOutput
from cluster.engine_loop import LocalEngineClient
from cluster.engine_types import (
    EngineDeadError,
    EngineDraining,
    EngineOverloaded,
    EngineRequest,
    EngineSnapshot,
    EngineStepError,
    RequestStream,
    RequestTiming,
)
from configs.engine import SamplingParams

__all__ = ["EngineClient", "EngineDeadError", "EngineDraining", "EngineOverloaded",
           "EngineRequest", "EngineSnapshot", "EngineStepError", "LocalEngineClient",
           "RequestStream", "RequestTiming"]


class EngineClient(Protocol):
    model_name: str
    max_model_len: int
    vocab_size: int

    async def generate_many(self, requests: list[EngineRequest]) -> list[RequestStream]:
        """Admits the requests together (an API request's choices): all of them, or none
        (EngineOverloaded, EngineDraining, EngineDeadError at once). A stream for each, in
        order, which the caller must close (closing one before its end aborts the request).
        A bad request's ValueError, or EngineStepError, comes through its stream. Cancelled
        while it runs, it leaves nothing running: what it admitted is aborted."""
        ...

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 timing: RequestTiming | None = None) -> AsyncIterator[RequestOutput]:
        """One request as an async generator: each step's output until one is finished.
        Closing it before the end aborts the request."""
        ...

    async def abort(self, request_id: str) -> None: ...

    def snapshot(self) -> EngineSnapshot:
        """The engine state as of the last `refresh()` (or newer); never blocks."""
        ...

    async def refresh(self) -> None:
        """Brings `snapshot()` up to date (a no-op where the engine publishes in process)."""
        ...

    async def check_health(self) -> None:
        """Returns when the engine can serve; raises EngineDeadError otherwise."""
        ...

    async def shutdown(self) -> None: ...
