"""The one-kernel MoE routing (target/kernels/moe_route.py) equals fused.moe_route, the
compiled reference: the same expert ids in the same order (torch.topk's; where logits tie,
the same values) and the same weights to rounding, for one token, an expert count that is no
power of two, k = 1, strided logits (the view the fused MoE input GEMM gives), bf16 logits
and weights; ties go to the lowest index first; a token's bits are the same alone and in a
batch; no tokens give empty results. On CUDA also at the real sizes and inside a CUDA graph.

Without CUDA the cases run in Triton's interpreter in one child process, this file run as a
script (tests/target/triton_child.py says why)."""

import json

import pytest
import torch
import triton_child

from target.kernels import fused, moe_route
from target.kernels.moe_route import route_topk, route_topk_available

needs_triton = pytest.mark.skipif(moe_route.triton is None, reason="needs triton")

# name: (tokens, experts, k, logits dtype, weights dtype, strided)
CASES = {
    "decode": (1, 16, 8, torch.float32, torch.float32, False),
    "odd_experts": (5, 60, 4, torch.float32, torch.float32, False),
    "top1": (3, 8, 1, torch.float32, torch.float32, False),
    "strided": (4, 24, 2, torch.float32, torch.float32, True),
    "bf16": (6, 32, 8, torch.bfloat16, torch.bfloat16, False),
}
# weights' largest difference from the reference, in units of the weights dtype's eps
MAX_EPS = 4


def logits_for(name: str, device: str) -> tuple[torch.Tensor, int, torch.dtype]:
    tokens, experts, k, dtype, out_dtype, strided = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    logits = torch.randn(tokens, experts + 5 if strided else experts, generator=g) * 3
    logits = logits.to(device, dtype)
    if strided:  # columns 2 … 2+E of a wider row: row stride E + 5
        logits = logits[:, 2 : 2 + experts]
    return logits, k, out_dtype


def case_result(name: str, device: str) -> dict:
    logits, k, out_dtype = logits_for(name, device)
    weights, ids = route_topk(logits, k, out_dtype)
    want_w, want_ids = fused.moe_route.eager(logits, k, out_dtype)
    eps = torch.finfo(out_dtype).eps
    # bf16 logits tie often: tied experts may come in another order than torch.topk's (or
    # another of them be picked at the k-th place); the picked values must still be equal,
    # and the ids wherever a value is unique in its row
    picked, want_picked = logits.gather(1, ids), logits.gather(1, want_ids)
    unique = (logits.unsqueeze(1) == want_picked.unsqueeze(2)).sum(-1) == 1  # [T, k]
    return {"ids_equal": bool(torch.equal(picked, want_picked)
                              and torch.equal(ids[unique], want_ids[unique])),
            "ties": int((~unique).sum()),
            "dtype_ok": weights.dtype == out_dtype and ids.dtype == torch.long,
            "max_eps": ((weights.double() - want_w.double()).abs().max() / eps).item()}


def extras(device: str) -> dict:
    # Ties: experts 1, 4 and 6 share the largest logit; 2 and 7 the next.
    tied = torch.tensor([[0.0, 5.0, 3.0, 0.0, 5.0, 1.0, 5.0, 3.0]], device=device)
    _, tie_ids = route_topk(tied, 5, torch.float32)
    logits, k, out_dtype = logits_for("odd_experts", device)
    w, ids = route_topk(logits, k, out_dtype)
    alone = [route_topk(logits[i : i + 1], k, out_dtype) for i in range(logits.shape[0])]
    empty_w, empty_ids = route_topk(logits[:0], k, out_dtype)
    return {"tie_ids": tie_ids[0].tolist(),
            "alone_equal": all(torch.equal(a[0], w[i : i + 1]) and torch.equal(a[1],
                                                                            ids[i : i + 1])
                               for i, a in enumerate(alone)),
            "empty_shapes": [list(empty_w.shape), list(empty_ids.shape)]}


def model_logits_gap() -> float:
    """The tiny target's prefill logits (fp32, CPU) with moe_routing "triton" against
    "torch": the largest difference."""
    from target_harness import TargetHarness

    from configs.kernels import KernelConfig
    from tests.conftest import ASSETS

    h = TargetHarness(ASSETS / "tiny" / "target")
    prompt = list(range(3, 40, 3))
    out = []
    for slot, routing in enumerate(("torch", "triton")):  # each from a fresh state slot
        h.model.set_kernels(KernelConfig(moe_routing=routing), graphs=False)
        out.append(h.logits([h.seq(0, prompt, 0, h.pages(16), slot)], verify=False)[0])
    return (out[0] - out[1]).abs().max().item()


def all_results(device: str) -> dict:
    out = {}
    for name in CASES:
        try:
            out[name] = case_result(name, device)
        except Exception as e:
            out[name] = f"{type(e).__name__}: {e}"
    return {"errors": out, "extras": extras(device),
            "model_gap": model_logits_gap() if device == "cpu" else None}


interpreted = triton_child.fixtures(__file__, lambda *a: None)[0]


@pytest.fixture(scope="module")
def results(interpreted):
    return all_results("cuda") if interpreted is None else interpreted


@needs_triton
@pytest.mark.parametrize("name", CASES)
def test_route_equals_the_compiled_reference(results, name):
    r = results["errors"][name]
    assert not isinstance(r, str), r
    assert r["ids_equal"] and r["dtype_ok"]
    assert r["max_eps"] <= MAX_EPS


@needs_triton
def test_ties_alone_and_empty(results):
    r = results["extras"]
    assert r["tie_ids"] == [1, 4, 6, 2, 7]  # the lowest index first among equal logits
    assert r["alone_equal"]
    assert r["empty_shapes"] == [[0, 4], [0, 4]]


@needs_triton
def test_the_tiny_target_routes_the_same_through_the_kernel(results):
    """set_kernels(moe_routing="triton") reaches every MoE layer and the whole model's logits
    stay the reference's (fp32, in the interpreter; on CUDA the real-size case covers it)."""
    if results["model_gap"] is not None:
        assert results["model_gap"] < 1e-4


def test_refusals():
    logits = torch.randn(2, 8)
    if moe_route.triton is None:
        with pytest.raises(RuntimeError, match="needs triton"):
            route_topk(logits, 2, torch.float32)
        return
    with pytest.raises(ValueError, match="top_k"):
        route_topk(logits, 9, torch.float32)
    if not moe_route._interpreted():
        with pytest.raises(RuntimeError, match="interpreter"):
            route_topk(logits, 2, torch.float32)
    assert not route_topk_available(logits)


@pytest.mark.gpu
def test_real_sizes_and_a_cuda_graph():
    logits = torch.randn(64, 256, device="cuda")  # fp32: no ties, so torch.topk's ids exactly
    weights, ids = route_topk(logits, 8, torch.bfloat16)
    want_w, want_ids = fused.moe_route.eager(logits, 8, torch.bfloat16)
    assert torch.equal(ids, want_ids)
    torch.testing.assert_close(weights, want_w, rtol=0, atol=2 * torch.finfo(torch.bfloat16).eps)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_w, out_ids = route_topk(logits, 8, torch.bfloat16)
    logits.copy_(torch.randn_like(logits))
    graph.replay()
    again_w, again_ids = route_topk(logits, 8, torch.bfloat16)
    assert torch.equal(out_w, again_w) and torch.equal(out_ids, again_ids)


if __name__ == "__main__":  # the interpreter child
    print(json.dumps(all_results("cpu")))
