"""`LocalEngineClient`: an `LLMEngine` driven by one background thread. It serves the HTTP layer
directly in process (asyncio streams per request, `generate`), and runs inside the Ray driver
actor (cluster/driver.py), which takes each step's outputs for all requests at once
(`submit` with a delivery callback, and the `after_step` hook).

Each step is begun (the actors start on it), then the previous step's outputs are delivered
to their requests, then the step is finished: the delivery costs the round nothing."""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from functools import partial

from cluster.engine import AcceptanceStats, LLMEngine, RequestOutput
from cluster.engine_types import (
    EngineDeadError,
    EngineDraining,
    EngineOverloaded,
    EngineRequest,
    EngineSnapshot,
    EngineStepError,
    RequestStream,
    RequestTiming,
    generate_one,
    request_failed,
)
from configs.engine import SamplingParams

log = logging.getLogger(__name__)

# Delivers one output (or the exception that ends the request); False: nobody listens any more.
Deliver = Callable[[RequestOutput | Exception], bool]
# Aborts of requests the engine thread has not seen (yet): an add that arrives after its abort
# (the driver actor may run the two calls in either order) ends at once. At most this many are
# remembered; the oldest are forgotten first.
MAX_EARLY_ABORTS = 4096


@dataclass
class _Request:
    """The engine thread's record of one request in flight."""

    request_id: str
    deliver: Deliver
    timing: RequestTiming | None
    waiting: bool = True  # counted in _num_waiting until its first output (or its end)
    last: RequestOutput | None = None
    # What it was submitted with, to run it again on a restarted engine if the failure came
    # before it streamed anything (once: `retried`).
    prompt_ids: list[int] | None = None
    params: SamplingParams | None = None
    retried: bool = False


@dataclass
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    request: _Request


@dataclass
class _Abort:
    request_id: str
    done: Callable[[], None] | None = None


@dataclass
class _Call:
    """fn() on the engine thread between steps (e.g. a probe that writes the control
    channel, which only this thread may)."""

    fn: Callable[[], object]
    done: Callable[[object], None]


class _Stop:
    pass


@dataclass
class _Restart:
    reason: str


def _threadsafe(loop: asyncio.AbstractEventLoop, fn: Callable, *args) -> bool:
    try:
        loop.call_soon_threadsafe(fn, *args)
        return True
    except RuntimeError:  # its event loop is closed: nobody listens any more
        return False


def _copy_stats(s: AcceptanceStats) -> AcceptanceStats:
    return AcceptanceStats(s.rounds, s.tokens, list(s.accepted_at), dict(s.lengths),
                           s.draft_tokens, dict(s.draft_lengths))


