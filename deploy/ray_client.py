"""`RayEngineClient`: the EngineClient of a Serve replica (or of `dflash-serve generate --tp N`),
over one driver actor (cluster/driver.py) that it starts in bundle 0 of the engine's placement
group: the replica's own group when Serve placed it with `placement_group_bundles`, else one it
creates and removes on shutdown."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import (
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.driver import EngineDriver
from cluster.engine import RequestOutput
from cluster.engine_types import (
    EngineDeadError,
    EngineSnapshot,
    EngineStepError,
    RequestTiming,
)
from cluster.ray_executor import (
    DEFAULT_STEP_TIMEOUT_S,
    engine_bundles,
    separate_draft,
)
from configs.engine import EngineConfig, SamplingParams

DRIVER_NAME_PREFIX = "dflash-driver-"  # named, so operators can find it: ray list actors
HEALTH_TIMEOUT_S = 90.0  # above the driver's own probe timeout
# Streams in flight per driver: its asyncio loop only forwards tokens, so this is generous.
DRIVER_MAX_CONCURRENCY = 4096


def _unwrap(e: Exception) -> Exception:
    """Exceptions raised in the driver arrive wrapped; hand the HTTP layer the original (its
    type picks the status code, its message is what the user reads)."""
    if isinstance(e, RayActorError):
        return EngineDeadError(f"the engine driver died: {e}")
    if isinstance(e, RayTaskError):
        cause = getattr(e, "cause", None)
        return cause if isinstance(cause, Exception) else EngineStepError(str(e))
    return e


class RayEngineClient:
    def __init__(self, driver, info: dict, pg, owns_pg: bool):
        self.driver = driver
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.pg, self.owns_pg = pg, owns_pg
        self._snapshot: EngineSnapshot | None = None

    @classmethod
    async def start(cls, cfg: EngineConfig, tp: int, model_name: str,
                    max_waiting: int | None = None, use_gpu: bool | None = None,
                    step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S) -> RayEngineClient:
        """Places the driver and waits until the engine has loaded (raises what it raised)."""
        use_gpu = cfg.device.startswith("cuda") if use_gpu is None else use_gpu
        pg = get_current_placement_group()  # a Serve replica's own, when placed with bundles
        owns_pg = pg is None
        if owns_pg:
            pg = placement_group(engine_bundles(tp, use_gpu, separate_draft(cfg)),
                                 strategy="STRICT_PACK")
        try:
            await pg.ready()
            driver = ray.remote(EngineDriver).options(
                name=f"{DRIVER_NAME_PREFIX}{uuid.uuid4().hex[:12]}", num_cpus=0,
                max_concurrency=DRIVER_MAX_CONCURRENCY, max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pg, placement_group_bundle_index=0),
            ).remote(cfg, tp, model_name, max_waiting, pg, use_gpu, step_timeout_s)
            info = await driver.start.remote()
        except Exception as e:
            if owns_pg:
                remove_placement_group(pg)
            raise _unwrap(e) from None
        client = cls(driver, info, pg, owns_pg)
        await client.refresh()
        return client

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       timing: RequestTiming | None = None) -> AsyncIterator[RequestOutput]:
        stream = self.driver.generate.options(num_returns="streaming").remote(
            request_id, list(prompt_ids), params)
        done = False
        try:
            async for ref in stream:
                try:
                    out: RequestOutput = await ref
                except Exception as e:
                    done = True  # the driver side has ended the request already
                    raise _unwrap(e) from None
                if timing is not None:
                    now = time.monotonic()
                    if out.new_token_ids:
                        timing.record(len(out.new_token_ids), now)
                    if out.finished:
                        timing.finished = now
                done = out.finished
                yield out
        finally:
            if not done:  # the consumer left early: stop the engine work now
                self.driver.abort.remote(request_id)

    async def abort(self, request_id: str) -> None:
        try:
            await self.driver.abort.remote(request_id)
        except Exception as e:
            raise _unwrap(e) from None

    def snapshot(self) -> EngineSnapshot:
        if self._snapshot is None:
            raise EngineDeadError("no snapshot yet")
        return self._snapshot

    async def refresh(self) -> None:
        try:
            self._snapshot = await self.driver.snapshot.remote()
        except Exception as e:
            raise _unwrap(e) from None

    async def _call(self, method: str, timeout_s: float = HEALTH_TIMEOUT_S):
        try:
            return await asyncio.wait_for(getattr(self.driver, method).remote(), timeout_s)
        except TimeoutError:
            raise EngineDeadError(f"the engine driver did not answer {method} within "
                                  f"{timeout_s:.0f} s") from None
        except Exception as e:
            raise _unwrap(e) from None

    async def check_health(self) -> None:
        await self._call("check_health")

    async def check_alive(self) -> None:
        await self._call("check_alive")

    async def shutdown(self) -> None:
        try:
            await asyncio.wait_for(self.driver.shutdown.remote(), 60)
        except Exception:
            pass  # dead or stuck: the kill below ends it either way
        ray.kill(self.driver, no_restart=True)
        if self.owns_pg:
            remove_placement_group(self.pg)
