"""The control channel: per-step messages between the processes of one engine (the driver, the
tensor-parallel workers, the draft), one writer broadcasting to a fixed set of readers, in
order, each message read by every reader exactly once. Ray stays for placement, start-up,
lifecycle and failure handling; a step's messages cost microseconds here instead of the
milliseconds of a Ray actor call (docs/ARCHITECTURE.md, "The control plane").

Kinds (`ChannelSpec.kind`):
  shm  the processes share a node: a ring of fixed-size chunks in one POSIX shared-memory
       segment. Chunk metadata is a `written` flag and one `read` flag per reader; the writer
       reuses a chunk once every reader has read it (back-pressure: a slow reader holds the
       writer), a message larger than a chunk spans several. A waiting process spins for
       `spin_s`, then sleeps on a FIFO of its own that the other side writes a byte to when
       it finds the sleeper's flag set (no busy core while idle).
  tcp  some reader is on another node: the writer sends length-prefixed frames to each
       reader over TCP (the kernel's socket buffers give the back-pressure).

Lifecycle: the writer's process `create`s (shm: the segment and FIFOs; tcp: a listening
socket), the spec travels to the readers (a Ray call at start-up), each reader `open`s it, then
the writer `seal`s: shm unlinks every name (the mappings and open FIFOs stay valid, so nothing
is left in /dev/shm however the processes end later); tcp accepts the readers' connections.

Every wait takes a `timeout_s` and a `check` callable run every `POLL_S` while asleep: the
driver passes one that raises when an actor of the engine has died (a dead peer never writes
again). `close` on the writer makes readers raise `ChannelClosed` once they have read what was
sent before it."""

from __future__ import annotations

import mmap
import os
import pickle
import select
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import shared_memory

# Seconds asleep between two `check` calls (and between two looks at the flags, should a
# wake-up ever be missed).
POLL_S = 0.05
CHUNK_BYTES = 256 << 10
NUM_CHUNKS = 8
KINDS = ("shm", "tcp")


class ChannelClosed(Exception):
    """The other end closed the channel (or, tcp, its connection dropped)."""


class ChannelTimeout(TimeoutError):
    pass


@dataclass(frozen=True)
class ChannelSpec:
    """What a reader needs to open the channel; picklable, a few hundred bytes."""

    kind: str  # one of KINDS
    num_readers: int
    shm_name: str = ""  # shm: the segment
    num_chunks: int = 0
    chunk_bytes: int = 0
    fifo_dir: str = ""  # shm: FIFOs "w" (the writer's) and "r{i}" (reader i's)
    host: str = ""  # tcp: the writer's listening address
    port: int = 0


Check = Callable[[], None] | None

_FENCE = threading.Lock()


def memory_fence() -> None:
    """A full memory barrier (a locked instruction): orders a flag store before the load of the
    other side's flag, so a sleeper and a waker can never both miss each other."""
    _FENCE.acquire()
    _FENCE.release()


class _Deadline:
    def __init__(self, timeout_s: float | None, what: str):
        self.end = None if timeout_s is None else time.monotonic() + timeout_s
        self.timeout_s, self.what = timeout_s, what

    def left(self) -> float:
        if self.end is None:
            return POLL_S
        left = self.end - time.monotonic()
        if left <= 0:
            raise ChannelTimeout(f"{self.what}: nothing within {self.timeout_s:.1f} s")
        return min(left, POLL_S)


# ---- shm: the ring ------------------------------------------------------------------------
# Header: [closed][writer sleeping][reader i sleeping]…, padded to 64 bytes. Chunk k at
# _HEADER + k · (meta + chunk_bytes): meta = [written][read by reader i]… padded to 8, then
# <u32 part length><u8 more parts follow>, padded to 16; then the part's bytes.

_HEADER = 64
_PART = struct.Struct("<IB")


