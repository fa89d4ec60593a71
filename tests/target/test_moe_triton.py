"""The pair-GEMV experts (target/kernels/moe_triton.py) equal the per-expert reference: one
token on k = 8 experts, several tokens, an expert shared by tokens, sizes that are not multiples
of the blocks, non-default blocks, strided inputs; fp32 tightly, bf16 at bf16 rounding. On CUDA
also at the real sizes, against grouped_experts, and inside a CUDA graph.

Without CUDA the cases run in Triton's interpreter in one child process, this file run as a
script (tests/target/triton_child.py says why)."""

import json

import moe_cases
import pytest
import torch
import triton_child
from moe_cases import problem, reference, rel_err

triton = pytest.importorskip("triton")

from target.kernels import fused  # noqa: E402
from target.kernels.moe import grouped_experts, grouped_mm_available  # noqa: E402
from target.kernels.moe_triton import (  # noqa: E402
    PairBlocks,
    pair_blocks,
    pair_experts,
    pair_experts_available,
)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "bf16": 2e-2}
# name: (tokens, k, experts, hidden, inter, ids or None for random distinct, extra)
CASES = {
    "decode": (1, 8, 16, 64, 32, None, None),  # one token on 8 experts
    "odd_sizes": (3, 2, 6, 72, 40, None, None),  # H, I not multiples of any block
    "shared_expert": (3, 2, 4, 64, 32, [[1, 2], [2, 0], [3, 2]], None),  # expert 2: 3 tokens
    # Blocks that leave partial tiles along both dims of both kernels.
    "blocks": (2, 3, 5, 72, 40, None, "blocks"),
    # H-major weights, a strided x, [k, T]-major routing.
    "strided": (2, 3, 5, 72, 40, None, "strided"),
}


def case_error(name: str, dtype: str, device: str) -> float:
    """pair_experts' relative error against the reference on CASES[name]."""
    return moe_cases.case_error(pair_experts, CASES[name], DTYPES[dtype], device,
                                dict(gate_up_blocks=PairBlocks(16, 32, 2),
                                     down_blocks=PairBlocks(32, 16, 1)))


