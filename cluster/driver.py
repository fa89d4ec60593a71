"""The driver actor: owns one engine's actors (RayEngineCluster) and runs its loop
(LocalEngineClient: one thread stepping the engine). A Serve replica talks to it through
`RayEngineClient` (deploy/ray_client.py): `add_many` per API request (its choices together),
`abort_many` for the requests whose clients left (batched), and one long-lived `stream` (a Ray
streaming generator) that carries every request's new tokens of a step in one batch — one Ray
object per step, however many requests run.

A step that fails (a rank died, or hung past the step timeout) fails the requests in flight
with EngineStepError; the driver then kills every actor of the engine and starts them again in
the same placement group, while new requests wait in the loop's inbox."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
from collections.abc import AsyncIterator
from functools import partial

from cluster.engine import LLMEngine, RequestOutput
from cluster.engine_loop import LocalEngineClient
from cluster.engine_types import EngineDeadError, EngineRequest, EngineSnapshot
from cluster.ray_executor import DEFAULT_STEP_TIMEOUT_S, RayEngineCluster
from configs.engine import EngineConfig, SamplingParams
from configs.logs import setup_logging
from workers.step_loop import GIL_SWITCH_INTERVAL_S

log = logging.getLogger(__name__)
# An idle probe's ping step: rank 0's answer within this, or the actors answer Ray's probe once
# it is overdue (cluster/executor.py) — a frozen actor fails it within seconds.
PROBE_TIMEOUT_S = 60.0
# One stream item: a request's output, or the exception that ends it.
StreamItem = tuple[str, RequestOutput | Exception]


class EngineDriver:
    """Run as an async Ray actor (`max_concurrency` ≥ the requests in flight)."""

    def __init__(self, cfg: EngineConfig, tp: int, model_name: str,
                 max_waiting: int | None = None, pg=None, use_gpu: bool | None = None,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S):
        setup_logging()
        self._start_args = (cfg, tp, model_name, max_waiting, pg, use_gpu, step_timeout_s)
        self.cluster: RayEngineCluster | None = None
        self.client: LocalEngineClient | None = None
        self._probe: asyncio.Task | None = None
        self._batch: list[StreamItem] = []  # undelivered, appended by the engine thread
        self._batch_lock = threading.Lock()
        self._ready: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def start(self) -> dict:
        """Starts the engine's actors, warms them up and starts the loop (off the event loop:
        loading blocks for long); returns what the client needs to know about the engine."""
        cfg, tp, model_name, max_waiting, pg, use_gpu, step_timeout_s = self._start_args
        sys.setswitchinterval(GIL_SWITCH_INTERVAL_S)  # the engine thread vs the event loop
        self._loop, self._ready = asyncio.get_running_loop(), asyncio.Event()
        self.cluster = await asyncio.to_thread(
            RayEngineCluster, cfg, tp, pg=pg, use_gpu=use_gpu, step_timeout_s=step_timeout_s)
        self.client = LocalEngineClient(self.cluster.engine, model_name, max_waiting,
                                        recover=self._recover, after_step=self._wake_stream)
        c = self.client
        log.info("engine ready: %s, tp %d, control channel %s", model_name, tp,
                 self.cluster.channel_kind)
        return {"model_name": c.model_name, "max_model_len": c.max_model_len,
                "vocab_size": c.vocab_size, "channel": self.cluster.channel_kind}

    def _recover(self, error: Exception) -> LLMEngine:
        log.warning("engine step failed (%s: %s); restarting its actors",
                    type(error).__name__, error)
        engine = self.cluster.restart()
        log.warning("engine actors restarted (%d restarts so far)", self.cluster.restarts)
        return engine

    # ---- requests -----------------------------------------------------------------------------

    def add_many(self, requests: list[tuple[str, list[int], SamplingParams]]) -> None:
        """Queues requests together, all or none (the choices of one API request); their
        outputs come through `stream`. Raises EngineOverloaded, EngineDraining or
        EngineDeadError at once; a bad request's ValueError comes through `stream`."""
        self.client.submit_many([(EngineRequest(request_id, prompt_ids, params),
                                  partial(self._deliver, request_id))
                                 for request_id, prompt_ids, params in requests])

    def _deliver(self, request_id: str, item: RequestOutput | Exception) -> bool:
        with self._batch_lock:
            self._batch.append((request_id, item))
        return True

    async def abort(self, request_id: str) -> None:
        """Returns once the engine has dropped the request. Also for a request whose add has
        not run yet (Ray may run the two in either order): its add then ends it at once."""
        await self.client.abort(request_id)

    def abort_many(self, request_ids: list[str]) -> None:
        """Queues the aborts (as `abort`, without waiting for them)."""
        for request_id in request_ids:
            self.client.cancel(request_id)

    def _wake_stream(self) -> None:  # the engine thread, after each step's outputs
        try:
            self._loop.call_soon_threadsafe(self._ready.set)
        except RuntimeError:
            pass  # the actor is shutting down

    async def stream(self) -> AsyncIterator[list[StreamItem]]:
        """Every request's outputs, a batch per step (more when the reader lags: batches
        coalesce while a yield waits)."""
        while True:
            await self._ready.wait()
            self._ready.clear()
            with self._batch_lock:
                batch, self._batch = self._batch, []
            if batch:
                yield batch

    # ---- state and health ---------------------------------------------------------------------

    def snapshot(self) -> EngineSnapshot:
        return self.client.snapshot()

    async def check_health(self) -> None:
        """Raises while the engine restarts, or while its current step is overdue and its
        actors are being probed. When no request runs it also starts a probe of the actors
        (a ping step; not awaited here, so /health answers at once): a death or a freeze
        between requests would otherwise surface only as the next request's failure."""
        await self.client.check_health()
        stalled = self.cluster.stalled()
        if stalled is not None:
            raise EngineDeadError(stalled)
        if self.client.idle and (self._probe is None or self._probe.done()):
            self._probe = asyncio.create_task(self._probe_idle())

    async def _probe_idle(self) -> None:
        try:
            await self.client.call(lambda: self.cluster.ping(PROBE_TIMEOUT_S))
        except EngineDeadError:
            pass  # the client is shut down or dead: check_health says so
        except Exception as e:
            reason = f"health probe failed: {type(e).__name__}: {e}"
            log.warning(reason)
            self.client.request_restart(reason)

    async def check_alive(self) -> None:
        await self.client.check_alive()

    async def drain(self, grace_s: float) -> dict[str, int]:
        """No new requests; those in flight finish or are stopped after grace_s
        (LocalEngineClient.drain). What `dflash-serve serve` calls on SIGTERM."""
        counts = await self.client.drain(grace_s)
        log.info("drained: %s", counts)
        return counts

    def restarts(self) -> int:
        return self.cluster.restarts

    def warmup(self) -> dict[str, float]:
        """What the current engine's start-up warm-up ran (LLMEngine.warm_up)."""
        return self.cluster.engine.warmup

    def actors(self) -> dict[str, list]:
        return self.cluster.actors()

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.shutdown()
        if self.cluster is not None:  # off the event loop: it waits for the loops to stop
            await asyncio.to_thread(self.cluster.shutdown)
