"""Full attention's prologue as one Triton launch (target/kernels/qk_rope_triton.py) against
the eager torch path it replaces (fused.rms_norm, fused.rope, attention.store_kv): the real
head shape with partial RoPE, GQA, q as the strided half of the q projection's view, a head
dim that is not a power of two, slots out of order; the caches' other slots untouched. fp32
to rounding; half precision bit for bit but where the mean of squares summed in another
order moved a rounding (at most one spacing). On CUDA also bf16 and inside a CUDA graph.

Without CUDA the cases run in Triton's interpreter in one child process, this file run as a
script (tests/target/triton_child.py says why)."""

import json

import pytest
import torch
import triton_child

triton = pytest.importorskip("triton")

from target.kernels import fused, qk_rope_triton  # noqa: E402
from target.kernels.attention import store_kv  # noqa: E402

# "half": bf16 on CUDA, fp16 in the interpreter (numpy has no bf16: its casts truncate)
DTYPES = {"fp32": torch.float32, "half": torch.bfloat16}
# name: (tokens, Hq, Hkv, D, rotary_dim, page_size, strided q)
CASES = {
    "real_head": (3, 4, 2, 256, 64, 16, True),  # Qwen3.5: D 256, a quarter rotated
    "gqa_full_rope": (5, 8, 1, 32, 32, 4, False),
    "odd_dim": (4, 2, 2, 48, 16, 8, True),
}


def dtype_on(name: str, device: str) -> torch.dtype:
    return torch.float16 if name == "half" and device == "cpu" else DTYPES[name]


def problem(case, dtype, device="cpu", seed=0):
    tokens, hq, hkv, dim, rotary, page_size, strided = case
    g = torch.Generator(device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    q = torch.randn(tokens, hq, 2 * dim, **kw)  # [q | gate] per head, as the layer views it
    q = q[..., :dim] if strided else q[..., :dim].contiguous()
    k, v = torch.randn(tokens, hkv, dim, **kw), torch.randn(tokens, hkv, dim, **kw)
    q_w, k_w = torch.randn(dim, **kw) * 0.1, torch.randn(dim, **kw) * 0.1
    pos = torch.randint(0, 5000, (tokens,), **kw)
    inv_freq = 1.0 / (1e7 ** (torch.arange(0, rotary, 2, device=device).float() / rotary))
    cos, sin = fused.rope_cos_sin.eager(pos, inv_freq)
    pages = 2 * tokens // page_size + 2
    slots = torch.randperm(pages * page_size, **kw)[:tokens]  # out of order, across pages
    caches = [torch.randn(pages, page_size, hkv, dim, **kw) for _ in range(2)]
    cast = [t.to(dtype) for t in (q, k, v, q_w, k_w, *caches)]
    return (*cast[:5], cos, sin, rotary, *cast[5:], slots)


def reference(q, k, v, q_w, k_w, cos, sin, rotary, k_cache, v_cache, slots, eps=1e-6):
    """The layer's torch path, eager: returns q and the caches it leaves."""
    q = fused.rope.eager(fused.rms_norm.eager(q, q_w, eps), cos, sin, rotary)
    k = fused.rope.eager(fused.rms_norm.eager(k, k_w, eps), cos, sin, rotary)
    k_cache, v_cache = k_cache.clone(), v_cache.clone()
    store_kv(k, v, k_cache, v_cache, slots)
    return q, k_cache, v_cache


def case_result(name: str, dtype: str, device: str) -> dict:
    """The kernel against the reference on CASES[name], over q and both caches: the largest
    difference in spacings of the dtype, the share of elements equal, and the relative error
    (a rotated element can cancel to far below its inputs, where spacings say little)."""
    args = problem(CASES[name], dtype_on(dtype, device), device)
    want = reference(*args)
    k_cache, v_cache = args[8].clone(), args[9].clone()
    q, k, v, q_w, k_w, cos, sin, rotary, _, _, slots = args
    q = qk_rope_triton.qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, cos, sin, rotary, k_cache,
                                          v_cache, slots)
    got = (q, k_cache, v_cache)
    ulps, equal, n, err = 0.0, 0, 0, 0.0
    for a, b in zip(got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        ulps = max(ulps, triton_child.max_ulps(a, b))
        equal += int((a == b).sum())
        n += a.numel()
        err = max(err, ((a.double() - b.double()).norm() / b.double().norm()).item())
    return {"max_ulps": ulps, "equal": equal / n, "rel_err": err}


def all_case_results() -> dict[str, dict | str]:
    return triton_child.case_errors(CASES, DTYPES, case_result, "cpu")


def model_difference() -> float:
    """fp32 end to end: the tiny demo target's logits over a prefill of 3 prompts, a verify
    round and a decode step with the prologue in Triton against torch (each on fresh caches);
    the largest absolute difference."""
    import sys

    sys.path.insert(0, str(triton_child.ROOT / "tests" / "target"))
    from target_harness import TargetHarness

    from target.layers.attention import GatedAttention

    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (6, 13, 9)]
    blocks = [torch.randint(0, 300, (5,), generator=g).tolist() for _ in prompts]
    logits = {}
    for kind in ("torch", "triton"):
        h = TargetHarness(triton_child.ROOT / "tests/assets/tiny/target")
        for m in h.model.modules():
            if isinstance(m, GatedAttention):
                m.prologue = kind
        tables = [h.pages(64) for _ in prompts]
        out = h.logits([h.seq(i, p, 0, tables[i], i) for i, p in enumerate(prompts)], False)
        lens = [len(p) for p in prompts]
        out += h.logits([h.seq(i, b, lens[i], tables[i], i) for i, b in enumerate(blocks)],
                        True)
        h.commit([2, 5, 1])
        out += h.logits([h.seq(i, [7], lens[i] + n, tables[i], i)
                         for i, n in enumerate((2, 5, 1))], False)
        logits[kind] = torch.cat(out)
    return (logits["triton"] - logits["torch"]).abs().max().item()


