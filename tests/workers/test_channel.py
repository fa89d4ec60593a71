"""The control channel (workers/channel.py), shared memory and TCP: every reader gets every
message in order (also messages spanning many chunks), a full ring holds the writer until the
slowest reader reads, a dead reader or writer ends the other side's wait through its check (or
its timeout) instead of hanging it, close ends the readers after what was sent, and sealing
leaves no name behind in /dev/shm."""

from __future__ import annotations

import multiprocessing as mp
import os
import threading

import pytest

from workers.channel import (
    ChannelClosed,
    ChannelReader,
    ChannelTimeout,
    ChannelWriter,
)

KINDS = ["shm", "tcp"]


def _messages() -> list:
    # Small ones, one of exactly a chunk, and ones spanning many chunks of 512 bytes.
    return ([{"step": i, "ids": list(range(i))} for i in range(40)]
            + [b"x" * 512, b"y" * 5000, list(range(3000)), "end"])


def _read_all(spec, index: int, conn) -> None:
    """Spawned child: opens reader `index`, says so, then sends back everything it reads until
    the channel closes."""
    reader = ChannelReader(spec, index)
    conn.send("open")
    got = []
    try:
        while True:
            got.append(reader.recv(timeout_s=60))
    except ChannelClosed:
        pass
    conn.send(got)


