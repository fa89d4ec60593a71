"""The sorted-pair experts (target/kernels/moe_sorted.py) equal the per-expert reference: one
token on k = 8 experts, sizes that are not multiples of the blocks, non-default blocks, an
expert shared by more pairs than a block holds, every pair on one expert, strided inputs; fp32
tightly, bf16 at bf16 rounding. A token's output is the same bits alone and inside a batch.
align_pairs' layout is checked for routings of every kind. On CUDA also at the real sizes,
against grouped_experts and pair_experts, without a host sync and inside a CUDA graph.

Without CUDA the kernel cases run in Triton's interpreter in one child process, this file run
as a script (tests/target/triton_child.py says why)."""

import json

import moe_cases
import pytest
import torch
import triton_child
from moe_cases import problem, reference, rel_err

from target.kernels import fused, moe_sorted
from target.kernels.moe import grouped_experts, grouped_mm_available
from target.kernels.moe_sorted import (
    BLOCK_M,
    SortedBlocks,
    align_pairs,
    sorted_blocks,
    sorted_experts,
    sorted_experts_available,
)
from target.kernels.moe_triton import pair_experts

needs_triton = pytest.mark.skipif(moe_sorted.triton is None, reason="needs triton")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TOL = {"fp32": 1e-5, "bf16": 2e-2}
# Slot 0 of all 20 tokens on expert 1 (20 pairs > BLOCK_M: two blocks), slot 1 spread.
SHARED = [[1, (0, 2, 3)[t % 3]] for t in range(20)]
# name: (tokens, k, experts, hidden, inter, ids or None for random distinct, extra)
CASES = {
    "decode": (1, 8, 16, 64, 32, None, None),  # one token on 8 experts
    "odd_sizes": (3, 2, 6, 72, 40, None, None),  # H, I not multiples of any block
    "shared_expert": (20, 2, 4, 32, 16, SHARED, None),
    "one_expert": (9, 2, 4, 32, 16, [[3, 3]] * 9, None),  # every pair on expert 3: 2 blocks
    # Blocks that leave partial tiles along both dims of both kernels, several K steps.
    "blocks": (2, 3, 5, 72, 40, None, "blocks"),
    # H-major weights, a strided x, [k, T]-major routing.
    "strided": (2, 3, 5, 72, 40, None, "strided"),
}


def case_error(name: str, dtype: str, device: str) -> float:
    """sorted_experts' relative error against the reference on CASES[name]."""
    return moe_cases.case_error(sorted_experts, CASES[name], DTYPES[dtype], device,
                                dict(gate_up_blocks=SortedBlocks(16, 32, 2, 2),
                                     down_blocks=SortedBlocks(32, 16, 1, 1)))


