"""The numerical check of the CUDA (fla) Gated DeltaNet path against the torch reference.

    python -m tools.gpu.check_fla --target DIR [--draft DIR]

1. Kernel level: fla chunk / fused-recurrent vs the torch recurrence on random inputs with a
   random initial state (fp32 and bf16), relative error of outputs and final states.
2. Model level: the tiny target on CUDA (fla path) vs on CPU (torch path), fp32: logits of a
   prefill, a verify block, and a verify after a rollback.
3. Engine level: greedy speculative output == greedy target-only output on CUDA, fp32.
"""

from __future__ import annotations

import argparse
import json

import torch

from target.kernels import gdn, gdn_torch


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def kernel_check() -> list[dict]:
    assert gdn._fla() is not None, "fla is not importable"
    rows = []
    g = torch.Generator(device="cuda").manual_seed(0)
    h, dk, dv = 8, 128, 128
    for dtype in (torch.float32, torch.bfloat16):
        for length in (1, 8, 16, 65, 300):
            q = torch.randn(length, h, dk, device="cuda", generator=g)
            k = torch.randn(length, h, dk, device="cuda", generator=g)
            q = q / q.norm(dim=-1, keepdim=True) * dk**-0.5
            k = k / k.norm(dim=-1, keepdim=True)
            v = torch.randn(length, h, dv, device="cuda", generator=g)
            gg = -torch.rand(length, h, device="cuda", generator=g) * 0.5
            beta = torch.rand(length, h, device="cuda", generator=g)
            s0 = torch.randn(h, dk, dv, device="cuda", generator=g) * 0.1
            ref_o, ref_s = gdn_torch.recurrent_gated_delta_rule(q, k, v, gg, beta, s0)
            o, s = gdn.gated_delta_rule(q.to(dtype), k.to(dtype), v.to(dtype), gg, beta, s0)
            rows.append({"dtype": str(dtype), "len": length, "kernel": "chunk" if length > 64
                         else "fused_recurrent", "out_rel_err": rel(o.float(), ref_o),
                         "state_rel_err": rel(s.float(), ref_s),
                         "finite": bool(torch.isfinite(o).all())})
    return rows


def model_check(target_dir: str) -> dict:
    from configs.engine import SamplingParams
    from target.loader import load_target
    from workers.cache import allocate_target_caches
    from workers.model_runner import ModelRunner, SeqInput

    results = {}
    logits = {}
    for device in ("cpu", "cuda"):
        model = load_target(target_dir, device=device)
        caches = allocate_target_caches(model, 64, 16, 4, device)
        runner = ModelRunner(model, caches, (), device)
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, 300, (100,), generator=gen).tolist()
        block = torch.randint(0, 300, (16,), generator=gen).tolist()
        after = torch.randint(0, 300, (16,), generator=gen).tolist()
        table = list(range(10))
        sp = SamplingParams()
        out = []
        with torch.inference_mode():
            b = runner._batch([SeqInput(0, prompt, 0, table, 0, sp)], False)
            out.append(model.compute_logits(model(b, caches)[0]).cpu())
            b = runner._batch([SeqInput(0, block, 100, table, 0, sp)], True)
            out.append(model.compute_logits(model(b, caches)[0]).cpu())
            model.commit_verify(b, caches, [5])
            b = runner._batch([SeqInput(0, after, 105, table, 0, sp)], True)
            out.append(model.compute_logits(model(b, caches)[0]).cpu())
        logits[device] = out
    for name, a, b in zip(("prefill_100", "verify_16", "verify_after_rollback"),
                          logits["cuda"], logits["cpu"], strict=True):
        results[name] = {"max_abs_diff": (a - b).abs().max().item(), "rel_err": rel(a, b),
                         "argmax_equal": bool((a.argmax(-1) == b.argmax(-1)).all())}
    return results


def engine_check(target_dir: str, draft_dir: str | None) -> dict:
    from cluster.engine import LLMEngine
    from configs.engine import EngineConfig, SamplingParams

    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=gen).tolist() for n in (5, 17, 33, 64)]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    res = {}
    for dtype in ("float32", "bfloat16"):
        ar = LLMEngine(EngineConfig(model=target_dir, device="cuda", dtype=dtype, max_num_seqs=4))
        ref = [o.output_ids for o in ar.generate(prompts, params)]
        for block in (4, 16) if draft_dir else ():
            sp = LLMEngine(EngineConfig(model=target_dir, draft_model=draft_dir, block_size=block,
                                        device="cuda", dtype=dtype, max_num_seqs=4))
            got = [o.output_ids for o in sp.generate(prompts, params)]
            same = sum(a == b for g, r in zip(got, ref, strict=True)
                       for a, b in zip(g, r, strict=True))
            res[f"{dtype} B={block}"] = {
                "equal_to_target_only": got == ref,
                "token_match_rate": same / sum(len(r) for r in ref),
                "mean_acceptance": sp.stats.mean_acceptance_length}
    return res


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--target", required=True)
    p.add_argument("--draft")
    p.add_argument("--out")
    args = p.parse_args()
    report = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
              "kernels": kernel_check(), "model": model_check(args.target),
              "engine": engine_check(args.target, args.draft)}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
