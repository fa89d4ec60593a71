"""The aux hidden-state transport from TP rank 0 of the target to the draft actor colocated with
it. Each step rank 0 copies aux [N, D] (model dtype) and aux_positions [N] (int64) into one slot
of a ring preallocated in memory both processes map, and only an `AuxRef` (slot, rows) crosses
the Ray calls rank 0 → driver → draft, instead of the tensors going through the object store.

Rings, picked by device in `make_aux_sender`:
  cpu   a POSIX shared-memory segment (/dev/shm, Linux) viewed through `torch.frombuffer`.
  cuda  a CUDA tensor ring shared through CUDA IPC (`reduce_tensor`), plus one interprocess
        event the sender records after each copy and the reader waits on before reading.
  pair  a draft on its own GPU (`draft_placement: separate`): a two-process group of its own
        (NCCL on CUDA, gloo on CPU; a TCPStore on rank 0's node, apart from the TP group).
        Each put copies into a send slot and posts an async send of it; the receiver's get
        posts the matching recv into its own buffer. The two must pair one to one, in order:
        every put's ref reaches exactly one get (the driver feeds every step's ref to the
        draft; any failure restarts both actors). Before a send slot is rewritten, the stream
        waits for that slot's earlier send (NCCL: a device-side wait, the host does not block).
        Both ends open the group together: the driver calls `connect` on rank 0 and
        `AuxReceiver.open` on the draft at the same time.
shm and cuda need the draft on the same node; cuda also on the same GPU (Ray narrows
CUDA_VISIBLE_DEVICES to it, so it is cuda:0 in both processes). Steps with more rows than a
slot holds (long prefills) fall back to an AuxRef carrying the tensors inline on CPU, i.e. the
object-store path.

Flow control. Put k goes into slot k % num_slots, so it may only start once put k − num_slots
has been read, where "read" means the reader is done with the tensors `get` returned (views
into the ring), on the device too. The reader says so with `release(ref)` (after a sync of its
stream on cuda); shm and cuda keep the count of releases in a shared 8-byte counter that `put`
waits on (only ever when rank 0 runs ahead of the draft, i.e. over consecutive prefill steps).
The pair transport needs none: a slot's next put waits for its last send, which NCCL and gloo
complete once the receiver has posted its recv. `seal` (once the reader has opened the ring)
unlinks every shared-memory name: the mappings stay, nothing is left in /dev/shm.
"""

from __future__ import annotations

import datetime
import mmap
import os
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from multiprocessing import shared_memory

import torch
import torch.distributed as dist

from workers.channel import memory_fence


@dataclass(frozen=True, eq=False)
class AuxRef:
    """One put, as it crosses the Ray calls: a slot of the ring, or (fallback) the tensors."""

    slot: int  # -1 when inline
    num_rows: int  # N
    aux: torch.Tensor | None = None  # inline only: CPU [N, D]
    positions: torch.Tensor | None = None  # inline only: CPU [N] int64


@dataclass(frozen=True)
class AuxRingSpec:
    """What another process needs to open the ring; picklable, a few hundred bytes."""

    kind: str  # "shm" | "cuda" | "pair"
    num_slots: int
    max_rows: int  # rows per slot
    width: int  # D = n_aux · H
    dtype: torch.dtype
    shm_name: str = ""  # shm: the segment, positions [S, R] int64 then aux [S, R, D]
    cuda_aux: tuple = ()  # cuda: reduce_tensor() of the aux ring [S, R, D]
    cuda_positions: tuple = ()  # cuda: reduce_tensor() of the positions ring [S, R]
    cuda_event: bytes = b""  # cuda: ipc_handle() of the copy-done event
    pair_addr: str = ""  # pair: the TCPStore on rank 0's node
    pair_port: int = 0
    pair_backend: str = ""  # pair: "nccl" | "gloo"
    read_counter: str = ""  # shm, cuda: the segment holding the reader's release count


