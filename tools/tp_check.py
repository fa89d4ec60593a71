"""Tensor-parallel correctness on the real architecture without a checkpoint: the target's
logits at TP N against TP 1, over the same random weights (`load_format="dummy"`), through a
batched prefill, a verify round, a partial commit and a second verify.

    NCCL_NVLS_ENABLE=0 python -m tools.tp_check --preset qwen3.5-35b-a3b --device cuda \
        --dtype bfloat16 --tp 2 --out tp2.json
    python -m tools.tp_check --preset tiny --device cpu --dtype float32 --tp 2   # gloo

Each size runs in its own spawned processes (rank r on cuda:r; the TP 1 reference first, on
cuda:0, so the two never share memory), and rank 0 saves its logits. Reported per forward: the
largest absolute difference, that over the largest |logit| (relative), and the share of rows
whose argmax agrees. In fp32 the sizes differ only by summation order; in bf16 by bf16
rounding of partial sums, so the argmax may move only where the top two logits are that
close (`near_tie_rows` counts disagreeing rows whose TP-1 top-2 gap is within --tie-ulps bf16
spacings)."""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import tempfile
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from configs.engine import SamplingParams
from configs.presets import target_preset
from target.distributed import TPGroup
from target.loader import load_target
from workers.cache import allocate_target_caches
from workers.model_runner import ModelRunner, SeqInput

PAGE_SIZE = 16
BLOCK = 16  # verify width
KEPT_EVERY = 3  # after the first verify sequence i keeps 1 + (i · 3) mod BLOCK tokens


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@torch.inference_mode()
def scenario(model, device: torch.device, prompt_lens: list[int], vocab: int) -> dict:
    """Batched prefill → verify BLOCK each → commit a different prefix each → verify again.
    Logits of the prefill's last rows and of every verify row, fp32 on the CPU."""
    pages = -(-(max(prompt_lens) + 2 * BLOCK) // PAGE_SIZE)
    n = len(prompt_lens)
    caches = allocate_target_caches(model, n * pages, PAGE_SIZE, n, device)
    runner = ModelRunner(model, caches, (), device)
    gen = torch.Generator().manual_seed(7)
    tables = [list(range(i * pages, (i + 1) * pages)) for i in range(n)]
    params = SamplingParams()
    out: dict[str, torch.Tensor] = {}

    def forward(name: str, seqs: list[SeqInput], verify: bool, rows=None):
        batch = runner._batch(seqs, is_verify=verify)
        hidden, _ = model(batch, caches)
        hidden = hidden if rows is None else hidden[rows]
        out[name] = model.compute_logits(hidden).float().cpu()
        return batch

    prompts = [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in prompt_lens]
    last = torch.tensor(prompt_lens).cumsum(0) - 1
    forward("prefill_last", [SeqInput(i, p, 0, tables[i], i, params)
                             for i, p in enumerate(prompts)], False, last.to(device))
    blocks = [torch.randint(0, vocab, (BLOCK,), generator=gen).tolist() for _ in prompts]
    batch = forward("verify1", [SeqInput(i, b, len(prompts[i]), tables[i], i, params)
                                for i, b in enumerate(blocks)], True)
    kept = [1 + (i * KEPT_EVERY) % BLOCK for i in range(n)]
    model.commit_verify(batch, caches, kept)
    blocks = [torch.randint(0, vocab, (BLOCK,), generator=gen).tolist() for _ in prompts]
    forward("verify2", [SeqInput(i, b, len(prompts[i]) + kept[i], tables[i], i, params)
                        for i, b in enumerate(blocks)], True)
    return out


def _rank(rank: int, size: int, port: int, args: dict, out_dir: str) -> None:
    try:
        cuda = args["device"] == "cuda"
        device = torch.device("cuda", rank) if cuda else torch.device("cpu")
        if cuda:
            torch.cuda.set_device(device)
        else:
            torch.set_num_threads(1)
        if size > 1:
            dist.init_process_group("nccl" if cuda else "gloo",
                                    init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                    world_size=size, timeout=timedelta(seconds=300))
        try:
            model = load_target(args["model_dir"], tp=TPGroup(rank=rank, size=size),
                                dtype=getattr(torch, args["dtype"]), device=device,
                                load_format="dummy")
            out = scenario(model, device, args["prompt_lens"], model.config.vocab_size)
            if rank == 0:
                torch.save(out, Path(out_dir) / f"tp{size}.pt")
        finally:
            if size > 1:
                dist.destroy_process_group()
    except BaseException:
        (Path(out_dir) / f"tp{size}_rank{rank}.err").write_text(traceback.format_exc())
        raise


def run_size(size: int, args: dict, out_dir: str) -> dict[str, torch.Tensor]:
    try:
        mp.start_processes(_rank, args=(size, _free_port(), args, out_dir), nprocs=size,
                           join=True, start_method="spawn")
    except Exception as e:
        errors = "\n".join(p.read_text() for p in sorted(Path(out_dir).glob("*.err")))
        raise RuntimeError(f"TP {size} failed: {e}\n{errors}") from e
    return torch.load(Path(out_dir) / f"tp{size}.pt")


def compare(got: dict, want: dict, tie_ulps: float) -> dict:
    report = {}
    for name, ref in want.items():
        diff = (got[name] - ref).abs()
        top2 = ref.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        spacing = torch.tensor([2.0 ** (math.floor(math.log2(max(abs(v), 1e-30))) - 7)
                                for v in top2[:, 0].tolist()])
        disagree = got[name].argmax(-1) != ref.argmax(-1)
        report[name] = {
            "rows": ref.shape[0], "max_abs_diff": diff.max().item(),
            "max_rel_diff": (diff.max() / ref.abs().max()).item(),
            "argmax_agree": 1.0 - disagree.float().mean().item(),
            "near_tie_rows": int((disagree & (gap <= tie_ulps * spacing)).sum()),
            "disagreeing_rows": int(disagree.sum())}
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="qwen3.5-35b-a3b")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   choices=["cuda", "cpu"])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--tp", type=int, nargs="+", default=[2], help="sizes compared with TP 1")
    p.add_argument("--prompt-lens", type=int, nargs="+", default=[37, 5, 120, 64])
    p.add_argument("--tie-ulps", type=float, default=8)
    p.add_argument("--out", help="write the JSON report here")
    a = p.parse_args()
    if a.device == "cuda" and max(a.tp) > torch.cuda.device_count():
        raise SystemExit(f"--tp {max(a.tp)} needs that many GPUs; this host has "
                         f"{torch.cuda.device_count()}")
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "model").mkdir()
        (Path(tmp) / "model" / "config.json").write_text(json.dumps(target_preset(a.preset)))
        args = {"model_dir": str(Path(tmp) / "model"), "device": a.device, "dtype": a.dtype,
                "prompt_lens": a.prompt_lens}
        want = run_size(1, args, tmp)
        report = {"preset": a.preset, "device": a.device, "dtype": a.dtype,
                  "prompt_lens": a.prompt_lens, "block": BLOCK, "vs_tp1": {}}
        for size in a.tp:
            report["vs_tp1"][str(size)] = compare(run_size(size, args, tmp), want, a.tie_ulps)
            print(json.dumps({f"tp{size}": report["vs_tp1"][str(size)]}), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
