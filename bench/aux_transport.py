"""Per-round cost of moving one step's aux features [N, D] and positions [N] from the target's
rank 0 to a draft in another process: through the aux ring (workers/aux_transport.py) against
a pickled CPU round trip, which is what the object store does (`.cpu()` + pickle + unpickle +
`.to(device)`).

    python -m bench.aux_transport --out aux_transport.json

The sender is this process, the reader a spawned child; both rows of a round include one pipe
message each way, standing in for the Ray hops (the `ping` row is that floor alone). A round
ends when the child has the tensors on its device and its stream is synchronised, then acks:
  ring    put (copy into the slot, record the event) → ref over the pipe → get (event wait)
  pickle  .cpu() → pickle → bytes over the pipe → unpickle → .to(device)
  ring_stream_wait (cuda only)  the ring with the reader's stream, not its host, waiting on the
          event: the alternative workers/aux_transport.py rejects, kept here to show why
  pair    (--pair-device) the transport of a draft on another device: put (copy into a send
          slot, post the send) → ref over the pipe → get (recv into the reader's buffer);
          NCCL between two GPUs (--device cuda:0 --pair-device cuda:1), gloo on CPU
The pipe copies the pickled bytes through the kernel where Ray's plasma store copies them into
shared memory (the path before the ring made two such hops: rank 0 → driver → draft). A get
is followed by the release that lets the sender reuse the slot.
Plain torch, no Ray. Defaults: D = 5·2048 (the 35B-A3B draft), bf16 on CUDA, fp32 on CPU."""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import pickle
from collections.abc import Callable

import torch

from bench.timing import median_p90, sample_times
from workers.aux_transport import AuxReceiver, make_aux_sender


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _reader(conn, device_name: str) -> None:
    """Spawned child: serves ("open", spec), ("ring", ref), ("ring_stream_wait", ref),
    ("pickle",) + bytes, ("ping",), ("close",) with an ack each, until None."""
    device = torch.device(device_name)
    receiver = None
    while (msg := conn.recv()) is not None:
        if msg[0] == "open":  # ("open", spec[, device]): a pair's reader sits on another one
            receiver = AuxReceiver.open(msg[1], msg[2] if len(msg) > 2 else device)
        elif msg[0] == "ring":
            aux, pos = receiver.get(msg[1])
            _sync(receiver.device)
            receiver.release(msg[1])
        elif msg[0] == "ring_stream_wait":  # the reader wait the module rejects, for comparison
            ref = msg[1]
            torch.cuda.current_stream(device).wait_event(receiver._copied)
            aux = receiver.aux_ring[ref.slot, : ref.num_rows]
            pos = receiver.pos_ring[ref.slot, : ref.num_rows]
            _sync(device)
            receiver.release(ref)
        elif msg[0] == "pickle":
            aux, pos = pickle.loads(conn.recv_bytes())
            aux, pos = aux.to(device), pos.to(device)
            _sync(device)
        elif msg[0] == "close":
            receiver.close()
            receiver = aux = pos = None  # drop views before the sender frees the ring
        conn.send(True)


def timeit(fn: Callable[[], None], iters: int, warmup: int = 5) -> dict:
    return median_p90(sample_times(fn, iters, warmup)[0], "us", 1)


def _call(conn, *msg) -> None:
    conn.send(msg)
    conn.recv()


def _pickled(conn, aux: torch.Tensor, pos: torch.Tensor) -> None:
    conn.send(("pickle",))
    conn.send_bytes(pickle.dumps((aux.cpu(), pos.cpu()), protocol=5))
    conn.recv()


def bench_rows(conn, n: int, width: int, dtype: torch.dtype, device: torch.device,
               iters: int, pair_device: str | None = None) -> dict:
    # Two slots suffice: every round waits for the reader's ack (the contract's limit).
    sender = make_aux_sender(device, num_slots=2, max_rows=n, width=width, dtype=dtype)
    _call(conn, "open", sender.spec())
    aux = torch.randn(n, width, device=device).to(dtype)  # [N, D]
    pos = torch.arange(n, device=device)  # [N]
    row = {"rows": n, "mib": round(n * width * dtype.itemsize / 2**20, 2),
           "ring": timeit(lambda: _call(conn, "ring", sender.put(aux, pos)), iters),
           "pickle": timeit(lambda: _pickled(conn, aux, pos), iters)}
    if device.type == "cuda":
        row["ring_stream_wait"] = timeit(
            lambda: _call(conn, "ring_stream_wait", sender.put(aux, pos)), iters)
    _call(conn, "close")
    sender.close()
    if pair_device is not None:
        sender = make_aux_sender(device, num_slots=2, max_rows=n, width=width, dtype=dtype,
                                 pair=True)
        conn.send(("open", sender.spec(), pair_device))
        sender.connect()  # meets the reader's open
        conn.recv()
        row["pair"] = timeit(lambda: _call(conn, "ring", sender.put(aux, pos)), iters)
        _call(conn, "close")
        sender.close()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True, help="JSON file for the results")
    p.add_argument("--rows", type=int, nargs="+", default=[16, 128, 1024, 8192])
    p.add_argument("--width", type=int, default=5 * 2048)
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--pair-device", help="also the pair transport, its reader on this device "
                   "(cuda:1 with two GPUs; cpu for gloo)")
    args = p.parse_args()
    device = torch.device("cuda", 0) if args.device.startswith("cuda") else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32

    ctx = mp.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    child = ctx.Process(target=_reader, args=(child_conn, str(device)), daemon=True)
    child.start()
    results = {"ping": timeit(lambda: _call(conn, "ping"), args.iters), "rows": []}
    for n in args.rows:
        row = bench_rows(conn, n, args.width, dtype, device, args.iters, args.pair_device)
        results["rows"].append(row)
        print(f"N={n:5d} {row['mib']:8.2f} MiB", "  ".join(
            f"{k} {v['median_us']:.1f} / {v['p90_us']:.1f} us" for k, v in row.items()
            if isinstance(v, dict)), "(median / p90)", flush=True)
    conn.send(None)
    child.join(timeout=60)

    print(f"ping (pipe round trip alone): {results['ping']['median_us']} / "
          f"{results['ping']['p90_us']} us (median / p90)")
    results.update(
        device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__, dtype=str(dtype), width=args.width, iters=args.iters,
        date=datetime.date.today().isoformat())
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