class AuxSender(ABC):
    """Owned by TP rank 0: `put` once per step, `spec` once for the draft, `close` at shutdown."""

    def __init__(self, num_slots: int, max_rows: int, width: int, dtype: torch.dtype):
        if num_slots < 2 or max_rows < 1 or width < 1:
            raise ValueError(f"aux ring needs num_slots >= 2, max_rows >= 1, width >= 1; got "
                             f"{num_slots=}, {max_rows=}, {width=}")
        self.num_slots, self.max_rows, self.width, self.dtype = num_slots, max_rows, width, dtype
        self.aux_ring: torch.Tensor  # [S, R, D], set by the subclass
        self.pos_ring: torch.Tensor  # [S, R] int64
        self._puts = 0
        self._reads: _Counter | None = None  # shm, cuda: the reader's releases

    def put(self, aux: torch.Tensor, positions: torch.Tensor) -> AuxRef:
        """aux [N, D], positions [N]. Waits only for a reader num_slots puts behind (see the
        flow control); the inline fallback's `.cpu()` waits for the device."""
        if aux.dim() != 2 or aux.shape[1] != self.width or aux.dtype != self.dtype:
            # A silent cast (say fp32 → bf16) would change the draft's inputs.
            raise ValueError(f"aux must be [N, {self.width}] {self.dtype}, got "
                             f"{list(aux.shape)} {aux.dtype}")
        n = aux.shape[0]
        if n > self.max_rows:
            return AuxRef(-1, n, aux.cpu(), positions.cpu())
        if self._reads is not None:
            self._reads.wait_for(self._puts - self.num_slots + 1)
        slot = self._puts % self.num_slots
        self._puts += 1
        self._before_write(slot)
        non_blocking = self.aux_ring.is_cuda  # cuda: ordered by the event; cpu: must be done
        self.aux_ring[slot, :n].copy_(aux, non_blocking=non_blocking)
        self.pos_ring[slot, :n].copy_(positions, non_blocking=non_blocking)
        self._published(slot, n)
        return AuxRef(slot, n)

    def connect(self) -> None:  # noqa: B027 (a hook: only the pair transport needs it)
        """Joins the reader (pair: blocks until `AuxReceiver.open` runs on the other side;
        the others need nothing)."""

    def _before_write(self, slot: int) -> None:  # noqa: B027 (a hook, as connect)
        """Orders the copy into `slot` after whatever still reads it (pair: its last send)."""

    @abstractmethod
    def _published(self, slot: int, num_rows: int) -> None:
        """Makes the copy just enqueued visible to readers."""

    @abstractmethod
    def spec(self) -> AuxRingSpec: ...

    def seal(self) -> None:
        """The reader has opened the ring: drop the shared-memory names."""
        if self._reads is not None:
            self._reads.unlink()

    @abstractmethod
    def close(self) -> None: ...


class AuxReceiver(ABC):
    """Opened in the draft process; `get` returns views into the ring (see the flow control)."""

    def __init__(self, device: torch.device, spec: AuxRingSpec | None = None):
        self.device = device
        self.aux_ring: torch.Tensor  # [S, R, D]
        self.pos_ring: torch.Tensor  # [S, R] int64
        self._reads = _Counter(spec.read_counter) if spec and spec.read_counter else None

    @staticmethod
    def open(spec: AuxRingSpec, device: torch.device | str) -> AuxReceiver:
        device = _indexed(device)
        receiver = {"cuda": _CudaReceiver, "shm": _ShmReceiver, "pair": _PairReceiver}
        return receiver[spec.kind](spec, device)

    def get(self, ref: AuxRef) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (aux [N, D], positions [N]) on the receiver's device."""
        if ref.aux is not None:
            return ref.aux.to(self.device), ref.positions.to(self.device)
        self._before_read(ref)
        n = ref.num_rows
        return (self.aux_ring[ref.slot, :n].to(self.device),
                self.pos_ring[ref.slot, :n].to(self.device))

    @abstractmethod
    def _before_read(self, ref: AuxRef) -> None:
        """Orders the reads that follow after the sender's copy."""

    def release(self, ref: AuxRef) -> None:
        """The tensors `get(ref)` returned are no longer read, on the device too (cuda: sync the
        stream that used them first); the sender may reuse the slot."""
        if self._reads is not None and ref.aux is None:
            self._reads.add_one()

    def close(self) -> None:
        # Views handed out keep their mapping alive; this only drops the receiver's own.
        del self.aux_ring, self.pos_ring


