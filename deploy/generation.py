"""One API request's choices while they run: each choice's engine stream turned into text
deltas (`Generation`), the choices merged as they come, and every way a request can end (an
error, the client leaving, the handler cancelled, the response closed) aborting the engine
requests still running."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from contextlib import aclosing, suppress
from typing import TypeVar

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.requests import ClientDisconnect

from deploy.detokenizer import TextStream
from deploy.engine_client import RequestStream, RequestTiming
from deploy.protocol import PromptTokensDetails, Usage
from workers.logprobs import TokenLogprob

T = TypeVar("T")


class Generation:
    """One choice's stream of (text delta, token ids, their log-probabilities, finish
    reason). `echo_only` (max_tokens 0 with echo): the engine generates one token for the
    prompt's log-probabilities, and the choice reports none."""

    def __init__(self, stream: RequestStream, prompt_ids: list[int], text: TextStream,
                 timing: RequestTiming, echo_only: bool = False):
        self.prompt_ids = prompt_ids
        self.text = text
        self.timing = timing
        self.echo_only = echo_only
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprob] = []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.prompt_owner: Generation = self  # the choice that brings the prompt's logprobs
        self.finish_reason: str | None = None
        # a chat's output parser (reasoning, tool calls: deploy/tool_calls.py); None: plain text
        self.parser = None
        self._stream = stream
        self._first = None

    async def start(self) -> None:
        """Waits for the first output, so request errors surface before any response."""
        try:
            self._first = await anext(self._stream)
            self.prompt_logprobs = self._first.prompt_logprobs
        except BaseException:
            await self._stream.aclose()
            raise

    async def close(self) -> None:
        await self._stream.aclose()  # aborts the engine request if it is still running

    async def deltas(self) -> AsyncIterator[tuple[str, list[int], list[TokenLogprob],
                                                  str | None]]:
        out = self._first
        try:
            if self.echo_only:
                while not out.finished:
                    out = await anext(self._stream)
                self.finish_reason = "length" if out.finish_reason != "abort" else "abort"
                yield "", [], [], self.finish_reason
                return
            while True:
                kept = self.text.add(out.new_token_ids)
                ids, lps = out.new_token_ids[:kept], (out.new_logprobs or [])[:kept]
                self.token_ids += ids
                self.logprobs += lps
                done = self.text.stopped or out.finished
                delta = self.text.release(final=done)  # may still meet a stop string
                if done:
                    self.finish_reason = "stop" if self.text.stopped else out.finish_reason
                    yield delta, ids, lps, self.finish_reason
                    return
                if delta or ids:
                    yield delta, ids, lps, None
                out = await anext(self._stream)
        finally:
            await self.close()

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens the engine's prefix cache spared (not prefilled)."""
        return self._first.num_cached_tokens if self._first is not None else 0


def prompts_of(gens: list[Generation]) -> list[list[int]]:
    """The distinct prompts (a prompt's n choices share its one id list)."""
    return list({id(g.prompt_ids): g.prompt_ids for g in gens}.values())


def usage(gens: list[Generation]) -> Usage:
    """Each prompt counts once however many choices it has; every choice's tokens count. A
    prompt's cached tokens are the fewest any of its choices had from the prefix cache."""
    n = sum(map(len, prompts_of(gens)))
    m = sum(g.completion_tokens for g in gens)
    cached: dict[int, int] = {}
    for g in gens:
        cached[id(g.prompt_ids)] = min(cached.get(id(g.prompt_ids), g.cached_tokens),
                                       g.cached_tokens)
    return Usage(prompt_tokens=n, completion_tokens=m, total_tokens=n + m,
                 prompt_tokens_details=PromptTokensDetails(cached_tokens=sum(cached.values())))


async def start_all(gens: list[Generation]) -> None:
    """Starts every choice; if one fails, the others are aborted and its error raised."""
    results = await asyncio.gather(*(g.start() for g in gens), return_exceptions=True)
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        await close_all(gens)
        raise failed[0]
    for g in gens:  # a prompt's log-probabilities come with its first choice only
        g.prompt_logprobs = g.prompt_owner.prompt_logprobs


async def merged(gens: list[Generation]) -> AsyncIterator[tuple[int, tuple]]:
    """Every choice's deltas as they come, tagged with the choice's index. A choice that
    raises raises here; closing this closes (aborts) every choice still running."""
    if len(gens) == 1:
        async with aclosing(gens[0].deltas()) as deltas:
            async for item in deltas:
                yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async with aclosing(gen.deltas()) as deltas:
                async for item in deltas:
                    await queue.put((i, item))
            await queue.put((i, done))
        except Exception as e:
            await queue.put((i, e))

    tasks = [asyncio.ensure_future(pump(i, g)) for i, g in enumerate(gens)]
    try:
        running = len(tasks)
        while running:
            i, item = await queue.get()
            if item is done:
                running -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        # a pump cancelled before it ran never closed its choice: close every one here
        await close_all(gens)
        await asyncio.gather(*tasks, return_exceptions=True)


async def close_all(gens: list[Generation]) -> None:
    """Aborts every choice still running. It never suspends (closing a stream only sends the
    abort), so a cancellation cannot cut it short."""
    for g in gens:
        await g.close()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Awaits `work`, or cancels it (aborting the engine request) and raises ClientDisconnect
    if the client hangs up first: uvicorn does not cancel a handler whose client left."""

    async def hung_up() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    task, watch = asyncio.ensure_future(work), asyncio.ensure_future(hung_up())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


class ClosingStream(StreamingResponse):
    """A stream whose body and choices are closed however the response ends, which aborts
    the engine requests still running at once. Starlette itself leaves the body open when the
    response does not complete: a send that fails because the client left (ASGI ≥ 2.4) or a
    handler cancelled when it did (Ray Serve cancels a replica's request then); and a body
    that never started cannot close what it was given."""

    def __init__(self, body, gens: list[Generation], **kwargs):
        super().__init__(body, **kwargs)
        self.gens = gens

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            await close_all(self.gens)