def _meta_bytes(num_readers: int) -> int:
    return -(-(1 + num_readers) // 8) * 8 + 16


def _shm_size(num_readers: int, num_chunks: int, chunk_bytes: int) -> int:
    return _HEADER + num_chunks * (_meta_bytes(num_readers) + chunk_bytes)


def _map(spec: ChannelSpec) -> mmap.mmap:
    """Maps the segment by path, not through SharedMemory: a reader never registers it with
    multiprocessing's resource tracker (which would unlink it when the reader exits)."""
    fd = os.open(f"/dev/shm/{spec.shm_name}", os.O_RDWR)
    try:
        return mmap.mmap(fd, _shm_size(spec.num_readers, spec.num_chunks, spec.chunk_bytes))
    finally:
        os.close(fd)


class _Ring:
    """One process's view of the segment and the FIFOs (wake-ups)."""

    def __init__(self, spec: ChannelSpec, buf: mmap.mmap, me: str, spin_s: float):
        self.spec, self.buf, self.mv = spec, buf, memoryview(buf)
        self.spin_s = spin_s
        self.stride = _meta_bytes(spec.num_readers) + spec.chunk_bytes
        self.meta = _meta_bytes(spec.num_readers)
        names = ["w"] + [f"r{i}" for i in range(spec.num_readers)]
        # O_RDWR: a FIFO opened for both ends never blocks the open and never reports EOF.
        self.fifos = {n: os.open(os.path.join(spec.fifo_dir, n), os.O_RDWR | os.O_NONBLOCK)
                      for n in names}
        self.own_fifo = self.fifos[me]
        self.own_flag = 1 if me == "w" else 2 + int(me[1:])

    def chunk(self, k: int) -> int:
        return _HEADER + k * self.stride

    def closed(self) -> bool:
        return self.mv[0] == 1

    def wake(self, flag: int, fifo: str, always: bool = False) -> None:
        if always or self.mv[flag]:
            try:
                os.write(self.fifos[fifo], b"\0")
            except BlockingIOError:  # its pipe is full of wake-ups already
                pass

    def wait(self, ready: Callable[[], bool], deadline: _Deadline, check: Check) -> None:
        """Returns once ready() (re-evaluated after each wake-up); raises ChannelClosed if the
        channel closes first."""
        if ready():
            return
        end = time.monotonic() + self.spin_s
        while time.monotonic() < end:
            if ready():
                return
            os.sched_yield()
        flag = self.own_flag
        try:
            while True:
                self.mv[flag] = 1
                memory_fence()
                if ready():
                    return
                if self.closed():
                    raise ChannelClosed("the channel was closed")
                if select.select([self.own_fifo], [], [], deadline.left())[0]:
                    try:
                        os.read(self.own_fifo, 4096)
                    except BlockingIOError:
                        pass
                if check is not None:
                    check()
        finally:
            self.mv[flag] = 0

    def close(self) -> None:
        for fd in self.fifos.values():
            os.close(fd)
        self.fifos = {}
        self.mv.release()
        self.buf.close()


class _ShmWriter:
    def __init__(self, num_readers: int, chunk_bytes: int, num_chunks: int, spin_s: float):
        size = _shm_size(num_readers, num_chunks, chunk_bytes)
        # Created through SharedMemory so the resource tracker unlinks it should this process
        # die before `seal`; mapped by path like the readers' (its own mapping is not used).
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            create=True, size=size)
        self._shm.close()
        fifo_dir = tempfile.mkdtemp(prefix="dflash-ch-", dir="/dev/shm")
        for n in ["w"] + [f"r{i}" for i in range(num_readers)]:
            os.mkfifo(os.path.join(fifo_dir, n), 0o600)
        self.spec = ChannelSpec("shm", num_readers, shm_name=self._shm.name,
                                num_chunks=num_chunks, chunk_bytes=chunk_bytes,
                                fifo_dir=fifo_dir)
        self.ring = _Ring(self.spec, _map(self.spec), "w", spin_s)
        self.mv, self.index = self.ring.mv, 0
        self._read_all = b"\x01" * num_readers
        self._sealed = False

    def seal(self, timeout_s: float) -> None:
        if not self._sealed:
            self._sealed = True
            self._shm.unlink()  # the name only: every mapping stays valid
            shutil.rmtree(self.spec.fifo_dir, ignore_errors=True)

    def _free(self, at: int) -> bool:
        mv, n = self.mv, self.spec.num_readers
        return mv[at] == 0 or mv[at + 1 : at + 1 + n] == self._read_all

    def send(self, data: bytes, deadline: _Deadline, check: Check) -> None:
        spec, mv, ring = self.spec, self.mv, self.ring
        size, n = spec.chunk_bytes, spec.num_readers
        view, offset = memoryview(data), 0
        while True:
            part = view[offset : offset + size]
            offset += len(part)
            at = ring.chunk(self.index)
            ring.wait(lambda at=at: self._free(at), deadline, check)
            mv[at] = 0
            body = at + self.meta
            _PART.pack_into(mv, at + self.meta - 16, len(part), offset < len(data))
            mv[body : body + len(part)] = part
            mv[at + 1 : at + 1 + n] = bytes(n)
            memory_fence()
            mv[at] = 1
            memory_fence()
            for i in range(n):
                ring.wake(2 + i, f"r{i}")
            self.index = (self.index + 1) % spec.num_chunks
            if offset >= len(data):
                return

    @property
    def meta(self) -> int:
        return self.ring.meta

    def close(self) -> None:
        if self._shm is None:
            return
        self.mv[0] = 1
        memory_fence()
        for i in range(self.spec.num_readers):
            self.ring.wake(2 + i, f"r{i}", always=True)
        self.seal(0)
        self.ring.close()
        self._shm = None


