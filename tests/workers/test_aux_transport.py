"""The aux ring: exact round trips, wrap-around within the flow control (a put waits for the
reader's release of the slot it reuses), the inline fallback, and readers in another (spawned)
process, on CPU shared memory and on CUDA IPC."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import threading
from collections import deque

import pytest
import torch

from workers.aux_transport import AuxReceiver, AuxRef, AuxRingSpec, make_aux_sender

DTYPES = [torch.float32, torch.bfloat16]


def _data(seed: int, n: int, width: int, dtype: torch.dtype,
          device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic aux [n, width] and positions [n] from integer arithmetic only, so any
    process on any device rebuilds the same bits."""
    i = torch.arange(n * width, device=device, dtype=torch.int64).view(n, width)
    aux = (((i * 7919 + seed * 104729) % 65521 - 32760).float() / 256).to(dtype)
    return aux, torch.arange(n, device=device) + 1000 * seed


def _check(receiver: AuxReceiver, ref: AuxRef, seed: int, spec: AuxRingSpec,
           release: bool = True) -> bool:
    """get(ref) returns exactly the sender's rows; then (release) the slot is given back."""
    aux, pos = receiver.get(ref)
    want_aux, want_pos = _data(seed, ref.num_rows, spec.width, spec.dtype, receiver.device)
    ok = (aux.dtype == spec.dtype and pos.dtype == torch.int64
          and torch.equal(aux, want_aux) and torch.equal(pos, want_pos))
    if release:
        if aux.is_cuda:
            torch.cuda.synchronize(aux.device)
        receiver.release(ref)
    return ok


def _reader(conn, specs: list[AuxRingSpec], device: str) -> None:
    """Spawned child: opens every ring, then answers each (spec index, ref, seed) with whether
    get() returned exactly the sender's data, until None."""
    receivers = [AuxReceiver.open(s, device) for s in specs]
    while (msg := conn.recv()) is not None:
        i, ref, seed = msg
        conn.send(_check(receivers[i], ref, seed, specs[i]))
    for r in receivers:
        r.close()
    conn.send("closed")


def _spawn_reader(specs: list[AuxRingSpec], device: str):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_reader, args=(child, specs, device), daemon=True)
    proc.start()
    return proc, parent


def _finish(proc, conn) -> None:
    conn.send(None)
    assert conn.recv() == "closed"
    proc.join(timeout=30)
    assert proc.exitcode == 0


# ---- CPU, one process -----------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_is_exact(dtype):
    sender = make_aux_sender("cpu", num_slots=3, max_rows=8, width=5, dtype=dtype)
    receiver = AuxReceiver.open(sender.spec(), "cpu")
    for seed, n in enumerate([6, 8, 1, 0]):
        ref = sender.put(*_data(seed, n, 5, dtype))
        assert ref.aux is None and ref.num_rows == n
        assert _check(receiver, ref, seed, sender.spec())
    sender.close()


def test_ref_and_spec_are_tiny_and_picklable():
    sender = make_aux_sender("cpu", num_slots=2, max_rows=64, width=32, dtype=torch.bfloat16)
    ref = sender.put(*_data(0, 64, 32, torch.bfloat16))
    assert len(pickle.dumps(ref)) < 300
    assert len(pickle.dumps(sender.spec())) < 600
    receiver = AuxReceiver.open(pickle.loads(pickle.dumps(sender.spec())), "cpu")
    assert _check(receiver, pickle.loads(pickle.dumps(ref)), 0, sender.spec())
    sender.close()


def test_wrap_around_keeps_unreleased_slots_intact():
    """Puts run up to num_slots ahead of the reader's releases; every unreleased ref must
    still return its own rows after later puts."""
    num_slots, width = 3, 4
    sender = make_aux_sender("cpu", num_slots, max_rows=8, width=width, dtype=torch.float32)
    receiver = AuxReceiver.open(sender.spec(), "cpu")
    unread: deque[tuple[AuxRef, int]] = deque()
    for k in range(11):
        ref = sender.put(*_data(k, 1 + k % 8, width, torch.float32))
        assert ref.slot == k % num_slots
        unread.append((ref, k))
        assert all(_check(receiver, r, seed, sender.spec(), release=False)
                   for r, seed in unread)
        if len(unread) == num_slots:
            receiver.release(unread.popleft()[0])  # so the next put may reuse its slot
    sender.close()


def test_put_waits_for_the_release_of_the_slot_it_reuses():
    """A reader num_slots puts behind holds the sender (rank 0 ahead of the draft over
    prefill steps) until it releases the oldest slot; inline refs take no slot."""
    sender = make_aux_sender("cpu", num_slots=2, max_rows=4, width=3, dtype=torch.float32)
    receiver = AuxReceiver.open(sender.spec(), "cpu")
    refs = [sender.put(*_data(k, 2, 3, torch.float32)) for k in range(2)]
    assert sender.put(*_data(9, 5, 3, torch.float32)).slot == -1  # inline: never waits
    third: list[AuxRef] = []
    putter = threading.Thread(target=lambda: third.append(
        sender.put(*_data(2, 3, 3, torch.float32))))
    putter.start()
    putter.join(timeout=0.5)
    assert putter.is_alive() and not third  # slot 0 is still the reader's
    assert _check(receiver, refs[0], 0, sender.spec())  # read, then released
    putter.join(timeout=30)
    assert not putter.is_alive() and third[0].slot == 0
    assert _check(receiver, refs[1], 1, sender.spec())  # untouched by the third put
    assert _check(receiver, third[0], 2, sender.spec())
    sender.close()