def consistency(device: str, tokens: int = 6, k: int = 4, experts: int = 8,
                hidden: int = 512, inter: int = 128) -> dict[str, float]:
    """bf16 on CUDA; fp16 in the interpreter, whose bf16 casts truncate where the GPU's round
    to nearest (fp16 is numpy's own: rounded). `batch_mismatches`: elements where a token's
    output inside the batch differs from the same token run alone. `grouped_equal` /
    `grouped_max_ulps`: the share of outputs equal to grouped_experts' bit for bit, and the
    largest difference in spacings of the dtype (at the larger magnitude)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    x, gate_up, down, ids, w = problem(tokens, k, experts, hidden, inter, dtype, device,
                                       seed=3)
    got = pair_experts(x, gate_up, down, ids, w)
    alone = torch.cat([pair_experts(x[i : i + 1], gate_up, down, ids[i : i + 1], w[i : i + 1])
                       for i in range(tokens)])
    rows = pair_experts(x, gate_up, down, ids, w, reduce=False)  # the layer's call
    out = {"batch_mismatches": int((got != alone).sum()),
           "rows_sum_equal": bool(torch.equal(fused.weighted_slot_sum(rows, w), got))}
    if device == "cpu" or grouped_mm_available(x):
        other = grouped_experts(x, gate_up, down, ids, w)
        out["grouped_equal"] = (got == other).float().mean().item()
        out["grouped_max_ulps"] = triton_child.max_ulps(got, other)
    return out


def prefetch_equal(device: str) -> bool:
    """The kernels with `prefetch` (the next loop step's loads issued before this step's
    multiply-adds) give the same bits as without, on sizes with partial tiles along both dims
    of both kernels and on the default shapes (fp32 and half, as the device rounds)."""
    half = torch.bfloat16 if device == "cuda" else torch.float16
    same = []
    for dtype in (torch.float32, half):
        x, gate_up, down, ids, w = problem(3, 4, 6, 200, 72, dtype, device, seed=5)
        for blocks in ((PairBlocks(16, 32, 2), PairBlocks(32, 16, 1)),
                       (pair_blocks(200), pair_blocks(72))):
            prefetched = [PairBlocks(b.block_n, b.block_k, b.num_warps, True) for b in blocks]
            plain = [PairBlocks(b.block_n, b.block_k, b.num_warps, False) for b in blocks]
            got = pair_experts(x, gate_up, down, ids, w, gate_up_blocks=prefetched[0],
                               down_blocks=prefetched[1], reduce=False)
            want = pair_experts(x, gate_up, down, ids, w, gate_up_blocks=plain[0],
                                down_blocks=plain[1], reduce=False)
            same.append(torch.equal(got, want))
    return all(same)


def shared_slot(device: str) -> dict[str, bool | float]:
    """A shared expert as one more slot of the pair kernels (pair_experts' `shared`): the
    routed rows keep their bits, and the extra row is the shared expert's gate_up, SwiGLU and
    down (fp32, at the default and at partial-tile blocks). Then the MoE layer that runs it:
    SparseMoE on the pair kernels (tiny preset, random weights, fp32) against its reference
    path, and what it hands the next norm (MoEOutput)."""
    from configs.model import TargetConfig
    from configs.presets import target_preset
    from target import dummy
    from target.distributed import SINGLE
    from target.layers.moe import MoEOutput, SparseMoE

    out: dict[str, bool | float] = {}
    x, gate_up, down, ids, w = problem(3, 4, 6, 200, 72, torch.float32, device, seed=5)
    g = torch.Generator().manual_seed(9)
    shared = (torch.randn(gate_up.shape[1:], generator=g).to(device) * 0.1,
              torch.randn(down.shape[1:], generator=g).to(device) * 0.1)
    want = torch.nn.functional.linear(fused.silu_mul(x @ shared[0].T), shared[1])
    for name, blocks in (("default", {}), ("blocks", dict(gate_up_blocks=PairBlocks(16, 32, 2),
                                                          down_blocks=PairBlocks(32, 16, 1)))):
        plain = pair_experts(x, gate_up, down, ids, w, reduce=False, **blocks)
        rows = pair_experts(x, gate_up, down, ids, w, reduce=False, shared=shared, **blocks)
        out[f"{name}_routed_equal"] = bool(torch.equal(rows[:, :4], plain))
        out[f"{name}_shared_err"] = rel_err(rows[:, 4], want.double())
    with torch.device(device):  # built there: .to() would copy in_proj's views apart
        moe = SparseMoE(TargetConfig.from_dict(target_preset("tiny")), SINGLE, torch.float32)
    moe = dummy.init_(moe, seed=3)
    xs = torch.randn(1, moe.in_proj.shape[1], generator=g).to(device)
    moe.experts.kernel = "reference"
    reference_out = moe(xs)
    moe.experts.kernel = "pairs"
    got = moe(xs)
    out["layer_uncombined"] = isinstance(got, MoEOutput) and got.rows.shape[1] == moe.top_k
    out["layer_err"] = rel_err(got.value(), reference_out.double())
    return out


def all_case_errors() -> dict[str, float | str]:
    return triton_child.case_errors(CASES, DTYPES, case_error, "cpu")


interpreted, errors = triton_child.fixtures(__file__, case_error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_pairs_equal_the_reference(errors, name, dtype):
    err = errors(f"{name}/{dtype}")
    assert not isinstance(err, str), err
    assert err < TOL[dtype]


def test_no_tokens_launch_nothing():
    x, gate_up, down, ids, w = problem(0, 2, 4, 16, 8, torch.float32,
                                       ids=torch.zeros(0, 2, dtype=torch.long))
    assert pair_experts(x, gate_up, down, ids, w).shape == (0, 16)


def test_one_launch_shape_per_model():
    # Qwen3.5-35B-A3B: gate_up reduces over H = 2048, down over I = 512; both 16×256.
    assert pair_blocks(2048) == pair_blocks(512) == PairBlocks(16, 256, 4, prefetch=True)
    assert pair_blocks(72).block_k == 128  # not past the reduction length
    assert pair_blocks(8).block_k == 16
    assert not pair_experts_available(torch.zeros(1))


def test_a_token_gets_the_same_bits_alone_and_in_a_batch_and_matches_grouped(interpreted):
    """The pair kernels' launch shape does not change with the step's size, and both paths
    round at the same places and share the slot sum: a token's routed output is bit for bit
    the same decoded alone or inside a verify block, and (but for the GEMMs' summation order)
    the same on the grouped path that larger steps take."""
    got = interpreted["consistency"] if interpreted is not None else consistency("cuda")
    assert got["rows_sum_equal"], got
    assert got["batch_mismatches"] == 0
    if "grouped_equal" in got:
        assert got["grouped_equal"] > 0.95, got
        assert got["grouped_max_ulps"] <= 4, got


def test_prefetch_gives_the_same_bits(interpreted):
    assert interpreted["prefetch_equal"] if interpreted is not None else prefetch_equal("cuda")


def test_a_shared_expert_runs_as_one_more_slot(interpreted):
    got = interpreted["shared_slot"] if interpreted is not None else shared_slot("cuda")
    for blocks in ("default", "blocks"):
        assert got[f"{blocks}_routed_equal"], got
        assert got[f"{blocks}_shared_err"] < TOL["fp32"], got
    assert got["layer_uncombined"], got
    assert got["layer_err"] < TOL["fp32"], got


def test_a_shared_expert_not_shaped_as_a_routed_one_is_refused():
    x, gate_up, down, ids, w = problem(1, 2, 4, 16, 8, torch.float32)
    with pytest.raises(AssertionError, match="shared"):
        pair_experts(x, gate_up, down, ids, w, reduce=False,
                     shared=(gate_up[0, :8], down[0]))


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 8, 16])
def test_real_sizes_match_grouped_and_capture_in_a_cuda_graph(tokens):
    x, gate_up, down, ids, w = problem(tokens, 8, 256, 2048, 512, torch.bfloat16, "cuda")
    assert pair_experts_available(x)
    got = pair_experts(x, gate_up, down, ids, w)
    assert rel_err(got, reference(x, gate_up, down, ids, w)) < TOL["bf16"]
    if grouped_mm_available(x):
        assert rel_err(got, grouped_experts(x, gate_up, down, ids, w).double()) < 2e-2

    moe_cases.check_graph_replay(pair_experts, x, gate_up, down, ids, w)


if __name__ == "__main__":  # the interpreter child of errors()
    print(json.dumps({"errors": all_case_errors(), "consistency": consistency("cpu"),
                      "prefetch_equal": prefetch_equal("cpu"), "shared_slot": shared_slot("cpu")}))
