"""The MoE router in one launch (target/kernels/moe_router.py): its logits equal F.linear's to
rounding, and its routing is route_topk's on those logits (the same ids, the same weights to
one eps); for one token, a full tile of 16, an expert count and a hidden size that are no
multiple of the tile or of the slices, slices past H (empty), k = 1, strided x, extra rows
after the experts' (the shared-expert gate's), tiles other than the default; a token gets
the same bits alone, in a batch and in a block of any size; the arrival counter is zero
after every launch; no tokens give empty results; what it does not take is refused with the
reason. Through the tiny target: moe_routing "fused" runs it for a verify block's and a
decode's tokens (not a prefill's), and the logits stay those of moe_routing "triton". On
CUDA also at the real sizes, over repeated launches and inside a CUDA graph.

Without CUDA the cases run in Triton's interpreter in one child process, this file run as a
script (tests/target/triton_child.py says why)."""

import json

import pytest
import torch
import torch.nn.functional as F
import triton_child

from target.kernels import moe_router
from target.kernels.moe_route import route_topk
from target.kernels.moe_router import MAX_ROWS, router_topk
from target.kernels.splitk_linear import Tile

needs_triton = pytest.mark.skipif(moe_router.triton is None, reason="needs triton")

# name: (tokens, experts, rows after the experts', H, k, tile or None, x strided)
CASES = {
    "decode": (1, 16, 1, 512, 8, None, False),  # 2 slices
    "full_tile": (MAX_ROWS, 32, 1, 768, 4, None, False),  # 3 slices
    "odd_sizes": (5, 60, 3, 1100, 4, None, False),  # 63 rows in 4 tiles; H ragged
    "top1": (3, 8, 0, 256, 1, None, False),
    "empty_slices": (2, 20, 1, 300, 3, Tile(16, 64, 8, 4, 2), False),  # 5 of 8 used
    "wide_tile": (4, 40, 1, 640, 2, Tile(32, 128, 2, 4, 2), False),
    "strided_x": (3, 24, 1, 272, 2, None, True),
}
DTYPES = {"bf16": torch.bfloat16, "half": torch.float16}


def operands(name: str, dtype: torch.dtype, device: str):
    tokens, experts, extra, k, top_k, tile, strided = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(tokens, 2 * k if strided else k, generator=g)
    x = (x[:, ::2] if strided else x).to(device, dtype)
    w = (torch.randn(experts + extra, k, generator=g) * k**-0.5).to(device, dtype)
    return x, w, experts, top_k, tile


def case_error(name: str, dtype: str, device: str) -> dict | None:
    """The logits' largest difference from fp32 F.linear rounded to the dtype, in eps at the
    largest magnitude; whether the ids equal route_topk's on the kernel's logits, and the
    weights' largest difference from its weights in eps. None for bf16 in the interpreter
    (numpy has no bf16; the CUDA run covers it)."""
    if device == "cpu" and dtype == "bf16":
        return None
    x, w, experts, top_k, tile = operands(name, DTYPES[dtype], device)
    logits, weights, ids = router_topk(x, w, experts, top_k, tile)
    want = F.linear(x.float(), w.float()).to(x.dtype)
    eps = torch.finfo(x.dtype).eps
    want_w, want_ids = route_topk(logits[:, :experts], top_k, x.dtype)
    return {"logits_eps": ((logits.float() - want.float()).abs().max()
                           / (want.float().abs().max() * eps)).item(),
            "shapes": [list(logits.shape), list(weights.shape), list(ids.shape)],
            "dtypes_ok": logits.dtype == weights.dtype == x.dtype and ids.dtype == torch.long,
            "ids_equal": bool(torch.equal(ids, want_ids)),
            "weights_eps": ((weights.float() - want_w.float()).abs().max() / eps).item()}


def invariance(device: str) -> dict[str, int]:
    """Bits (logits, weights, ids) that differ between each token alone, the tokens of a
    batch of 16 and the first j of it (a block of j tokens), H in 3 slices: bf16 on CUDA,
    fp16 in the interpreter; and the arrival counter left non-zero after all of it."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(MAX_ROWS, 768, generator=g).to(device, dtype)
    w = (torch.randn(41, 768, generator=g) * 0.05).to(device, dtype)
    batch = router_topk(x, w, 40, 4)

    def differ(got, rows) -> int:
        return sum(int((a != b[rows]).sum()) for a, b in zip(got, batch, strict=True))

    out = {"alone_vs_batch": sum(differ(router_topk(x[i : i + 1], w, 40, 4), slice(i, i + 1))
                                 for i in range(MAX_ROWS)),
           "block_sizes": sum(differ(router_topk(x[:j], w, 40, 4), slice(0, j))
                              for j in (2, 7, 9))}
    out["counter_left"] = int(moe_router._COUNTERS[x.device].item())
    return out


def empties(device: str) -> list[list[int]]:
    w = torch.randn(9, 32).to(device, torch.bfloat16)
    x = torch.randn(3, 32).to(device, torch.bfloat16)
    return [list(t.shape) for t in router_topk(x[:0], w, 8, 2)]


def model_results() -> dict:
    """The tiny target in fp16 (CPU, the interpreter; the pair kernels for every step) with
    moe_routing "fused" against "triton" (target_harness.kernel_rounds: a prefill of 30
    tokens, route_topk in both; a verify block of 6; a decode): the logits' largest
    difference and the row counts of the fused router's launches."""
    from target_harness import kernel_rounds

    from configs.kernels import KernelConfig
    from tests.conftest import ASSETS

    configs = {r: KernelConfig(moe="pairs", moe_routing=r) for r in ("triton", "fused")}
    out, launch_rows, _ = kernel_rounds(ASSETS / "tiny" / "target", configs, moe_router,
                                        "router_topk")
    return {"gap": (out["triton"] - out["fused"]).abs().max().item(),
            "scale": out["triton"].abs().max().item(),
            "launch_rows": sorted(set(launch_rows))}