class _ShmReader:
    def __init__(self, spec: ChannelSpec, index: int, spin_s: float):
        self.spec, self.i = spec, index
        self.ring = _Ring(spec, _map(spec), f"r{index}", spin_s)
        self.mv, self.index = self.ring.mv, 0

    def _ready(self, at: int) -> bool:
        return self.mv[at] == 1 and self.mv[at + 1 + self.i] == 0

    def recv(self, deadline: _Deadline, check: Check) -> bytes:
        mv, ring, meta = self.mv, self.ring, self.ring.meta
        parts = []
        while True:
            at = ring.chunk(self.index)
            ring.wait(lambda at=at: self._ready(at), deadline, check)
            memory_fence()
            length, more = _PART.unpack_from(mv, at + meta - 16)
            parts.append(bytes(mv[at + meta : at + meta + length]))
            memory_fence()
            mv[at + 1 + self.i] = 1
            memory_fence()
            ring.wake(1, "w")
            self.index = (self.index + 1) % self.spec.num_chunks
            if not more:
                return parts[0] if len(parts) == 1 else b"".join(parts)

    def close(self) -> None:
        if self.ring.fifos:
            self.ring.close()


# ---- tcp: the fallback across nodes -------------------------------------------------------

_LEN = struct.Struct("<Q")


def _recv_exact(sock: socket.socket, n: int, deadline: _Deadline, check: Check) -> bytes:
    out = bytearray()
    while len(out) < n:
        if not select.select([sock], [], [], deadline.left())[0]:
            if check is not None:
                check()
            continue
        chunk = sock.recv(min(n - len(out), 1 << 20))
        if not chunk:
            raise ChannelClosed("the writer closed the connection")
        out += chunk
    return bytes(out)