interpreted, results = triton_child.fixtures(__file__, case_result)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_prologue_equals_the_torch_path(results, name, dtype):
    got = results(f"{name}/{dtype}")
    assert not isinstance(got, str), got
    if dtype == "fp32":  # the mean of squares' order and rsqrt's rounding
        assert got["rel_err"] < 1e-6, got
    else:
        assert got["max_ulps"] <= 1, got
        assert got["equal"] > 0.99, got


def test_without_tokens_it_writes_nothing():
    q, k, v, q_w, k_w, cos, sin, rotary, k_cache, v_cache, slots = problem(
        CASES["real_head"], torch.float32)
    before = k_cache.clone()
    out = qk_rope_triton.qk_norm_rope_store(q[:0], k[:0], v[:0], q_w, k_w, 1e-6, cos[:0],
                                            sin[:0], rotary, k_cache, v_cache, slots[:0])
    assert out.shape == (0, *q.shape[1:]) and torch.equal(k_cache, before)


def test_the_target_runs_alike_through_the_kernel(interpreted):
    if interpreted is None:
        pytest.skip("the CPU harness in the interpreter; on CUDA the engine's golden check "
                    "(tools/golden_check.py) covers the model")
    assert interpreted["model"] < 1e-4  # fp32 rounding through 4 layers; a wrong rotation is O(1)


@pytest.mark.gpu
def test_bf16_inside_a_cuda_graph():
    args = problem(CASES["real_head"], torch.bfloat16, "cuda")
    q, k, v, q_w, k_w, cos, sin, rotary, k_cache, v_cache, slots = args
    want = reference(*args)
    qk_rope_triton.qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, cos, sin, rotary,  # compiles
                                      k_cache.clone(), v_cache.clone(), slots)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = qk_rope_triton.qk_norm_rope_store(q, k, v, q_w, k_w, 1e-6, cos, sin, rotary,
                                                k_cache, v_cache, slots)
    graph.replay()
    for a, b in zip((out, k_cache, v_cache), want, strict=True):
        assert (a.float() - b.float()).abs().max() <= 1e-2 * b.abs().max().float()


if __name__ == "__main__":  # the interpreter child of results()
    print(json.dumps({"errors": all_case_results(), "model": model_difference()}))