def make_aux_sender(device: torch.device | str, num_slots: int, max_rows: int, width: int,
                    dtype: torch.dtype, pair: bool = False) -> AuxSender:
    """pair: the reader is on another device (its own GPU), else it shares this one."""
    device = _indexed(device)
    if pair:
        return _PairSender(device, num_slots, max_rows, width, dtype)
    if device.type == "cuda":
        return _CudaSender(device, num_slots, max_rows, width, dtype)
    return _ShmSender(num_slots, max_rows, width, dtype)


def _indexed(device: torch.device | str) -> torch.device:
    device = torch.device(device)  # "cuda" != "cuda:0" when comparing devices
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# ---- the reader's release count -------------------------------------------------------------

class _Counter:
    """An int64 in a POSIX shared-memory segment of its own: the reader adds, the sender
    waits (polling: it only waits while rank 0 runs ahead of the draft over prefill steps)."""

    def __init__(self, name: str, created: shared_memory.SharedMemory | None = None):
        self.name, self._created = name, created
        fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
        try:
            self._buf = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        self._value = memoryview(self._buf).cast("q")

    @classmethod
    def create(cls) -> _Counter:
        shm = shared_memory.SharedMemory(create=True, size=8)  # zeroed
        shm.close()
        return cls(shm.name, shm)

    def add_one(self) -> None:
        memory_fence()  # the reads of the slot before the count that frees it
        self._value[0] += 1  # one writer: the reader process

    def wait_for(self, count: int) -> None:
        pause = 20e-6
        while self._value[0] < count:
            time.sleep(pause)
            pause = min(2 * pause, 1e-3)
        memory_fence()

    def unlink(self) -> None:
        if self._created is not None:
            self._created.unlink()
            self._created = None


# ---- cpu: POSIX shared memory --------------------------------------------------------------

def _shm_size(num_slots: int, max_rows: int, width: int, dtype: torch.dtype) -> int:
    return num_slots * max_rows * (8 + width * dtype.itemsize)  # positions, then aux


def _map_rings(name: str, s: int, r: int, d: int, dtype: torch.dtype,
               create: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Maps the segment by path rather than through SharedMemory(name): a reader then never
    registers it with multiprocessing's resource_tracker (which, before Python 3.13, unlinks it
    when the reader exits, and is shared with the writer by a spawn child, so unregistering would
    drop the writer's entry too), and the mapping lives exactly as long as the tensors on it."""
    size = _shm_size(s, r, d, dtype)
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR)
    try:
        if create:
            # Reserve the pages now: a /dev/shm too small for the ring (Docker's default is
            # 64 MiB) fails here with ENOSPC instead of a SIGBUS at some later put.
            os.posix_fallocate(fd, 0, size)
        buf = mmap.mmap(fd, size)  # dups fd; unmapped when the last tensor on it dies
    finally:
        os.close(fd)
    pos = torch.frombuffer(buf, dtype=torch.int64, count=s * r).view(s, r)
    aux = torch.frombuffer(buf, dtype=dtype, count=s * r * d, offset=s * r * 8).view(s, r, d)
    return aux, pos