class LocalEngineClient:
    """One thread owns the engine (LLMEngine is not thread-safe): requests, aborts and calls
    reach it through a queue; it steps while any request is in flight and sleeps on the queue
    otherwise. `max_waiting` bounds the requests submitted but not yet producing tokens (None:
    no bound). `recover`, when given, is called (on the engine thread) after a failed step has
    failed the requests in flight, and returns the engine to continue with; if it raises, the
    client is dead. New requests queue meanwhile; `check_health` reports the restart.
    `after_step` runs on the engine thread after each step's outputs are delivered."""

    def __init__(self, engine: LLMEngine, model_name: str, max_waiting: int | None = None,
                 recover: Callable[[Exception], LLMEngine] | None = None,
                 after_step: Callable[[], None] | None = None):
        if max_waiting is not None and max_waiting <= 0:
            raise ValueError(f"max_waiting must be positive or None, got {max_waiting}")
        self.engine = engine
        self.model_name = model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.target_config.vocab_size
        self.max_waiting = max_waiting
        self.recover = recover
        self.after_step = after_step
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _closed and _num_waiting
        self._closed = False
        self._draining = False  # drain(): no new requests
        self._num_waiting = 0
        self._fatal: str | None = None  # why the loop died
        self._unhealthy: str | None = None
        self._requests: dict[str, _Request] = {}  # engine thread only
        self._early_aborts: OrderedDict[str, None] = OrderedDict()  # engine thread only
        self._finished: dict[str, int] = {}  # engine thread only: ended requests, by how
        self._publish()
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._thread.start()

    # ---- any thread ---------------------------------------------------------------------------

    def submit_many(self, requests: list[tuple[EngineRequest, Deliver]]) -> None:
        """Queues requests together (the choices of one API request): all of them are admitted
        or none. Each one's outputs (then, on failure, an exception) go to its `deliver` on the
        engine thread. Raises EngineDeadError, EngineDraining or EngineOverloaded at once. A
        group larger than `max_waiting` is admitted when nothing else waits."""
        with self._lock:
            if self._closed:
                raise EngineDeadError(self._fatal or "the engine is shut down")
            if self._draining:
                raise EngineDraining("the server is shutting down and takes no new requests")
            k = len(requests)
            if (self.max_waiting is not None and self._num_waiting > 0
                    and self._num_waiting + k > self.max_waiting):
                brings = "" if k == 1 else f" and this one brings {k} choices"
                raise EngineOverloaded(
                    f"{self._num_waiting} requests are already waiting{brings}; retry later")
            self._num_waiting += k
            for r, deliver in requests:
                ids = list(r.prompt_ids)
                self._inbox.put(_Add(r.request_id, ids, r.params,
                                     _Request(r.request_id, deliver, r.timing, prompt_ids=ids,
                                              params=r.params)))

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               deliver: Deliver, timing: RequestTiming | None = None) -> None:
        self.submit_many([(EngineRequest(request_id, prompt_ids, params, timing), deliver)])

    def cancel(self, request_id: str, done: Callable[[], None] | None = None) -> None:
        """Drops the request (its last output says finish_reason "abort"); `done` runs on the
        engine thread once its pages and slot are free."""
        with self._lock:
            if self._closed:
                if done is not None:
                    done()
                return
            self._inbox.put(_Abort(request_id, done))

    # ---- asyncio side -----------------------------------------------------------------------

    async def generate_many(self, requests: list[EngineRequest]) -> list[RequestStream]:
        """Admits the requests together (`submit_many`); a stream for each, in order."""
        loop = asyncio.get_running_loop()
        queues = [asyncio.Queue() for _ in requests]
        self.submit_many([(r, partial(_threadsafe, loop, q.put_nowait))
                          for r, q in zip(requests, queues, strict=True)])
        return [RequestStream(r.request_id, q, self._stream_end)
                for r, q in zip(requests, queues, strict=True)]

    def _stream_end(self, request_id: str, early: bool) -> None:
        if early:  # the consumer left (disconnect, stop string, cancellation)
            self.cancel(request_id)

    def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                 timing: RequestTiming | None = None) -> AsyncIterator[RequestOutput]:
        return generate_one(self, EngineRequest(request_id, prompt_ids, params, timing))

    async def abort(self, request_id: str) -> None:
        """Returns once the engine has dropped the request and freed its pages and slot."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self.cancel(request_id, lambda: _threadsafe(
            loop, lambda: fut.done() or fut.set_result(None)))
        await fut

    async def call(self, fn: Callable[[], object]) -> object:
        """fn() on the engine thread, between two steps; its result or exception."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()

        def done(result: object) -> None:
            def settle() -> None:
                if fut.done():
                    return
                if isinstance(result, BaseException):
                    fut.set_exception(result)
                else:
                    fut.set_result(result)
            _threadsafe(loop, settle)

        with self._lock:
            if self._closed:
                raise EngineDeadError(self._fatal or "the engine is shut down")
            self._inbox.put(_Call(fn, done))
        return await fut

    def snapshot(self) -> EngineSnapshot:
        return self._snapshot  # replaced whole by the engine thread, never mutated

    async def refresh(self) -> None:
        pass

    @property
    def idle(self) -> bool:
        return not self._requests and self._snapshot.waiting == 0

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
        if self._draining:
            raise EngineDraining("the server is shutting down")
        if self._unhealthy is not None:
            raise EngineDeadError(self._unhealthy)

    async def drain(self, grace_s: float, poll_s: float = 0.05) -> dict[str, int]:
        """Graceful shutdown's first half: from now on `submit` raises EngineDraining (HTTP
        503, as does check_health); the requests in flight run on for up to `grace_s`
        seconds, and any still running then end with EngineDraining (a stream gets an error
        event and [DONE]) and are dropped from the engine. Returns how many were in flight,
        how many finished and how many were stopped. The engine keeps running (shutdown
        stops it)."""
        with self._lock:
            self._draining = True
        deadline = time.monotonic() + grace_s
        in_flight = await self.call(lambda: len(self._requests))
        while time.monotonic() < deadline and await self.call(self._busy):
            await asyncio.sleep(poll_s)
        stopped = await self.call(self._stop_all)
        return {"in_flight": in_flight, "finished": in_flight - stopped, "stopped": stopped}

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

    def _busy(self) -> bool:
        return bool(self._requests) or self.engine.has_unfinished()

    def _loop(self) -> None:
        pending: list[tuple[_Request, RequestOutput]] = []  # the last step's, undelivered
        while True:
            # Block on the queue when idle (no busy spin); drain it between steps otherwise.
            cmds = [] if self._busy() or pending else [self._inbox.get()]
            while True:
                try:
                    cmds.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            for cmd in cmds:
                if isinstance(cmd, _Stop):
                    self._deliver(pending)
                    self._fail_all(lambda: EngineDeadError("the engine is shut down"))
                    return
                if isinstance(cmd, _Restart):
                    self._deliver(pending)
                    pending = []
                    self._fail_and_recover(RuntimeError(cmd.reason), cmd.reason)
                    continue
                try:
                    if isinstance(cmd, _Add):
                        self._add(cmd)
                    elif isinstance(cmd, _Abort):
                        self._abort(cmd)
                    else:
                        self._call(cmd)
                except Exception as e:  # one request's command: it fails alone, never the loop
                    self._command_failed(cmd, e)
            began = False
            if pending and getattr(self.engine.executor, "runs_on_submit", False):
                self._deliver(pending)  # an executor in this thread: not a step later
                pending = []
            if self._busy():
                try:
                    began = self.engine.begin_step()
                except Exception as e:
                    self._deliver(pending)
                    pending = []
                    self._step_failed(e)
                    continue
            self._deliver(pending)  # while the actors work on the step just begun
            pending = []
            if began:
                try:
                    pending = self._finish()
                except Exception as e:
                    self._step_failed(e)
            self._publish()

    def _add(self, cmd: _Add) -> None:
        req = cmd.request
        if cmd.request_id in self._early_aborts:  # its abort came first
            del self._early_aborts[cmd.request_id]
            self._end(req, RequestOutput(cmd.request_id, cmd.prompt_ids, [], [], True, "abort",
                                         []))
            return
        if cmd.request_id in self._requests:
            self._end(req, ValueError(f"request id {cmd.request_id!r} is already in use"))
            return
        try:
            self.engine.add_request(cmd.prompt_ids, cmd.params, cmd.request_id)
        except ValueError as e:
            self._end(req, e)
            return
        self._requests[cmd.request_id] = req

    def _abort(self, cmd: _Abort) -> None:
        req = self._requests.pop(cmd.request_id, None)
        if req is not None:
            self._engine_abort(cmd.request_id)
            last = req.last or RequestOutput(cmd.request_id, [], [], [], False, None, [])
            self._end(req, replace(last, new_token_ids=[], new_logprobs=None,
                                   prompt_logprobs=None, finished=True, finish_reason="abort"))
        else:  # not added yet (or finished already): an add that comes later ends at once
            self._early_aborts[cmd.request_id] = None
            if len(self._early_aborts) > MAX_EARLY_ABORTS:
                self._early_aborts.popitem(last=False)
        if cmd.done is not None:
            cmd.done()

    def _command_failed(self, cmd: _Add | _Abort | _Call, error: Exception) -> None:
        """A command raised: its request (or caller) gets the error; the loop goes on."""
        log.exception("engine command %s failed", type(cmd).__name__)
        if isinstance(cmd, _Add):
            self._requests.pop(cmd.request_id, None)
            self._end(cmd.request, EngineStepError(
                f"request {cmd.request_id!r} failed in the engine ({type(error).__name__}: "
                f"{error}); other requests were not affected"))
        elif isinstance(cmd, _Abort) and cmd.done is not None:
            cmd.done()
        elif isinstance(cmd, _Call):
            cmd.done(error)

    def _call(self, cmd: _Call) -> None:
        try:
            result = cmd.fn()
        except Exception as e:
            result = e
        cmd.done(result)

    def _engine_abort(self, request_id: str) -> None:
        try:
            self.engine.abort(request_id)
        except Exception:
            log.exception("aborting %s failed", request_id)
            self._unhealthy = f"aborting {request_id} failed; the engine may hold stale state"

    def _finish(self) -> list[tuple[_Request, RequestOutput]]:
        """The step's outputs, each with its request; finished requests leave the table now,
        so an abort racing with their last output finds nothing to abort."""
        out = []
        for o in self.engine.finish_step():
            req = self._requests.get(o.request_id)
            if req is None:
                continue
            if o.finished:
                del self._requests[o.request_id]
            out.append((req, o))
        return out

    def _deliver(self, pending: list[tuple[_Request, RequestOutput]]) -> None:
        now = time.monotonic()
        for req, out in pending:
            if req.timing is not None:
                if out.new_token_ids:
                    req.timing.record(len(out.new_token_ids), now)
                if out.finished:
                    req.timing.finished = now
            req.last = out
            if out.finished:
                self._count_end(out)
            self._left_waiting(req)
            # a request that failed alone in the step (finish reason "error") gets its error
            item = request_failed(out.request_id, out.error) if out.finish_reason == "error" \
                else out
            if not req.deliver(item) and not out.finished:
                self._requests.pop(out.request_id, None)  # nobody listens: stop its work
                self._engine_abort(out.request_id)
        if pending and self.after_step is not None:
            self.after_step()

    def _end(self, req: _Request, item: RequestOutput | Exception) -> None:
        self._count_end(item)
        self._left_waiting(req)
        req.deliver(item)
        if self.after_step is not None:
            self.after_step()

    def _count_end(self, item: RequestOutput | Exception) -> None:
        how = item.finish_reason if isinstance(item, RequestOutput) else "error"
        how = how if how in ("stop", "length", "abort") else "error"
        self._finished[how] = self._finished.get(how, 0) + 1

    def _left_waiting(self, req: _Request) -> None:
        if req.waiting:
            req.waiting = False
            with self._lock:
                self._num_waiting -= 1

    def _step_failed(self, error: Exception) -> None:
        log.exception("engine step failed")
        self._fail_and_recover(error, f"engine step failed: {type(error).__name__}: {error}")

    def _fail_and_recover(self, error: Exception, msg: str) -> None:
        """Fails the requests in flight; with `recover`, restarts the engine and runs the
        requests that had streamed nothing yet again on it (each once: a request that fails
        the engine twice fails), as requests arriving during the restart are."""
        again = []
        for request_id, req in list(self._requests.items()):
            if self.recover is None:  # a restart drops the engine's state wholesale
                self._engine_abort(request_id)
            elif req.last is None and not req.retried and req.prompt_ids is not None:
                again.append(req)
                continue
            self._end(req, EngineStepError(msg))
        self._requests.clear()
        if self.recover is not None:
            self._unhealthy = f"restarting the engine after: {msg}"
            self._publish()
            try:
                self.engine = self.recover(error)  # raising here kills the loop: _run fails all
            except BaseException:
                for req in again:
                    self._end(req, EngineStepError(msg))
                raise
            self._unhealthy = None
            for req in again:
                req.retried = True
                self._add(_Add(req.request_id, req.prompt_ids, req.params, req))

    def _stop_all(self) -> int:
        n = len(self._requests)
        for request_id, req in list(self._requests.items()):
            self._engine_abort(request_id)
            self._end(req, EngineDraining(
                "the server is shutting down: the request was stopped before it finished"))
        self._requests.clear()
        self._publish()
        return n

    def _fail_all(self, error) -> None:
        for req in self._requests.values():
            self._end(req, error())
        self._requests.clear()
        while True:  # commands that raced with the stop
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                break
            if isinstance(cmd, _Add):
                self._end(cmd.request, error())
            elif isinstance(cmd, _Abort) and cmd.done is not None:
                cmd.done()
            elif isinstance(cmd, _Call):
                cmd.done(error())
        self._publish()

    def _publish(self) -> None:
        sched = self.engine.scheduler
        self._snapshot = EngineSnapshot(
            running=len(sched.running), waiting=len(sched.waiting),
            cache_usage=self.engine.blocks.usage, acceptance=_copy_stats(self.engine.stats),
            draft_time_per_round=(self.engine.draft_time.snapshot()
                                  if self.engine.has_draft else None),
            verify_time_per_round=self.engine.verify_time.snapshot(),
            step_time={k: v.snapshot() for k, v in self.engine.step_time.items()},
            finished=dict(self._finished), prefix_cache=self.engine.prefix_snapshot())