class _TcpWriter:
    def __init__(self, num_readers: int, host: str):
        self._listener = socket.create_server((host, 0), backlog=num_readers)
        self.spec = ChannelSpec("tcp", num_readers, host=host,
                                port=self._listener.getsockname()[1])
        self.socks: list[socket.socket] = []

    def seal(self, timeout_s: float) -> None:
        """Accepts every reader's connection (each sends its index first)."""
        if self._listener is None:
            return
        deadline = _Deadline(timeout_s, "waiting for the readers to connect")
        by_index: dict[int, socket.socket] = {}
        while len(by_index) < self.spec.num_readers:
            if not select.select([self._listener], [], [], deadline.left())[0]:
                continue
            sock, _ = self._listener.accept()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            by_index[_LEN.unpack(_recv_exact(sock, _LEN.size, deadline, None))[0]] = sock
        self.socks = [by_index[i] for i in range(self.spec.num_readers)]
        self._listener.close()
        self._listener = None

    def send(self, data: bytes, deadline: _Deadline, check: Check) -> None:
        frame = _LEN.pack(len(data)) + data
        for sock in self.socks:
            view = memoryview(frame)
            while view:
                if not select.select([], [sock], [], deadline.left())[1]:
                    if check is not None:
                        check()
                    continue
                try:
                    view = view[sock.send(view):]
                except OSError as e:
                    raise ChannelClosed(f"a reader's connection dropped: {e}") from None

    def close(self) -> None:
        for sock in self.socks:
            sock.close()
        self.socks = []
        if self._listener is not None:
            self._listener.close()
            self._listener = None


class _TcpReader:
    def __init__(self, spec: ChannelSpec, index: int):
        self.sock = socket.create_connection((spec.host, spec.port), timeout=60)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.sendall(_LEN.pack(index))
        self.sock.setblocking(False)

    def recv(self, deadline: _Deadline, check: Check) -> bytes:
        size = _LEN.unpack(_recv_exact(self.sock, _LEN.size, deadline, check))[0]
        return _recv_exact(self.sock, size, deadline, check)

    def close(self) -> None:
        self.sock.close()


# ---- the two ends -------------------------------------------------------------------------

class ChannelWriter:
    """The sending end; lives in the process that creates it."""

    def __init__(self, kind: str, num_readers: int, host: str = "127.0.0.1",
                 spin_s: float = 0.0, chunk_bytes: int = CHUNK_BYTES,
                 num_chunks: int = NUM_CHUNKS):
        if kind not in KINDS:
            raise ValueError(f"channel kind must be one of {KINDS}, got {kind!r}")
        if num_readers < 1 or chunk_bytes < 1 or num_chunks < 1:
            raise ValueError(f"a channel needs num_readers, chunk_bytes, num_chunks >= 1; got "
                             f"{num_readers=}, {chunk_bytes=}, {num_chunks=}")
        self._end = (_ShmWriter(num_readers, chunk_bytes, num_chunks, spin_s) if kind == "shm"
                     else _TcpWriter(num_readers, host))
        self.spec: ChannelSpec = self._end.spec

    def seal(self, timeout_s: float = 60.0) -> None:
        """Call once every reader has opened the channel."""
        self._end.seal(timeout_s)

    def send(self, obj: object, timeout_s: float | None = None, check: Check = None) -> None:
        self._end.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL),
                       _Deadline(timeout_s, "sending on the control channel"), check)

    def close(self) -> None:
        self._end.close()


class ChannelReader:
    """Reader `index` (0 … num_readers − 1) of the channel `spec` describes."""

    def __init__(self, spec: ChannelSpec, index: int, spin_s: float = 0.0):
        if not 0 <= index < spec.num_readers:
            raise ValueError(f"reader index {index} out of range for {spec.num_readers} readers")
        self._end = _ShmReader(spec, index, spin_s) if spec.kind == "shm" \
            else _TcpReader(spec, index)

    def recv(self, timeout_s: float | None = None, check: Check = None) -> object:
        return pickle.loads(self._end.recv(
            _Deadline(timeout_s, "waiting on the control channel"), check))

    def close(self) -> None:
        self._end.close()
