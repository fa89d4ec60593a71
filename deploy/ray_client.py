"""`RayEngineClient`: the EngineClient of a Serve replica (or of `dflash-serve generate --tp N`),
over one driver actor (cluster/driver.py) that it starts in bundle 0 of the engine's placement
group: the replica's own group when Serve placed it with `placement_group_bundles`, else one it
creates and removes on shutdown.

Requests go in with one `add` call each; outputs come back for all requests together, one
batch per engine step, over the driver's `stream`, which one task here reads and hands out to
the requests' queues."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator

import ray
from ray._common.constants import RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR
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
    EngineRequest,
    EngineSnapshot,
    EngineStepError,
    RequestStream,
    RequestTiming,
    generate_one,
)
from cluster.ray_executor import (
    DEFAULT_STEP_TIMEOUT_S,
    engine_bundles,
    separate_draft,
)
from configs.engine import EngineConfig, SamplingParams

log = logging.getLogger(__name__)

DRIVER_NAME_PREFIX = "dflash-driver-"  # named, so operators can find it: ray list actors
# Serve's replica health check (check_alive): generous, so a busy driver is never replaced.
HEALTH_TIMEOUT_S = 90.0
# GET /health: an answer within this, else 503 (a load balancer's probe must not hang).
HEALTH_ANSWER_S = 5.0
# The replica asks its driver every DRIVER_WATCH_S whether it is alive; one that has not
# answered for DRIVER_LOST_S is frozen (stopped, or its event loop wedged): the requests in
# flight fail and a new driver starts, as when it dies.
DRIVER_WATCH_S = 5.0
DRIVER_LOST_S = 20.0
# Streams in flight per driver: its asyncio loop only forwards tokens, so this is generous.
DRIVER_MAX_CONCURRENCY = 4096


# Beyond the grace period, how long a drain may take to report back (its last step, the
# stopped requests' aborts) before the caller shuts down regardless.
DRAIN_MARGIN_S = 15.0
RESPAWN_ATTEMPTS = 2  # new drivers tried after one dies, before the replica gives up


def drain_engines(grace_s: float, force: threading.Event | None = None) -> list[dict]:
    """Graceful shutdown's first half for every engine of this Ray cluster (each replica's
    driver, found by name): no new requests (503), those in flight finish within grace_s or
    end with an error event. Returns each driver's counts (in_flight, finished, stopped), or
    {"error": …} for one that did not answer. `force` set: stop waiting at once."""
    refs, names = [], []
    for a in ray.util.list_named_actors(all_namespaces=True):
        if a["name"].startswith(DRIVER_NAME_PREFIX):
            with contextlib.suppress(Exception):  # gone meanwhile
                actor = ray.get_actor(a["name"], namespace=a["namespace"])
                refs.append(actor.drain.remote(grace_s))
                names.append(a["name"])
    deadline = time.monotonic() + grace_s + DRAIN_MARGIN_S
    pending = list(refs)
    while pending and time.monotonic() < deadline and not (force and force.is_set()):
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
    unanswered = ("not waited for: a second signal" if force and force.is_set()
                  else "no answer before the deadline")
    out = []
    for name, ref in zip(names, refs, strict=True):
        if ref in pending:
            out.append({"driver": name, "error": unanswered})
            continue
        try:
            out.append({"driver": name, **ray.get(ref)})
        except Exception as e:
            out.append({"driver": name, "error": f"{type(e).__name__}: {e}"[:300]})
    return out


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
    """If the driver dies, a new one starts in the same placement group (its actors died with
    it: Ray ends the actors an actor created when it dies). Requests in flight fail (503);
    new ones wait for the new driver, as they wait out an engine restart; /health is 503
    meanwhile and `check_alive` passes, so Serve does not replace the replica. If the new
    driver cannot start either, requests get 503, `check_alive` fails and Serve replaces the
    replica."""

    def __init__(self, driver, info: dict, pg, owns_pg: bool, spawn_args: tuple | None = None):
        self.driver = driver
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.channel: str = info["channel"]  # what carries the steps: "shm" | "tcp"
        self.pg, self.owns_pg = pg, owns_pg
        self._snapshot: EngineSnapshot | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._dead: Exception | None = None  # the stream broke: the driver is gone
        self._spawn_args = spawn_args  # EngineDriver's arguments, for a new driver
        self._respawning: asyncio.Task | None = None
        self._respawn_failed = False
        self._closing = False
        self.driver_restarts = 0
        self._lost: EngineDeadError | None = None  # why the watchdog cut the stream
        # Adds and aborts go to the driver from tasks of this client's own, never from a
        # request's: Ray cancels the calls a request's task made when Serve cancels it (its
        # client left), and an abort sent then would be cancelled with it.
        self._aborts: asyncio.Queue[str | list[str]] = asyncio.Queue()
        self._admissions: asyncio.Queue[tuple[list[EngineRequest], asyncio.Future]] = \
            asyncio.Queue()
        self._tasks: set[asyncio.Task] = set()
        self._abort_sender = asyncio.create_task(self._send_aborts())
        self._admitter = asyncio.create_task(self._admit_all())
        self._reader = asyncio.create_task(self._read_stream())
        self._watchdog = asyncio.create_task(self._watch_driver())

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
        args = (cfg, tp, model_name, max_waiting, pg, use_gpu, step_timeout_s)
        try:
            await pg.ready()
            driver, info = await cls._spawn(pg, args)
        except Exception as e:
            if owns_pg:
                remove_placement_group(pg)
            raise _unwrap(e) from None
        client = cls(driver, info, pg, owns_pg, args)
        await client.refresh()
        return client

    @staticmethod
    async def _spawn(pg, args: tuple):
        """A driver in bundle 0 of `pg`, started (its engine loaded and warm)."""
        driver = ray.remote(EngineDriver).options(
            name=f"{DRIVER_NAME_PREFIX}{uuid.uuid4().hex[:12]}", num_cpus=0,
            max_concurrency=DRIVER_MAX_CONCURRENCY, max_restarts=0,
            # Its blocking Ray calls run in threads (asyncio.to_thread, the engine thread),
            # never on its event loop; Ray's warning is process-wide, so off as Ray Train's
            # async controller has it (env_vars merge with the job's runtime_env).
            runtime_env={"env_vars": {RAY_WARN_BLOCKING_GET_INSIDE_ASYNC_ENV_VAR: "0"}},
            scheduling_strategy=PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0),
        ).remote(*args)
        try:
            return driver, await driver.start.remote()
        except BaseException:
            with contextlib.suppress(Exception):
                ray.kill(driver, no_restart=True)
            raise

    async def _respawn(self, cause: Exception) -> None:
        """A new driver for the one whose stream broke; requests get 503 meanwhile."""
        self._dead = EngineDeadError(f"the engine is restarting after its driver failed "
                                     f"({cause})")
        with contextlib.suppress(Exception):
            ray.kill(self.driver, no_restart=True)
        error: Exception | None = None
        for _ in range(RESPAWN_ATTEMPTS):
            try:
                driver, _info = await self._spawn(self.pg, self._spawn_args)
                break
            except Exception as e:
                error = _unwrap(e)
        else:
            self._respawn_failed = True
            self._dead = EngineDeadError(f"the engine driver failed ({cause}) and a new one "
                                         f"did not start: {error}")
            return
        self.driver, self.driver_restarts = driver, self.driver_restarts + 1
        self._dead = None
        self._reader = asyncio.create_task(self._read_stream())
        with contextlib.suppress(Exception):
            await self.refresh()

    async def _read_stream(self) -> None:
        # Backpressure of one batch: while this task is behind, the driver's batches
        # coalesce instead of queueing as Ray objects.
        stream = self.driver.stream.options(
            num_returns="streaming", _generator_backpressure_num_objects=1).remote()
        try:
            async for ref in stream:
                for request_id, item in await ref:
                    q = self._queues.get(request_id)
                    if q is not None:
                        q.put_nowait(item)
            error: Exception = EngineDeadError("the engine driver's stream ended")
        except asyncio.CancelledError:
            error = self._lost or EngineDeadError("the engine is shut down")
            self._lost = None
        except Exception as e:
            error = _unwrap(e)
            if not isinstance(error, EngineDeadError):
                error = EngineDeadError(f"the engine driver's stream failed: {error}")
        self._dead = error
        for q in self._queues.values():
            q.put_nowait(error)
        if not self._closing and self._spawn_args is not None:
            self._respawning = asyncio.create_task(self._respawn(error))

    async def _watch_driver(self) -> None:
        """Declares the driver lost once it stops answering: a frozen process never dies by
        itself, and its requests would wait forever. The stream is cut (the requests in flight
        fail with EngineDeadError) and a new driver starts."""
        while not self._closing:
            await asyncio.sleep(DRIVER_WATCH_S)
            driver = self.driver
            if self._dead is not None or self._reader.done():
                continue  # already lost: a new driver is starting
            try:
                await asyncio.wait_for(driver.check_alive.remote(), DRIVER_LOST_S)
            except TimeoutError:
                if driver is self.driver and not self._reader.done():
                    self._lost = EngineDeadError(f"the engine driver stopped answering (no "
                                                 f"answer for {DRIVER_LOST_S:.0f} s)")
                    self._reader.cancel()
            except Exception:
                pass  # dead, or failing check_alive: the stream and Serve's check handle it

    async def generate_many(self, requests: list[EngineRequest]) -> list[RequestStream]:
        """Admits the requests together, in one call to the driver (all or none)."""
        if self._respawning is not None and not self._respawning.done():
            # a new driver is starting: wait for it, as requests wait out an engine restart
            await asyncio.shield(self._respawning)
        if self._dead is not None:
            raise self._dead
        ids = [r.request_id for r in requests]
        for request_id in ids:
            if request_id in self._queues or ids.count(request_id) > 1:
                raise ValueError(f"request id {request_id!r} is already in use")
        queues = {request_id: asyncio.Queue() for request_id in ids}
        self._queues.update(queues)
        admitted = asyncio.get_running_loop().create_future()
        self._admissions.put_nowait((requests, admitted))
        try:
            await admitted
        except BaseException:  # refused, or the caller left
            for request_id in ids:
                self._queues.pop(request_id, None)
            if admitted.done() and not admitted.cancelled() and admitted.exception() is None:
                # added, but the caller was cancelled as the answer came: undo the add (one
                # that lands after the caller left, _admit undoes)
                self._aborts.put_nowait(ids)
            raise
        return [RequestStream(r.request_id, queues[r.request_id], self._stream_end, r.timing)
                for r in requests]

    async def _admit_all(self) -> None:
        """Sends each admission to the driver from a task of this client's own (see
        `_aborts`): a caller that leaves cancels only its wait, never the add."""
        while True:
            requests, admitted = await self._admissions.get()
            if not admitted.cancelled():
                self._keep(self._admit(requests, admitted))

    async def _admit(self, requests: list[EngineRequest], admitted: asyncio.Future) -> None:
        try:
            await self.driver.add_many.remote(
                [(r.request_id, list(r.prompt_ids), r.params) for r in requests])
        except Exception as e:
            if not admitted.done():
                admitted.set_exception(_unwrap(e))
            return
        if admitted.cancelled():  # its caller left while the driver added them
            self._aborts.put_nowait([r.request_id for r in requests])
        else:
            admitted.set_result(None)

    def _keep(self, coro) -> None:
        """`coro` as a task held until it ends (the loop holds tasks only weakly)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 timing: RequestTiming | None = None) -> AsyncIterator[RequestOutput]:
        return generate_one(self, EngineRequest(request_id, prompt_ids, params, timing))

    def _stream_end(self, request_id: str, early: bool) -> None:
        self._queues.pop(request_id, None)
        if early and self._dead is None:  # the consumer left early: stop its work
            self._aborts.put_nowait(request_id)

    async def _send_aborts(self) -> None:
        """Sends the aborts queued, a batch per call. An abort that overtakes its add (Ray
        does not order an async actor's calls) is kept by the driver, which ends the add when
        it comes."""
        while True:
            first = await self._aborts.get()
            ids = list(first) if isinstance(first, list) else [first]
            while not self._aborts.empty():
                more = self._aborts.get_nowait()
                ids += more if isinstance(more, list) else [more]
            try:
                await self.driver.abort_many.remote(ids)
            except Exception as e:  # a dead driver: its requests went with it
                log.debug("aborting %d requests failed: %s", len(ids), e)

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
        if self._dead is not None:
            raise self._dead
        await self._call("check_health", HEALTH_ANSWER_S)

    async def check_alive(self) -> None:
        """Passes while a new driver starts; fails once that failed."""
        if self._respawn_failed:
            raise self._dead
        if self._respawning is not None and not self._respawning.done():
            return
        await self._call("check_alive")

    async def shutdown(self) -> None:
        self._closing = True
        if self._respawning is not None:
            self._respawning.cancel()
        for task in (self._watchdog, self._abort_sender, self._admitter, *self._tasks):
            task.cancel()
        self._reader.cancel()
        try:
            await asyncio.wait_for(self.driver.shutdown.remote(), 60)
        except Exception:
            pass  # dead or stuck: the kill below ends it either way
        ray.kill(self.driver, no_restart=True)
        if self.owns_pg:
            remove_placement_group(self.pg)
