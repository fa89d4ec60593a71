"""Host time of the runners' own work per step — ModelRunner.verify (inputs, graph padding and
buffer copies, acceptance, the commit, the committed rows) and DraftRunner.propose /
write_context — with models that return at once, through the same CUDA-graph code path the
GPU takes (on CPU the "graphs" run their function on the static buffers). What is left is
the Python and tensor bookkeeping around the kernels: on a GPU every microsecond of it after
a step's host sync is a microsecond the device waits.

    python -m bench.runner_overhead [--batch-sizes 1 8 32] [--widths 1 16] [--out FILE]

Medians over --iters calls, in µs. Device-independent: run it where the change is made."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from configs.engine import SamplingParams
from draft.proposer import DraftRunner
from target.batch import TargetCaches
from workers.cuda_graphs import MAX_GRAPH_WIDTH, RoundGraphs, num_scratch_pages
from workers.messages import ContextWrite, ProposeRequest
from workers.model_runner import ModelRunner, SeqInput

HIDDEN, VOCAB, AUX = 8, 8, (1, 3)  # tiny: the stubs' own tensor work stays negligible
PAGE = 16


class InstantTarget(nn.Module):
    """The target's interface with no work: zeros for hidden states, aux rows and logits."""

    def forward(self, batch, caches):
        t = batch.input_ids.shape[0]
        return (torch.zeros(t, HIDDEN, device=batch.input_ids.device),
                torch.zeros(t, HIDDEN * len(AUX), device=batch.input_ids.device))

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], VOCAB, device=hidden.device)

    def commit_verify(self, batch, caches, num_kept) -> None:
        pass


class InstantDraft(nn.Module):
    def allocate_kv_cache(self, num_blocks: int, page: int):
        return []

    def write_context(self, aux, positions, slot_mapping, kv_cache) -> None:
        pass

    def propose(self, anchors, context_lens, block_tables, kv_cache, embed, lm_head, block):
        return torch.zeros(anchors.shape[0], block - 1, dtype=torch.long, device=anchors.device)


def time_us(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t)
    return statistics.median(samples) * 1e6


def measure(b: int, width: int, block: int, context: int, iters: int,
            device: torch.device) -> dict:
    # every sequence's table reaches past its context by 1024 tokens, as an admission
    # reserving max_tokens leaves it
    pages_per_seq = -(-(context + 1024) // PAGE)
    num_blocks = b * pages_per_seq
    scratch = num_scratch_pages(MAX_GRAPH_WIDTH, PAGE)
    kv = torch.zeros(num_blocks + scratch, PAGE, 1, 1, device=device)
    caches = TargetCaches(kv={0: (kv, kv)}, conv={}, ssm={})
    model = InstantTarget()
    graphs = RoundGraphs(model, caches, AUX, device, b, pages_per_seq,
                         list(range(num_blocks, num_blocks + scratch)), b)
    runner = ModelRunner(model, caches, AUX, device, graphs=graphs)
    tables = [list(range(i * pages_per_seq, (i + 1) * pages_per_seq)) for i in range(b)]
    # as the steppers pass them: each sequence's table also as the tensor made at admission
    tables_t = [torch.tensor(t, dtype=torch.int32) for t in tables]
    greedy = SamplingParams()
    seqs = [SeqInput(i, [7] * width, context, tables[i], i, greedy, block_table_t=tables_t[i])
            for i in range(b)]
    drafter = DraftRunner(InstantDraft(), num_blocks, PAGE, block, None, None, device,
                          graph_max_seqs=b, graph_max_pages=pages_per_seq)
    committed = [1 + min(3, width - 1)] * b  # what a round commits at τ ≈ 4
    aux = torch.zeros(sum(committed), HIDDEN * len(AUX), device=device)
    positions = torch.cat([torch.arange(context, context + n) for n in committed])
    write = ContextWrite(aux, positions, tables_t, committed)
    propose = ProposeRequest([7] * b, [context] * b, tables_t)
    return {"batch": b, "width": width, "context": context,
            "verify_us": time_us(lambda: runner.verify(seqs), iters),
            "write_context_us": time_us(lambda: drafter.write_context(write), iters),
            "propose_us": time_us(lambda: drafter.propose(propose), iters)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--widths", type=int, nargs="+", default=[1, 16],
                   help="tokens per sequence in the verify (1: a decode step)")
    p.add_argument("--block-size", type=int, default=16, help="the draft's B")
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 32768],
                   help="tokens before the step (the block tables' length follows)")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out")
    args = p.parse_args(argv)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # host work is one thread's; a second would only add noise
    try:
        rows = [measure(b, w, args.block_size, n, args.iters, torch.device(args.device))
                for n in args.contexts for b in args.batch_sizes for w in args.widths]
    finally:
        torch.set_num_threads(threads)
    print("| context | batch | width | verify µs | draft write µs | propose µs |\n"
          "|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['batch']} | {r['width']} | {r['verify_us']:.0f} | "
              f"{r['write_context_us']:.0f} | {r['propose_us']:.0f} |")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
