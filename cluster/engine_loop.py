"""`LocalEngineClient`: an `LLMEngine` driven by one background thread, with asyncio streams
per request. It serves the HTTP layer directly in process, and runs inside the Ray driver
actor (cluster/driver.py) for the cluster."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace

from cluster.engine import AcceptanceStats, LLMEngine, RequestOutput
from cluster.engine_types import (
    EngineDeadError,
    EngineOverloaded,
    EngineSnapshot,
    EngineStepError,
    RequestTiming,
)
from configs.engine import SamplingParams

log = logging.getLogger(__name__)


# ---- the in-process client -------------------------------------------------------------------


@dataclass
class _Stream:
    """The asyncio side of one request, fed from the engine thread."""

    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput | Exception
    timing: RequestTiming | None
    last: RequestOutput | None = None

    def put(self, item: RequestOutput | Exception) -> bool:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
            return True
        except RuntimeError:  # its event loop is closed: nobody listens any more
            return False


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    stream: _Stream


@dataclass
class _Abort:
    request_id: str
    done: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None


class _Stop:
    pass


@dataclass
class _Restart:
    reason: str


def _resolve(done: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None) -> None:
    if done is None:
        return
    loop, fut = done

    def set_done() -> None:
        if not fut.done():
            fut.set_result(None)

    try:
        loop.call_soon_threadsafe(set_done)
    except RuntimeError:
        pass


def _copy_stats(s: AcceptanceStats) -> AcceptanceStats:
    return AcceptanceStats(s.rounds, s.tokens, list(s.accepted_at), dict(s.lengths))


class LocalEngineClient:
    """One thread owns the engine (LLMEngine is not thread-safe): requests and aborts reach it
    through a queue; it steps while any request is in flight and sleeps on the queue otherwise.
    `max_waiting` bounds the requests submitted but not yet producing tokens (None: no bound).
    `recover`, when given, is called (on the engine thread) after a failed step has failed the
    requests in flight, and returns the engine to continue with; if it raises, the client is
    dead. New requests queue meanwhile; `check_health` reports the restart."""

    def __init__(self, engine: LLMEngine, model_name: str, max_waiting: int | None = None,
                 recover: Callable[[Exception], LLMEngine] | None = None):
        if max_waiting is not None and max_waiting <= 0:
            raise ValueError(f"max_waiting must be positive or None, got {max_waiting}")
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.target_config.vocab_size
        self.max_waiting = max_waiting
        self.recover = recover
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Stop | _Restart] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _closed and _num_waiting
        self._closed = False
        self._num_waiting = 0
        self._fatal: str | None = None  # why the loop died
        self._unhealthy: str | None = None
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._publish()
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._thread.start()

    # ---- asyncio side -----------------------------------------------------------------------

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                       timing: RequestTiming | None = None) -> AsyncIterator[RequestOutput]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), timing)
        with self._lock:
            if self._closed:
                raise EngineDeadError(self._fatal or "the engine is shut down")
            if self.max_waiting is not None and self._num_waiting >= self.max_waiting:
                raise EngineOverloaded(
                    f"{self._num_waiting} requests are already waiting; retry later")
            self._num_waiting += 1
            self._inbox.put(_Add(request_id, list(prompt_ids), params, stream))
        waiting, done = True, False
        try:
            while not done:
                item = await stream.queue.get()
                if waiting:
                    waiting = False
                    self._leave_waiting()
                if isinstance(item, Exception):
                    done = True
                    raise item
                done = item.finished
                yield item
        finally:
            if waiting:
                self._leave_waiting()
            if not done:  # the consumer left early (disconnect, stop string, cancellation)
                self._inbox.put(_Abort(request_id))

    def _leave_waiting(self) -> None:
        with self._lock:
            self._num_waiting -= 1

    async def abort(self, request_id: str) -> None:
        """Returns once the engine has dropped the request and freed its pages and slot."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._lock:
            if self._closed:
                return
            self._inbox.put(_Abort(request_id, (loop, fut)))
        await fut

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot  # replaced whole by the engine thread, never mutated

    async def refresh(self) -> None:
        pass

    @property
    def idle(self) -> bool:
        return not self._streams and self._snapshot.waiting == 0

    def request_restart(self, reason: str) -> None:
        """Fails the requests in flight and restarts the engine through `recover` (e.g. a
        health probe found a dead actor while no step was running to notice)."""
        if self.recover is None:
            raise RuntimeError("this client has no recover hook")
        with self._lock:
            if not self._closed:
                self._inbox.put(_Restart(reason))

    async def check_health(self) -> None:
        await self.check_alive()
        if self._unhealthy is not None:
            raise EngineDeadError(self._unhealthy)

    async def check_alive(self) -> None:
        """Like check_health, but passes while a restart is under way: for supervisors that
        would otherwise replace a process that is recovering by itself."""
        if self._fatal is not None:
            raise EngineDeadError(f"the engine loop died: {self._fatal}")
        if self._closed or not self._thread.is_alive():
            raise EngineDeadError("the engine is shut down")

    async def shutdown(self) -> None:
        await asyncio.to_thread(self.close)

    def close(self) -> None:
        """Fails the requests in flight with EngineDeadError and joins the engine thread."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._inbox.put(_Stop())
        self._thread.join()

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as e:  # a bug in the loop itself: fail loudly, never hang callers
            log.exception("engine loop died")
            self._fatal = f"{type(e).__name__}: {e}"
            with self._lock:
                self._closed = True
            self._fail_all(lambda: EngineDeadError(f"the engine loop died: {self._fatal}"))

    def _loop(self) -> None:
        while True:
            # Block on the queue when idle (no busy spin); drain it between steps otherwise.
            cmds = [] if self._streams else [self._inbox.get()]
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if isinstance(cmd, _Stop):
                    self._fail_all(lambda: EngineDeadError("the engine is shut down"))
                    return
                if isinstance(cmd, _Add):
                    self._add(cmd)
                elif isinstance(cmd, _Restart):
                    self._fail_and_recover(RuntimeError(cmd.reason), cmd.reason)
                else:
                    self._abort(cmd)
            if self._streams:
                self._step()
            self._publish()

    def _add(self, cmd: _Add) -> None:
        if cmd.request_id in self._streams:
            cmd.stream.put(ValueError(f"request id {cmd.request_id!r} is already in use"))
            return
        try:
            self.engine.add_request(cmd.prompt_ids, cmd.params, cmd.request_id)
        except ValueError as e:
            cmd.stream.put(e)
            return
        self._streams[cmd.request_id] = cmd.stream

    def _abort(self, cmd: _Abort) -> None:
        stream = self._streams.pop(cmd.request_id, None)
        if stream is not None:
            self._engine_abort(cmd.request_id)
            last = stream.last or RequestOutput(cmd.request_id, [], [], [], False, None, [])
            stream.put(replace(last, new_token_ids=[], finished=True, finish_reason="abort"))
        _resolve(cmd.done)

    def _engine_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("aborting %s failed", request_id)
            self._unhealthy = f"aborting {request_id} failed; the engine may hold stale state"

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as e:
            log.exception("engine step failed")
            self._fail_and_recover(e, f"engine step failed: {type(e).__name__}: {e}")
            return
        self._publish()  # before the outputs: a caller seeing its last token sees it counted
        now = time.monotonic()
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.finished:
                del self._streams[out.request_id]
            if stream.timing is not None:
                if out.new_token_ids:
                    stream.timing.record(len(out.new_token_ids), now)
                if out.finished:
                    stream.timing.finished = now
            stream.last = out
            if not stream.put(out) and not out.finished:
                self._streams.pop(out.request_id, None)
                self._engine_abort(out.request_id)

    def _fail_and_recover(self, error: Exception, msg: str) -> None:
        for request_id, stream in list(self._streams.items()):
            if self.recover is None:  # a restart drops the engine's state wholesale
                self._engine_abort(request_id)
            stream.put(EngineStepError(msg))
        self._streams.clear()
        if self.recover is not None:
            self._unhealthy = f"restarting the engine after: {msg}"
            self._publish()
            self.engine = self.recover(error)  # raising here kills the loop: _run fails all
            self._unhealthy = None

    def _fail_all(self, error) -> None:
        for stream in self._streams.values():
            stream.put(error())
        self._streams.clear()
        while True:  # commands that raced with the stop
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                cmd.stream.put(error())
            elif isinstance(cmd, _Abort):
                _resolve(cmd.done)
        self._publish()

    def _publish(self) -> None:
        sched = self.engine.scheduler
        self._snapshot = EngineSnapshot(
            running=len(sched.running), waiting=len(sched.waiting),
            cache_usage=self.engine.blocks.usage, acceptance=_copy_stats(self.engine.stats),
            draft_time_per_round=(self.engine.draft_time.snapshot()
                                  if self.engine.drafter is not None else None),
            verify_time_per_round=self.engine.verify_time.snapshot())