def test_overflow_falls_back_to_inline_tensors():
    sender = make_aux_sender("cpu", num_slots=2, max_rows=4, width=3, dtype=torch.bfloat16)
    receiver = AuxReceiver.open(sender.spec(), "cpu")
    ref = sender.put(*_data(7, 5, 3, torch.bfloat16))
    assert ref.slot == -1 and ref.aux is not None and ref.num_rows == 5
    assert _check(receiver, pickle.loads(pickle.dumps(ref)), 7, sender.spec())
    assert sender.put(*_data(8, 4, 3, torch.bfloat16)).slot == 0  # no slot was used
    sender.close()


def test_put_rejects_wrong_width_or_dtype():
    sender = make_aux_sender("cpu", num_slots=2, max_rows=4, width=3, dtype=torch.bfloat16)
    with pytest.raises(ValueError):
        sender.put(*_data(0, 2, 4, torch.bfloat16))
    with pytest.raises(ValueError):
        sender.put(*_data(0, 2, 3, torch.float32))
    sender.close()
    with pytest.raises(ValueError):
        make_aux_sender("cpu", num_slots=1, max_rows=4, width=3, dtype=torch.float32)


def test_close_unlinks_but_open_views_stay_valid():
    sender = make_aux_sender("cpu", num_slots=2, max_rows=4, width=3, dtype=torch.float32)
    spec = sender.spec()
    receiver = AuxReceiver.open(spec, "cpu")
    aux, _ = receiver.get(sender.put(*_data(1, 4, 3, torch.float32)))
    receiver.close()
    sender.close()
    sender.close()  # idempotent
    assert not os.path.exists(f"/dev/shm/{spec.shm_name}")
    assert not os.path.exists(f"/dev/shm/{spec.read_counter}")
    assert torch.equal(aux, _data(1, 4, 3, torch.float32)[0])
    with pytest.raises(FileNotFoundError):
        AuxReceiver.open(spec, "cpu")


# ---- CPU, reader in another process -------------------------------------------------------

def test_reader_in_a_spawned_process():
    senders = [make_aux_sender("cpu", num_slots=3, max_rows=16, width=6, dtype=d)
               for d in DTYPES]
    specs = [s.spec() for s in senders]
    proc, conn = _spawn_reader(specs, "cpu")
    try:
        for i, sender in enumerate(senders):
            for seed, n in enumerate([16, 3, 9, 17, 1]):  # wraps; 17 rows go inline
                conn.send((i, sender.put(*_data(seed, n, 6, sender.dtype)), seed))
                assert conn.recv(), (sender.dtype, seed)
        unread = senders[0].put(*_data(99, 5, 6, torch.float32))
        _finish(proc, conn)
        # The reader's exit must leave the segment alone (no resource_tracker unlink).
        assert _check(AuxReceiver.open(specs[0], "cpu"), unread, 99, specs[0])
    finally:
        for s in senders:
            s.close()


# ---- CUDA: IPC ring + interprocess event ----------------------------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_reader_in_a_spawned_process(dtype):
    width, max_rows = 5 * 2048, 8192  # the 35B-A3B draft's aux width, a long prefill
    sender = make_aux_sender("cuda", num_slots=3, max_rows=max_rows, width=width, dtype=dtype)
    proc, conn = _spawn_reader([sender.spec()], "cuda:0")
    try:
        for seed, n in enumerate([1, 16, 128, max_rows, 7, max_rows + 1]):  # wraps, then inline
            conn.send((0, sender.put(*_data(seed, n, width, dtype, "cuda")), seed))
            assert conn.recv(), (n, seed)
        # Event correctness: the copy is queued behind ~0.5 s of GPU work, put returns at
        # once and the ref reaches the reader long before the copy ran; get() must still see
        # every row of it (a reader that skipped the event wait would read the old slot).
        aux, pos = _data(1234, max_rows, width, dtype, "cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(1_000_000_000)
        conn.send((0, sender.put(aux, pos), 1234))
        assert conn.recv()
        _finish(proc, conn)
    finally:
        sender.close()


# ---- pair: a draft on its own device (gloo on CPU; NCCL needs two GPUs) ----------------------

def test_pair_transport_to_a_spawned_reader():
    senders = [make_aux_sender("cpu", num_slots=3, max_rows=16, width=6, dtype=d, pair=True)
               for d in DTYPES]
    specs = [s.spec() for s in senders]
    assert all(s.kind == "pair" and s.pair_backend == "gloo" for s in specs)
    assert len(pickle.dumps(specs[0])) < 1024
    proc, conn = _spawn_reader(specs, "cpu")
    try:
        for s in senders:  # the reader opens its ends in this order; each open meets a connect
            s.connect()
        for i, sender in enumerate(senders):
            for seed, n in enumerate([16, 3, 0, 9, 17, 1, 5]):  # wraps; empty; 17 rows inline
                ref = sender.put(*_data(seed, n, 6, sender.dtype))
                assert (ref.aux is not None) == (n > 16)
                conn.send((i, ref, seed))
                assert conn.recv(), (sender.dtype, seed)
        # Puts ahead of the reader, as far as the contract allows (num_slots − 1 unread).
        refs = [senders[0].put(*_data(50 + j, 4 + j, 6, torch.float32)) for j in range(2)]
        for j, ref in enumerate(refs):
            conn.send((0, ref, 50 + j))
            assert conn.recv()
        _finish(proc, conn)
    finally:
        for s in senders:
            s.close()


def test_pair_put_before_connect_is_refused():
    sender = make_aux_sender("cpu", num_slots=2, max_rows=4, width=3, dtype=torch.float32,
                             pair=True)
    with pytest.raises(RuntimeError, match="before connect"):
        sender.put(*_data(0, 2, 3, torch.float32))
    sender.close()