class _ShmSender(AuxSender):
    def __init__(self, num_slots: int, max_rows: int, width: int, dtype: torch.dtype):
        super().__init__(num_slots, max_rows, width, dtype)
        size = _shm_size(num_slots, max_rows, width, dtype)
        # Created through SharedMemory so the resource_tracker unlinks it if rank 0 dies.
        self._shm: shared_memory.SharedMemory | None = shared_memory.SharedMemory(
            create=True, size=size)
        self._shm.close()  # its own mapping is not used; the name stays until unlink
        self.aux_ring, self.pos_ring = _map_rings(self._shm.name, num_slots, max_rows, width,
                                                  dtype, create=True)
        self._reads = _Counter.create()

    def _published(self, slot: int, num_rows: int) -> None:
        pass  # copy_ into host memory has finished; the Ray hops carrying the ref order the rest

    def spec(self) -> AuxRingSpec:
        return AuxRingSpec("shm", self.num_slots, self.max_rows, self.width, self.dtype,
                           shm_name=self._shm.name, read_counter=self._reads.name)

    def seal(self) -> None:
        super().seal()
        if self._shm is not None:
            self._shm.unlink()  # readers' mappings stay valid; new opens fail
            self._shm = None

    def close(self) -> None:
        self.seal()


class _ShmReceiver(AuxReceiver):
    def __init__(self, spec: AuxRingSpec, device: torch.device):
        super().__init__(device, spec)
        self.aux_ring, self.pos_ring = _map_rings(spec.shm_name, spec.num_slots, spec.max_rows,
                                                  spec.width, spec.dtype)

    def _before_read(self, ref: AuxRef) -> None:
        pass


# ---- cuda: IPC tensor ring + interprocess event -------------------------------------------
# The reader waits on the host (cudaEventSynchronize), not with a stream wait: on an H200
# (driver 580, torch 2.11) a stream wait on an IPC event delayed the reader's next kernels by
# ~250 µs even when the event had long completed; a host wait costs tens of µs
# (docs/BENCHMARKS.md). It should rarely block: rank 0 queues the copy at the end of a step it
# already synchronised for acceptance, and the ref then spends far longer in the Ray calls.
# One event is enough, not one per slot: the sender records it after every put on its stream,
# and a wait covers the latest record at the time of the wait. That record is this put's or a
# later one (the ref only exists after this put's record); a later one completes only after
# this put's copy, as the sender's stream runs in order. So it may over-wait, never under-wait.

class _CudaSender(AuxSender):
    def __init__(self, device: torch.device, num_slots: int, max_rows: int, width: int,
                 dtype: torch.dtype):
        super().__init__(num_slots, max_rows, width, dtype)
        self.device = device
        self.aux_ring = torch.empty(num_slots, max_rows, width, dtype=dtype, device=device)
        self.pos_ring = torch.empty(num_slots, max_rows, dtype=torch.int64, device=device)
        self._copied = torch.cuda.Event(interprocess=True)
        self._copied.record(torch.cuda.current_stream(device))  # creates it on this device
        self._reads = _Counter.create()

    def _published(self, slot: int, num_rows: int) -> None:
        self._copied.record(torch.cuda.current_stream(self.device))

    def spec(self) -> AuxRingSpec:
        from torch.multiprocessing.reductions import reduce_tensor

        return AuxRingSpec("cuda", self.num_slots, self.max_rows, self.width, self.dtype,
                           cuda_aux=reduce_tensor(self.aux_ring),
                           cuda_positions=reduce_tensor(self.pos_ring),
                           cuda_event=self._copied.ipc_handle(), read_counter=self._reads.name)

    def close(self) -> None:
        # torch's CUDA IPC bookkeeping keeps the memory alive while a reader still maps it.
        self.seal()
        self.aux_ring = self.pos_ring = torch.empty(0)


class _CudaReceiver(AuxReceiver):
    def __init__(self, spec: AuxRingSpec, device: torch.device):
        super().__init__(device, spec)
        rebuild, args = spec.cuda_aux
        self.aux_ring = rebuild(*args)
        rebuild, args = spec.cuda_positions
        self.pos_ring = rebuild(*args)
        if self.aux_ring.device != device:
            raise ValueError(f"the aux ring lives on {self.aux_ring.device}, not {device}: "
                             f"the draft must share the GPU of TP rank 0")
        self._copied = torch.cuda.Event.from_ipc_handle(device, spec.cuda_event)

    def _before_read(self, ref: AuxRef) -> None:
        self._copied.synchronize()


