"""The control plane's cost per hop, both ends of it, on whatever machine runs it:

    python -m bench.control_plane --model tests/assets/tiny/target \
        --draft tests/assets/tiny/draft --tp 2 --out control_plane.json

Two processes alone (no Ray, no model), a message the size of a batch-8 round's step and back:
the control channel (workers/channel.py) with the spin off and on, against a Ray actor call.
Then through a running engine's actors (median / p90 over --iters):

  ray_call_to_workers   an empty Ray call to every TP worker (their second thread): what a
                        step cost per hop when steps rode Ray calls
  loop_round_trip       a CALL step through the loops: driver → every rank → rank 0 → driver
  propose               a PROPOSE step: driver → draft → every rank → rank 0 → driver
  verify                a ROUND with the drafts given (the draft sits it out)
  round                 a ROUND: the draft proposes, hands its drafts to the ranks, rank 0
                        answers, the draft writes its context
  engine_step           LLMEngine.step() of one running request (scheduling and bookkeeping
                        included)"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp

import ray
import torch

from bench.engine import Batch
from bench.timing import median_p90, sample_times
from cluster.ray_executor import RayEngineCluster
from configs.engine import EngineConfig, SamplingParams
from workers.channel import ChannelReader, ChannelWriter
from workers.messages import StepKind, StepMsg


def timeit(fn, iters: int) -> dict:
    return median_p90(sample_times(fn, iters, warmup=5)[0], "ms", 4)


def _echo(spec, spin_s: float, conn) -> None:
    """Spawned child: echoes every message of `spec` back on a channel of its own."""
    reader = ChannelReader(spec, 0, spin_s)
    back = ChannelWriter("shm", 1, spin_s=spin_s)
    conn.send(back.spec)
    conn.recv()
    back.seal()
    while (msg := reader.recv()) is not None:
        back.send(msg)


def channel_pingpong(spin_s: float, iters: int) -> dict:
    msg = StepMsg(0, StepKind.ROUND, seq_ids=list(range(8)), starts=[512] * 8,
                  anchors=list(range(8)))
    out = ChannelWriter("shm", 1, spin_s=spin_s)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_echo, args=(out.spec, spin_s, child), daemon=True)
    proc.start()
    back = ChannelReader(parent.recv(), 0, spin_s)
    parent.send("go")
    out.seal()
    result = timeit(lambda: (out.send(msg), back.recv(60)), iters)
    out.send(None)
    proc.join(timeout=30)
    out.close()
    back.close()
    return result


@ray.remote(num_cpus=0)
class _Echo:
    def echo(self, msg):
        return msg


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--control-spin-us", type=int, default=None)
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    results: dict = {"two_processes": {
        "channel_no_spin": channel_pingpong(0.0, args.iters),
        "channel_spin_1ms": channel_pingpong(1e-3, args.iters),
    }}
    echo = _Echo.remote()
    msg = StepMsg(0, StepKind.ROUND, seq_ids=list(range(8)), starts=[512] * 8,
                  anchors=list(range(8)))
    results["two_processes"]["ray_actor_call"] = timeit(
        lambda: ray.get(echo.echo.remote(msg)), args.iters)
    cfg = EngineConfig(model=args.model, draft_model=args.draft, block_size=args.block_size,
                       device=args.device, dtype=args.dtype, max_num_seqs=4, kv_block_size=16,
                       control_spin_us=args.control_spin_us)
    cluster = RayEngineCluster(cfg, args.tp)
    eng = cluster.engine
    batch = Batch(cluster.executor, 1, 32, 4 * (args.iters + 10) * 4 * args.block_size, 16,
                  eng.target_config.vocab_size)
    batch.prefill()
    drafts = batch.random_drafts(args.block_size - 1)
    engine_results = {
        "ray_call_to_workers": timeit(
            lambda: ray.get([w.ping.remote() for w in cluster.workers]), args.iters),
        "loop_round_trip": timeit(lambda: cluster.call_workers("ping"), args.iters),
        "propose": timeit(batch.propose, args.iters),
        "verify": timeit(lambda: batch.verify(drafts), args.iters),
        "round": timeit(batch.round, args.iters),
    }
    batch.release()
    eng.add_request(list(range(10, 40)), SamplingParams(max_tokens=1 << 20, ignore_eos=True))
    eng.step()  # prefill
    engine_results["engine_step"] = timeit(eng.step, args.iters)
    results["engine"] = engine_results
    report = {"tp": args.tp, "device": args.device, "dtype": args.dtype,
              "block_size": args.block_size, "channel": cluster.channel_kind,
              "spin_us": cfg.control_spin_s * 1e6,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None,
              "results": results}
    print(json.dumps(report, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    cluster.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