def all_results(device: str) -> dict:
    return {"errors": triton_child.case_errors(CASES, DTYPES, case_error, device),
            "invariance": invariance(device), "empties": empties(device),
            "model": model_results() if device == "cpu" else None}


interpreted, errors = triton_child.fixtures(__file__, case_error)


@pytest.fixture(scope="module")
def results(interpreted):
    return interpreted or {"invariance": invariance("cuda"), "empties": empties("cuda"),
                           "model": None}


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_router_equals_f_linear_then_route_topk(errors, name, dtype):
    r = errors(f"{name}/{dtype}")
    if r is None:
        pytest.skip("bf16 runs on CUDA only: numpy has no bf16")
    assert not isinstance(r, str), r
    tokens, experts, extra, _, top_k, _, _ = CASES[name]
    assert r["shapes"] == [[tokens, experts + extra], [tokens, top_k], [tokens, top_k]]
    assert r["dtypes_ok"] and r["ids_equal"]
    assert r["logits_eps"] <= 1.0  # both round an fp32 sum (in another order) once
    assert r["weights_eps"] <= 1.0


@needs_triton
def test_a_token_gets_the_same_bits_alone_in_a_batch_and_in_any_block(results):
    assert results["invariance"] == {"alone_vs_batch": 0, "block_sizes": 0, "counter_left": 0}


@needs_triton
def test_no_tokens(results):
    assert results["empties"] == [[0, 9], [0, 2], [0, 2]]


@needs_triton
def test_the_tiny_target_routes_alike_through_the_kernel(results):
    """moe_routing "fused" runs the router for the verify block's 6 tokens and the decode's
    1 (not the prefill's 30), and the logits stay those of "triton" to fp16 rounding (the
    interpreter; on CUDA the engine's golden check covers it)."""
    if results["model"] is None:
        pytest.skip("the CPU harness in the interpreter; on CUDA tools/golden_check.py")
    r = results["model"]
    assert r["launch_rows"] == [1, 6]
    assert r["gap"] <= 4 * torch.finfo(torch.float16).eps * r["scale"]


def test_refusals():
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    w = torch.randn(9, 32, dtype=torch.bfloat16)
    if moe_router.triton is None:
        with pytest.raises(RuntimeError, match="needs triton"):
            router_topk(x, w, 8, 2)
        return
    cases = [(torch.randn(MAX_ROWS + 1, 32, dtype=torch.bfloat16), w, 8, 2, "T ≤"),
             (x.float(), w.float(), 8, 2, "share a dtype"), (x, w.half(), 8, 2, "share a dtype"),
             (x, torch.randn(32, 9, dtype=torch.bfloat16).t(), 8, 2, "rows must be contiguous"),
             (x, torch.randn(9, 16, dtype=torch.bfloat16), 8, 2, "x's H = 32"),
             (x, w, 10, 2, "N ≥ 10"), (x, w, 8, 9, "top_k")]
    if not moe_router._interpreted():
        cases.append((x, w, 8, 2, "TRITON_INTERPRET"))
    for a, b, experts, top_k, reason in cases:
        assert not moe_router.available(a, b, experts, top_k)
        with pytest.raises(ValueError, match=reason):
            router_topk(a, b, experts, top_k)


def test_each_hidden_size_has_one_tile():
    assert moe_router.tile_for(2048) == Tile.parse("16,256,8,4,2")
    assert [moe_router.tile_for(k).splits for k in (4096, 512, 100)] == [8, 2, 1]


@pytest.mark.gpu
def test_real_sizes_repeated_launches_and_a_cuda_graph():
    """The 35B-A3B's router with its shared-expert gate (257 × 2048, k = 8) at 1 and 16
    tokens: F.linear's logits to rounding and route_topk's routing of them; 50 launches give
    one result (whichever program arrives last); a replay with new inputs gives what a fresh
    call gives, and the counter stays zero."""
    w = torch.randn(257, 2048, device="cuda", dtype=torch.bfloat16) * 2048**-0.5
    for m in (1, MAX_ROWS):
        x = torch.randn(m, 2048, device="cuda", dtype=torch.bfloat16)
        logits, weights, ids = router_topk(x, w, 256, 8)
        want = F.linear(x.float(), w.float()).to(torch.bfloat16)
        assert ((logits.float() - want.float()).abs().max()
                <= torch.finfo(torch.bfloat16).eps * want.float().abs().max())
        want_w, want_ids = route_topk(logits[:, :256], 8, torch.bfloat16)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_w, rtol=0,
                                   atol=torch.finfo(torch.bfloat16).eps)
        assert all(all(torch.equal(a, b) for a, b in zip((logits, weights, ids),
                                                         router_topk(x, w, 256, 8), strict=True))
                   for _ in range(50))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = router_topk(x, w, 256, 8)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert all(torch.equal(a, b) for a, b in zip(out, router_topk(x, w, 256, 8), strict=True))
    assert not moe_router._COUNTERS[x.device].any()


if __name__ == "__main__":  # the interpreter child
    print(json.dumps(all_results("cpu")))
