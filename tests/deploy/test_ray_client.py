"""RayEngineClient's own rules, over a stand-in for the driver actor (no Ray cluster): a driver
that stops answering is declared lost (its requests fail, /health says 503 without waiting for
it), and requests abandoned while their admission is in flight are aborted once it lands."""

from __future__ import annotations

import asyncio

import pytest

from cluster.engine import RequestOutput
from configs.engine import SamplingParams
from deploy import ray_client
from deploy.engine_client import EngineDeadError, EngineRequest
from deploy.ray_client import RayEngineClient


class Method:
    def __init__(self, fn):
        self.fn = fn

    def options(self, **_):
        return self

    def remote(self, *args):
        return self.fn(*args)


class Ref:
    """Like a Ray ObjectRef: each await waits on the task's result, and cancelling a waiter
    cancels the wait, not the task."""

    def __init__(self, result: asyncio.Future):
        self.result = result

    def __await__(self):
        return asyncio.shield(self.result).__await__()


class FakeDriver:
    """Answers what a driver answers; `frozen` stops every answer (a SIGSTOPped process)."""

    def __init__(self):
        self.frozen = False
        self.aborted: list[str] = []
        self.hold_adds = False  # adds in flight until `land_adds`
        self.adds: list[asyncio.Future] = []
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.stream = Method(self._stream)
        self.check_alive = Method(lambda: self._answer(None))
        self.check_health = Method(lambda: self._answer(None))
        self.snapshot = Method(lambda: self._answer(None))
        self.add_many = Method(self._add_many)
        self.abort_many = Method(lambda ids: self._answer(self.aborted.extend(ids)))

    def _add_many(self, requests) -> Ref:
        fut = asyncio.get_running_loop().create_future()
        self.adds.append(fut)
        if not self.hold_adds:
            fut.set_result(None)
        return Ref(fut)

    def land_adds(self) -> None:
        for fut in self.adds:
            if not fut.done():
                fut.set_result(None)

    def _answer(self, value):
        fut = asyncio.get_running_loop().create_future()
        if not self.frozen:
            fut.set_result(value)
        return fut

    async def _stream(self):
        while True:
            batch = await self.outputs.get()
            fut = asyncio.get_running_loop().create_future()
            fut.set_result(batch)
            yield fut


INFO = {"model_name": "m", "max_model_len": 64, "vocab_size": 320, "channel": "shm"}


def request(i: int) -> EngineRequest:
    return EngineRequest(f"r{i}", [1, 2, 3], SamplingParams(max_tokens=4))


def test_a_frozen_driver_is_declared_lost_and_health_never_hangs(monkeypatch):
    monkeypatch.setattr(ray_client, "DRIVER_WATCH_S", 0.05)
    monkeypatch.setattr(ray_client, "DRIVER_LOST_S", 0.3)
    monkeypatch.setattr(ray_client, "HEALTH_ANSWER_S", 0.1)

    async def run():
        driver = FakeDriver()
        client = RayEngineClient(driver, INFO, pg=None, owns_pg=False)
        (stream,) = await client.generate_many([request(0)])
        driver.outputs.put_nowait([("r0", RequestOutput("r0", [1, 2, 3], [7], [7], False, None,
                                                         []))])
        assert (await anext(stream)).new_token_ids == [7]
        driver.frozen = True
        with pytest.raises(EngineDeadError, match="did not answer check_health"):
            await client.check_health()  # within HEALTH_ANSWER_S, not the driver's time
        with pytest.raises(EngineDeadError, match="stopped answering"):
            await anext(stream)  # the watchdog cut the stream: the request fails
        with pytest.raises(EngineDeadError, match="stopped answering"):
            await client.check_health()
        stop(client)

    asyncio.run(run())


def test_requests_abandoned_during_their_admission_are_aborted():
    """Cancelled while the add is in flight: the add goes on (it runs in the client's own
    task, which Ray does not cancel with the request) and is undone once it lands; a request
    whose consumer leaves is aborted too."""
    async def run():
        driver = FakeDriver()
        client = RayEngineClient(driver, INFO, pg=None, owns_pg=False)
        driver.hold_adds = True
        task = asyncio.create_task(client.generate_many([request(0), request(1)]))
        await asyncio.sleep(0.01)  # the add is in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not client._queues
        driver.hold_adds = False
        driver.land_adds()  # the add lands after its caller left: it is undone
        await asyncio.sleep(0.01)
        assert sorted(driver.aborted) == ["r0", "r1"]
        (stream,) = await client.generate_many([request(2)])
        await stream.aclose()  # its consumer leaves
        await asyncio.sleep(0.01)
        assert driver.aborted[-1] == "r2"
        stop(client)

    asyncio.run(run())


def stop(client: RayEngineClient) -> None:
    client._closing = True
    for task in (client._watchdog, client._reader, client._abort_sender, client._admitter,
                 *client._tasks):
        task.cancel()


def test_requests_admitted_just_as_their_caller_leaves_are_aborted():
    """The driver took the requests, and the caller is cancelled before it resumes with the
    answer: the requests are aborted, not left running."""
    async def run():
        driver = FakeDriver()
        client = RayEngineClient(driver, INFO, pg=None, owns_pg=False)
        client._admitter.cancel()  # admissions answered here, by hand
        task = asyncio.create_task(client.generate_many([request(0), request(1)]))
        await asyncio.sleep(0)  # the caller waits for its admission
        _, admitted = client._admissions.get_nowait()
        admitted.set_result(None)  # added ...
        task.cancel()  # ... and the caller cancelled before it saw it
        with pytest.raises(asyncio.CancelledError):
            await task
        await asyncio.sleep(0.01)
        assert sorted(driver.aborted) == ["r0", "r1"] and not client._queues
        stop(client)

    asyncio.run(run())
