"""The driver actor: owns one engine's actors (RayEngineCluster) and runs its loop
(LocalEngineClient: one thread stepping the engine, asyncio streams per request). A Serve
replica talks to it through `RayEngineClient` (deploy/ray_client.py): `generate` is a Ray
streaming generator yielding one RequestOutput per step that produced tokens for the request.

A step that fails (a rank died, or hung past the step timeout) fails the requests in flight
with EngineStepError; the driver then kills every actor of the engine and starts them again in
the same placement group, while new requests wait in the loop's inbox."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from cluster.engine import LLMEngine, RequestOutput
from cluster.engine_loop import LocalEngineClient
from cluster.engine_types import EngineDeadError, EngineSnapshot
from cluster.ray_executor import DEFAULT_STEP_TIMEOUT_S, RayEngineCluster
from configs.engine import EngineConfig, SamplingParams

log = logging.getLogger(__name__)
# A probe waits behind a step already queued on the actor: generous, to never restart a busy
# but healthy engine.
PROBE_TIMEOUT_S = 60.0


class EngineDriver:
    """Run as an async Ray actor (`max_concurrency` ≥ the requests in flight)."""

    def __init__(self, cfg: EngineConfig, tp: int, model_name: str,
                 max_waiting: int | None = None, pg=None, use_gpu: bool | None = None,
                 step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S):
        self._start_args = (cfg, tp, model_name, max_waiting, pg, use_gpu, step_timeout_s)
        self.cluster: RayEngineCluster | None = None
        self.client: LocalEngineClient | None = None
        self._probing = False

    async def start(self) -> dict:
        """Starts the engine's actors and loop (off the event loop: loading blocks for long);
        returns what the client needs to know about the engine."""
        cfg, tp, model_name, max_waiting, pg, use_gpu, step_timeout_s = self._start_args
        self.cluster = await asyncio.to_thread(
            RayEngineCluster, cfg, tp, pg=pg, use_gpu=use_gpu, step_timeout_s=step_timeout_s)
        self.client = LocalEngineClient(self.cluster.engine, model_name, max_waiting,
                                        recover=self._recover)
        c = self.client
        return {"model_name": c.model_name, "max_model_len": c.max_model_len,
                "vocab_size": c.vocab_size}

    def _recover(self, error: Exception) -> LLMEngine:
        log.warning("engine step failed (%s: %s); restarting its actors",
                    type(error).__name__, error)
        engine = self.cluster.restart()
        log.warning("engine actors restarted (%d restarts so far)", self.cluster.restarts)
        return engine

    async def generate(self, request_id: str, prompt_ids: list[int],
                       params: SamplingParams) -> AsyncIterator[RequestOutput]:
        async for out in self.client.generate(request_id, prompt_ids, params):
            yield out

    async def abort(self, request_id: str) -> None:
        await self.client.abort(request_id)

    def snapshot(self) -> EngineSnapshot:
        return self.client.snapshot()

    async def check_health(self) -> None:
        """Also probes the actors while no request runs: a death between requests would
        otherwise surface only as the next request's failure."""
        await self.client.check_health()
        if self.client.idle and not self._probing:
            self._probing = True
            try:
                await asyncio.to_thread(self.cluster.ping, PROBE_TIMEOUT_S)
            except Exception as e:
                reason = f"health probe failed: {type(e).__name__}: {e}"
                log.warning(reason)
                self.client.request_restart(reason)
                raise EngineDeadError(reason) from None
            finally:
                self._probing = False

    async def check_alive(self) -> None:
        await self.client.check_alive()

    def restarts(self) -> int:
        return self.cluster.restarts

    def actors(self) -> dict[str, list]:
        return self.cluster.actors()

    async def shutdown(self) -> None:
        if self.client is not None:
            await self.client.shutdown()
        if self.cluster is not None:
            self.cluster.shutdown()