# ---- pair: a two-process NCCL / gloo group -------------------------------------------------
# Its own group, built straight from a store, so neither the TP group (the default process
# group of the target's ranks) nor the draft's process needs to know of the other.

PAIR_TIMEOUT = datetime.timedelta(minutes=10)  # the group's ops; the driver's timeouts act first


def _pair_group(store: dist.Store, rank: int, backend: str) -> dist.ProcessGroup:
    prefixed = dist.PrefixStore("aux_pair", store)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = PAIR_TIMEOUT
        return dist.ProcessGroupNCCL(prefixed, rank, 2, opts)
    return dist.ProcessGroupGloo(prefixed, rank, 2, PAIR_TIMEOUT)


class _PairSender(AuxSender):
    def __init__(self, device: torch.device, num_slots: int, max_rows: int, width: int,
                 dtype: torch.dtype):
        super().__init__(num_slots, max_rows, width, dtype)
        import ray

        self.device = device
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        self.aux_ring = torch.empty(num_slots, max_rows, width, dtype=dtype, device=device)
        self.pos_ring = torch.empty(num_slots, max_rows, dtype=torch.int64, device=device)
        self.addr = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self._store = dist.TCPStore(self.addr, 0, 2, is_master=True, timeout=PAIR_TIMEOUT,
                                    wait_for_workers=False)  # port 0: a free one
        self._group: dist.ProcessGroup | None = None
        self._sends: list[list] = [[] for _ in range(num_slots)]  # each slot's last sends

    def connect(self) -> None:
        self._group = _pair_group(self._store, 0, self.backend)

    def _before_write(self, slot: int) -> None:
        for work in self._sends[slot]:
            work.wait()  # NCCL: the current stream waits for the send; gloo: the host does
        self._sends[slot] = []

    def _published(self, slot: int, num_rows: int) -> None:
        if self._group is None:
            raise RuntimeError("aux pair: put before connect()")
        if num_rows:  # the receiver skips empty steps too
            self._sends[slot] = [self._group.send([self.aux_ring[slot, :num_rows]], 1, 0),
                                 self._group.send([self.pos_ring[slot, :num_rows]], 1, 1)]

    def spec(self) -> AuxRingSpec:
        return AuxRingSpec("pair", self.num_slots, self.max_rows, self.width, self.dtype,
                           pair_addr=self.addr, pair_port=self._store.port,
                           pair_backend=self.backend)

    def close(self) -> None:
        self._sends = [[] for _ in range(self.num_slots)]
        self._group = None


class _PairReceiver(AuxReceiver):
    """One receive buffer, not a ring: a recv is ordered after the reader's earlier work on
    its stream (NCCL), or done before get returns (gloo), so the previous step's rows are
    consumed before they are overwritten."""

    def __init__(self, spec: AuxRingSpec, device: torch.device):
        super().__init__(device)
        store = dist.TCPStore(spec.pair_addr, spec.pair_port, 2, is_master=False,
                              timeout=PAIR_TIMEOUT)
        self._group = _pair_group(store, 1, spec.pair_backend)
        self.aux_ring = torch.empty(1, spec.max_rows, spec.width, dtype=spec.dtype,
                                    device=device)
        self.pos_ring = torch.empty(1, spec.max_rows, dtype=torch.int64, device=device)

    def get(self, ref: AuxRef) -> tuple[torch.Tensor, torch.Tensor]:
        if ref.aux is None:
            ref = AuxRef(0, ref.num_rows)  # every step lands in the one buffer
        return super().get(ref)

    def _before_read(self, ref: AuxRef) -> None:
        n = ref.num_rows
        if n:
            self._group.recv([self.aux_ring[0, :n]], 0, 0).wait()
            self._group.recv([self.pos_ring[0, :n]], 0, 1).wait()
