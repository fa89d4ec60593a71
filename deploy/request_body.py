"""A request's body as the handlers get it: read within the server's size limit (413 past it,
415 when compressed) and parsed into its protocol model without holding the event loop."""

from __future__ import annotations

import asyncio
from typing import TypeVar

from fastapi import Request

from deploy.protocol import RequestError, parse_request

T = TypeVar("T")

# Bodies up to this size are parsed on the event loop; larger ones in a thread.
PARSE_INLINE_BYTES = 64 << 10


async def read_body(request: Request, limit: int) -> bytes:
    """The body, refused with 413 once it is larger than `limit` (max_request_bytes; by its
    Content-Length before reading, else while reading); a compressed body is a 415."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise RequestError(f"Content-Encoding {encoding!r} is not supported: send the body "
                           f"uncompressed", None, "unsupported_media_type", 415)
    too_large = RequestError(f"the request body is larger than {limit} bytes (the "
                             f"server's max_request_bytes)", None, "request_too_large", 413)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise too_large
        chunks.append(chunk)
    return b"".join(chunks)


async def parse_body(model: type[T], raw: bytes) -> T:
    """The body as `model`; a large one is parsed in a thread, so that the event loop (the
    other streams, /health) is not held for the whole of it."""
    if len(raw) <= PARSE_INLINE_BYTES:
        return parse_request(model, raw)
    return await asyncio.to_thread(parse_request, model, raw)
