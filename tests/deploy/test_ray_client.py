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
        self.added = asyncio.get_running_loop().create_future()
        self.outputs: asyncio.Queue = asyncio.Queue()
        self.stream = Method(self._stream)
        self.check_alive = Method(lambda: self._answer(None))
        self.check_health = Method(lambda: self._answer(None))
        self.snapshot = Method(lambda: self._answer(None))
        self.add_many = Method(lambda requests: Ref(self.added))
        self.abort = Method(lambda request_id: self.aborted.append(request_id))

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
        driver.added.set_result(None)
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
        client._closing = True
        client._watchdog.cancel()

    asyncio.run(run())


def test_requests_abandoned_during_their_admission_are_aborted_after_it():
    async def run():
        driver = FakeDriver()
        client = RayEngineClient(driver, INFO, pg=None, owns_pg=False)
        task = asyncio.create_task(client.generate_many([request(0), request(1)]))
        await asyncio.sleep(0.01)  # the add is in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert driver.aborted == []  # not before the add has landed: it could overtake it
        driver.added.set_result(None)
        await asyncio.sleep(0.01)
        assert sorted(driver.aborted) == ["r0", "r1"] and not client._queues
        client._closing = True
        client._watchdog.cancel()
        client._reader.cancel()

    asyncio.run(run())