def consistency(device: str, tokens: int = 5, k: int = 4, experts: int = 8,
                hidden: int = 128, inter: int = 64) -> dict[str, float]:
    """bf16 on CUDA; fp16 in the interpreter, whose bf16 casts truncate where the GPU's round
    to nearest. 8 experts for 20 pairs: every block holds pairs of several tokens.
    `batch_mismatches`: elements where a token's output inside the batch differs from the same
    token run alone (token 0 first in its experts' blocks, the others at other rows).
    `pairs_equal` / `pairs_max_ulps`: the share of outputs equal to pair_experts' bit for bit,
    and the largest difference in spacings of the dtype (at the larger magnitude)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    x, gate_up, down, ids, w = problem(tokens, k, experts, hidden, inter, dtype, device,
                                       seed=3)
    got = sorted_experts(x, gate_up, down, ids, w)
    alone = torch.cat([sorted_experts(x[i : i + 1], gate_up, down, ids[i : i + 1],
                                      w[i : i + 1]) for i in range(tokens)])
    other = pair_experts(x, gate_up, down, ids, w)
    rows = sorted_experts(x, gate_up, down, ids, w, reduce=False)  # the layer's call
    return {"token0_alone_equal": bool(torch.equal(alone[0], got[0])),
            "rows_sum_equal": bool(torch.equal(fused.weighted_slot_sum(rows, w), got)),
            "batch_mismatches": int((got != alone).sum()),
            "pairs_equal": (got == other).float().mean().item(),
            "pairs_max_ulps": triton_child.max_ulps(got, other)}


def all_case_errors() -> dict[str, float | str]:
    return triton_child.case_errors(CASES, DTYPES, case_error, "cpu")


interpreted, errors = triton_child.fixtures(__file__, case_error)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_sorted_equal_the_reference(errors, name, dtype):
    err = errors(f"{name}/{dtype}")
    assert not isinstance(err, str), err
    assert err < TOL[dtype]


@needs_triton
def test_a_token_gets_the_same_bits_alone_and_in_a_batch(interpreted):
    """A pair's row of a block's tl.dot does not depend on the block's other rows, and the
    launch shape does not change with the step's size: a token's routed output is bit for bit
    the same alone or inside a batch, and close to the pair GEMVs' (summation order only)."""
    got = interpreted["consistency"] if interpreted is not None else consistency("cuda")
    assert got["token0_alone_equal"] and got["rows_sum_equal"], got
    assert got["batch_mismatches"] == 0, got
    assert got["pairs_equal"] > 0.9, got
    assert got["pairs_max_ulps"] <= 4, got


@needs_triton
def test_no_tokens_give_zeros():
    x, gate_up, down, ids, w = problem(0, 2, 4, 16, 8, torch.float32,
                                       ids=torch.zeros(0, 2, dtype=torch.long))
    out = sorted_experts(x, gate_up, down, ids, w)
    assert out.shape == (0, 16) and out.dtype == x.dtype


@needs_triton
def test_cpu_tensors_outside_the_interpreter_are_refused():
    if moe_sorted._interpreted():
        pytest.skip("TRITON_INTERPRET=1 in this process")
    x, gate_up, down, ids, w = problem(1, 2, 4, 16, 8, torch.float32)
    with pytest.raises(RuntimeError, match="interpreter"):
        sorted_experts(x, gate_up, down, ids, w)


def test_one_launch_shape_per_model():
    # Qwen3.5-35B-A3B: gate_up is I = 512 wide over H = 2048, down H wide over I.
    assert sorted_blocks(512, 2048) == sorted_blocks(2048, 512) == SortedBlocks(64, 64, 4, 4)
    assert sorted_blocks(20, 40) == SortedBlocks(32, 64, 4, 4)  # not past the sizes
    assert sorted_blocks(16, 8) == SortedBlocks(16, 16, 4, 4)
    assert not sorted_experts_available(torch.zeros(1))