def _spawn(target, *args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    return proc, parent


@pytest.mark.parametrize("kind", KINDS)
def test_every_reader_gets_every_message_in_order(kind):
    writer = ChannelWriter(kind, num_readers=3, chunk_bytes=512, num_chunks=4)
    readers = [_spawn(_read_all, writer.spec, i) for i in range(3)]
    for _, conn in readers:
        assert conn.recv() == "open"
    writer.seal()
    for msg in _messages():
        writer.send(msg, timeout_s=60)
    writer.close()
    for proc, conn in readers:
        assert conn.recv() == _messages()
        proc.join(timeout=30)
        assert proc.exitcode == 0


@pytest.mark.parametrize("kind", KINDS)
def test_a_full_ring_holds_the_writer_until_the_reader_reads(kind):
    # TCP's ring is the kernel's socket buffers: several MB before it holds the writer.
    writer = ChannelWriter(kind, num_readers=1, chunk_bytes=1024, num_chunks=2)
    reader = ChannelReader(writer.spec, 0)
    writer.seal()
    big = b"z" * (8 << 20) if kind == "tcp" else b"z" * 1000  # one chunk each on shm
    sent: list[int] = []

    def send_three() -> None:
        for i in range(3):
            writer.send((i, big), timeout_s=60)
            sent.append(i)

    thread = threading.Thread(target=send_three)
    thread.start()
    thread.join(timeout=0.5)
    assert thread.is_alive() and len(sent) < 3  # held: nothing has been read
    assert [reader.recv(timeout_s=60)[0] for _ in range(3)] == [0, 1, 2]
    thread.join(timeout=30)
    assert sent == [0, 1, 2]
    writer.close()
    reader.close()


def _read_one_then_die(spec, conn) -> None:
    reader = ChannelReader(spec, 0)
    conn.send("open")
    reader.recv(timeout_s=60)
    os._exit(0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_dead_reader_ends_the_writers_wait(kind):
    writer = ChannelWriter(kind, num_readers=1, chunk_bytes=1024, num_chunks=2)
    proc, conn = _spawn(_read_one_then_die, writer.spec)
    assert conn.recv() == "open"
    writer.seal()
    writer.send("first", timeout_s=60)
    proc.join(timeout=30)

    def check() -> None:
        if not proc.is_alive():
            raise RuntimeError("the reader died")

    with pytest.raises((RuntimeError, ChannelClosed)):
        for _ in range(100):  # shm: held once the ring is full; tcp: the peer's reset
            writer.send(b"w" * (1 << 20 if kind == "tcp" else 1000), timeout_s=60,
                        check=check)
    writer.close()


def _write_then_die(kind, conn) -> None:
    writer = ChannelWriter(kind, num_readers=1)
    conn.send(writer.spec)
    assert conn.recv() == "opened"
    writer.seal()
    writer.send("last words", timeout_s=60)
    os._exit(0)


@pytest.mark.parametrize("kind", KINDS)
def test_a_dead_writer_ends_the_readers_wait(kind):
    proc, conn = _spawn(_write_then_die, kind)
    reader = ChannelReader(conn.recv(), 0)
    conn.send("opened")
    assert reader.recv(timeout_s=60) == "last words"
    proc.join(timeout=30)

    def check() -> None:
        if not proc.is_alive():
            raise RuntimeError("the writer died")

    with pytest.raises((RuntimeError, ChannelClosed)):  # shm: the check; tcp: EOF
        reader.recv(timeout_s=60, check=check)
    with pytest.raises((ChannelTimeout, ChannelClosed)):  # no check: the timeout, or EOF
        reader.recv(timeout_s=0.2)
    reader.close()


@pytest.mark.parametrize("kind", KINDS)
def test_close_ends_readers_after_what_was_sent(kind):
    writer = ChannelWriter(kind, num_readers=2)
    readers = [ChannelReader(writer.spec, i) for i in range(2)]
    writer.seal()
    writer.send("a")
    writer.send("b")
    writer.close()
    for reader in readers:
        assert [reader.recv(timeout_s=10), reader.recv(timeout_s=10)] == ["a", "b"]
        with pytest.raises(ChannelClosed):
            reader.recv(timeout_s=10)
        reader.close()


def test_a_wait_without_messages_times_out():
    writer = ChannelWriter("shm", num_readers=1)
    reader = ChannelReader(writer.spec, 0)
    writer.seal()
    with pytest.raises(ChannelTimeout):
        reader.recv(timeout_s=0.1)
    writer.close()
    reader.close()


def test_sealing_leaves_nothing_in_dev_shm_and_the_channel_keeps_working():
    writer = ChannelWriter("shm", num_readers=1, spin_s=0.001)
    spec = writer.spec
    reader = ChannelReader(spec, 0, spin_s=0.001)
    writer.seal()
    assert not os.path.exists(f"/dev/shm/{spec.shm_name}")
    assert not os.path.exists(spec.fifo_dir)
    for i in range(20):  # more messages than chunks: wake-ups and reuse after the unlink
        writer.send(i)
        assert reader.recv(timeout_s=10) == i
    with pytest.raises(FileNotFoundError):
        ChannelReader(spec, 0)
    writer.close()
    reader.close()


def test_bad_arguments_name_what_is_wrong():
    with pytest.raises(ValueError, match="kind"):
        ChannelWriter("udp", 1)
    with pytest.raises(ValueError, match="num_readers"):
        ChannelWriter("shm", 0)
    writer = ChannelWriter("shm", 1)
    with pytest.raises(ValueError, match="reader index"):
        ChannelReader(writer.spec, 1)
    writer.close()


def test_the_spin_default_spins_only_on_gpu_hosts_with_cores_to_spare(monkeypatch):
    from configs import engine as engine_config

    def spin_s(device: str, cores: int, **kw) -> float:
        monkeypatch.setattr(engine_config.os, "cpu_count", lambda: cores)
        return engine_config.EngineConfig(model="m", device=device, **kw).control_spin_s

    long_spin = engine_config.CONTROL_SPIN_US * 1e-6
    assert spin_s("cuda", 16) == long_spin
    assert spin_s("cuda:1", engine_config.SPIN_MIN_CPUS) == long_spin
    assert spin_s("cuda", engine_config.SPIN_MIN_CPUS - 1) == 0.0
    assert spin_s("cpu", 64) == 0.0  # the model's own threads need the cores
    assert spin_s("cpu", 2, control_spin_us=300) == pytest.approx(300e-6)
    with pytest.raises(ValueError, match="control_spin_us"):
        spin_s("cuda", 16, control_spin_us=-1)
