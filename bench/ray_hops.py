"""Per-round cost of each Ray hop of the cluster path, on whatever machine runs it.

    python -m bench.ray_hops --model tests/assets/tiny/target --draft tests/assets/tiny/draft --tp 2

Times (median / p90 over --iters): an empty call to every TP worker (driver → workers fan-out),
an empty call to the draft actor, the draft's propose, a verify round through the workers, and
the context write carrying one round's aux features: inline through the object store, and as
a ref into the ring rank 0 shares with the draft (shared memory on CPU, CUDA IPC on GPU)."""

from __future__ import annotations

import argparse
import json

import ray
import torch

from bench.timing import median_p90, sample_times
from cluster.ray_executor import RayEngineCluster
from configs.engine import EngineConfig, SamplingParams
from workers.model_runner import SeqInput


def timeit(fn, iters: int) -> dict:
    return median_p90(sample_times(fn, iters, warmup=3)[0], "ms", 3)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--device", default="cpu")
    p.add_argument("--iters", type=int, default=100)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--out", help="also write the JSON report here")
    args = p.parse_args()
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False)
    cfg = EngineConfig(model=args.model, draft_model=args.draft, block_size=args.block_size,
                       device=args.device, dtype=args.dtype, max_num_seqs=4, kv_block_size=16)
    cluster = RayEngineCluster(cfg, args.tp)
    eng = cluster.engine
    rid = eng.add_request(list(range(10, 40)), SamplingParams(max_tokens=1000, ignore_eos=True))
    eng.step()  # prefill
    seq = eng._by_request[rid]
    B, aux_width = eng.block_size, eng.plan.target_config.hidden_size * len(eng.plan.aux_layer_ids)
    block = [seq.anchor] + [1] * (B - 1)
    verify_in = [SeqInput(seq.seq_id, block, seq.num_cached, seq.block_table, seq.state_slot,
                          seq.params)]
    aux = torch.randn(B, aux_width, dtype=cfg.torch_dtype)
    pos = torch.arange(seq.num_cached, seq.num_cached + B)
    out = eng.runner.verify(verify_in)  # rank 0 put its committed rows into the ring
    ring_ref, ring_pos = out.aux_ref, out.aux_positions
    results = {
        "workers_empty_call": timeit(lambda: ray.get([w.ping.remote() for w in cluster.workers]),
                                     args.iters),
        "draft_empty_call": timeit(lambda: ray.get(cluster.draft.ping.remote()), args.iters),
        "draft_propose": timeit(lambda: eng.drafter.propose([seq.anchor], [seq.num_cached],
                                                            [seq.block_table]), args.iters),
        # Re-verifies the same block at the same position. Each repeat commits whatever it
        # accepts, so the sequence's state drifts from its bookkeeping: only timings are read.
        "verify_round": timeit(lambda: eng.runner.verify(verify_in), args.iters),
        # One round's aux features to the draft: inline through the object store (the
        # pre-ring path) vs a ref into the ring rank 0 shares with the draft (what runs now).
        "context_write_object_store": timeit(lambda: ray.get(cluster.draft.write_context.remote(
            aux, pos, [seq.block_table], [B])), args.iters),
        "context_write_ring": timeit(lambda: ray.get(cluster.draft.write_context.remote(
            ring_ref, ring_pos, [seq.block_table], [ring_ref.num_rows])), args.iters),
        "full_engine_step": timeit(eng.step, args.iters),
    }
    report = {"tp": args.tp, "device": args.device, "dtype": args.dtype, "block_size": B,
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