def check_alignment(ids: torch.Tensor, num_experts: int, block_m: int) -> None:
    """align_pairs' layout: shapes from (P, E, block_m) alone; every pair exactly once, in
    its expert's blocks (in any order there); padding only at the end of a group and less
    than a block of it; the used blocks first, by expert, -1 after."""
    pairs = ids.numel()
    max_blocks = -(-pairs // block_m) + min(num_experts, pairs)
    sorted_pairs, block_expert = align_pairs(ids, num_experts, block_m)
    assert sorted_pairs.dtype == block_expert.dtype == torch.int32
    assert sorted_pairs.shape == (max_blocks * block_m,) and block_expert.shape == (max_blocks,)
    if pairs == 0:
        return
    sorted_pairs, block_expert, ids = sorted_pairs.cpu(), block_expert.cpu(), ids.cpu()
    real = sorted_pairs < pairs
    assert ((sorted_pairs >= 0) & (sorted_pairs <= pairs)).all()  # a pair or the sentinel
    assert torch.equal(sorted_pairs[real].sort().values, torch.arange(pairs, dtype=torch.int32))

    used = block_expert >= 0
    n_used = int(used.sum())
    assert used[:n_used].all() and not used[n_used:].any()
    assert (block_expert < num_experts).all()
    slots = sorted_pairs.view(max_blocks, block_m)
    assert not real.view(max_blocks, block_m)[~used].any()  # unused blocks: sentinel only
    flat = ids.flatten()
    for e in range(num_experts):
        mine = slots[block_expert == e].flatten()  # [blocks of e · block_m]
        want = (flat == e).nonzero()[:, 0].to(torch.int32)  # its pairs
        assert mine.numel() == -(-want.numel() // block_m) * block_m  # < 1 block of padding
        assert torch.equal(mine[: want.numel()].sort().values, want)  # then the sentinel only
        assert (mine[want.numel() :] == pairs).all()
    assert torch.equal(block_expert[used], block_expert[used].sort().values)  # by expert


def alignment_failures(device: str) -> list[str]:
    """check_alignment over routings of every kind (random, all on one expert, distinct,
    uneven), block_m 16 and 4, int64 and int32 ids, [k, T]-major ids, and no pairs: what
    failed."""
    failures = []
    for routing in ("random", "one_expert", "distinct", "shared"):
        for block_m in (BLOCK_M, 4):
            g = torch.Generator().manual_seed(block_m)
            for tokens, k, experts in ((1, 8, 16), (7, 4, 8), (40, 2, 64), (300, 8, 256)):
                if routing == "random":
                    ids = torch.stack([torch.randperm(experts, generator=g)[:k]
                                       for _ in range(tokens)])
                elif routing == "one_expert":
                    ids = torch.full((tokens, k), experts - 1)
                elif routing == "distinct":  # each pair its own expert where there are enough
                    ids = torch.randperm(max(experts, tokens * k), generator=g)[: tokens * k]
                    ids = (ids % experts).view(tokens, k)
                else:  # a few experts, unevenly: full, partial and idle blocks
                    ids = torch.randint(0, 3, (tokens, k), generator=g) * (experts // 3)
                ids = ids.to(device)
                for form in (ids, ids.int(), ids.T.contiguous().T):
                    try:
                        check_alignment(form, experts, block_m)
                    except AssertionError as e:
                        failures.append(f"{routing} {block_m} {tuple(ids.shape)} {experts} "
                                        f"{form.dtype} {form.stride()}: {e}")
    try:
        check_alignment(torch.zeros(0, 8, dtype=torch.long, device=device), 16, BLOCK_M)
    except AssertionError as e:
        failures.append(f"no pairs: {e}")
    return failures


@needs_triton
def test_align_pairs_layout(interpreted):
    got = interpreted["alignment"] if interpreted is not None else alignment_failures("cuda")
    assert got == [], got[:5]


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 16, 128])
def test_real_sizes_match_grouped_and_pairs_and_capture_in_a_cuda_graph(tokens):
    x, gate_up, down, ids, w = problem(tokens, 8, 256, 2048, 512, torch.bfloat16, "cuda")
    assert sorted_experts_available(x)
    got = sorted_experts(x, gate_up, down, ids, w)
    assert rel_err(got, reference(x, gate_up, down, ids, w)) < TOL["bf16"]
    assert rel_err(got, pair_experts(x, gate_up, down, ids, w).double()) < 2e-2
    if grouped_mm_available(x):
        assert rel_err(got, grouped_experts(x, gate_up, down, ids, w).double()) < 2e-2

    torch.cuda.set_sync_debug_mode("error")  # align_pairs must not read anything back
    try:
        align_pairs(ids, 256, BLOCK_M)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    moe_cases.check_graph_replay(sorted_experts, x, gate_up, down, ids, w)


if __name__ == "__main__":  # the interpreter child of errors()
    print(json.dumps({"errors": all_case_errors(), "consistency": consistency("cpu"),
                      "alignment": alignment_failures("cpu")}))
