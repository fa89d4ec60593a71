"""The split-K few-row projection kernel (target/kernels/splitk_linear.py) equals F.linear
to rounding: one row, a full tile of 16, a width and a depth that are no multiple of the
tile or of the slices, slices past K (empty), strided inputs, a row view of a wider weight,
bf16 and fp16, tiles other than the default; a row gets the same bits alone, in a batch and
in a block of any size; the arrival counters are zero after every launch; no rows and no
columns give empty results; what it does not take is refused with the reason. Through the
model: KernelConfig.row_parallel reaches every row-parallel projection, the kernel runs a
verify block's and a decode's, and the tiny target's logits stay the reference's. On CUDA
also at the real sizes, the same bits over repeated launches (whichever split arrives
last), and inside a CUDA graph.

Without CUDA the cases run in Triton's interpreter in one child process, this file run as a
script (tests/target/triton_child.py says why)."""

import json

import pytest
import torch
import torch.nn.functional as F
import triton_child

from target.kernels import splitk_linear
from target.kernels.splitk_linear import MAX_ROWS, Tile

needs_triton = pytest.mark.skipif(splitk_linear.triton is None, reason="needs triton")

# name: (M, N, K, tile or None for tile_for's, x strided, weight a row view of a wider one)
CASES = {
    "decode": (1, 48, 1024, None, False, False),  # 4 slices of 256
    "full_tile": (MAX_ROWS, 32, 512, None, False, False),  # 2 slices
    "odd_sizes": (5, 37, 1100, None, False, False),  # N, K and the last slice ragged
    "empty_slices": (3, 20, 300, Tile(16, 64, 8, 4, 2), False, False),  # 64 deep: 5 of 8 used
    "strided_x": (3, 40, 272, None, True, False),  # one slice
    "row_view": (2, 21, 768, None, False, True),
    "wide_tile": (4, 70, 640, Tile(32, 128, 2, 4, 2), False, False),
}
DTYPES = {"bf16": torch.bfloat16, "half": torch.float16}
# The largest difference from fp32 F.linear rounded to the dtype, in units of the dtype's
# eps at the output's largest magnitude: both round an fp32 sum (in another order) once.
MAX_ERR = 1.0


def operands(name: str, dtype: torch.dtype, device: str):
    m, n, k, tile, strided, view = CASES[name]
    g = torch.Generator().manual_seed(len(name))
    x = torch.randn(m, 2 * k if strided else k, generator=g)
    x = (x[:, ::2] if strided else x).to(device, dtype)
    w = torch.randn(n + 9 if view else n, k, generator=g) * k**-0.5
    w = w.to(device, dtype)
    return x, (w[:n] if view else w), tile


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    scale = want.float().abs().max() * torch.finfo(want.dtype).eps
    return ((got.float() - want.float()).abs().max() / scale).item()


def case_error(name: str, dtype: str, device: str) -> float | None:
    """None for bf16 in the interpreter: numpy has no bf16, and its dots of bf16 tiles do not
    round as the GPU's MMA does (the CUDA run covers bf16)."""
    if device == "cpu" and dtype == "bf16":
        return None
    x, w, tile = operands(name, DTYPES[dtype], device)
    got = splitk_linear.splitk_linear(x, w, tile)
    want = F.linear(x.float(), w.float()).to(x.dtype)
    assert got.shape == want.shape and got.dtype == x.dtype
    return relative_error(got, want)


def invariance(device: str) -> dict[str, int]:
    """Bits that differ between each row alone, the rows of a batch of 16, and the first j
    rows of it (a block of j tokens), K in 3 slices: bf16 on CUDA, fp16 in the interpreter;
    and the arrival counters left non-zero after all of it."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    g = torch.Generator().manual_seed(3)
    x = torch.randn(MAX_ROWS, 768, generator=g).to(device, dtype)
    w = (torch.randn(50, 768, generator=g) * 0.05).to(device, dtype)
    batch = splitk_linear.splitk_linear(x, w)
    out = {"alone_vs_batch": 0, "block_sizes": 0}
    for i in range(MAX_ROWS):
        alone = splitk_linear.splitk_linear(x[i : i + 1], w)
        out["alone_vs_batch"] += int((alone != batch[i]).sum())
    for j in (2, 7, 9):
        out["block_sizes"] += int((splitk_linear.splitk_linear(x[:j], w) != batch[:j]).sum())
    out["counters_left"] = int((splitk_linear._COUNTERS[x.device] != 0).sum())
    return out


def empties(device: str) -> list[list[int]]:
    w = torch.randn(8, 32).to(device, torch.bfloat16)
    x = torch.randn(3, 32).to(device, torch.bfloat16)
    return [list(splitk_linear.splitk_linear(x[:0], w).shape),
            list(splitk_linear.splitk_linear(x, w[:0]).shape)]


def model_results() -> dict:
    """The tiny target in fp16 (CPU, the interpreter) with row_parallel "triton" against
    "torch" (target_harness.kernel_rounds): the logits' largest difference, the kernel the
    row-parallel projections took, and the row counts of the kernel's launches (the verify
    block's and the decode's; a prefill of 30 rows stays on cuBLAS)."""
    from target_harness import kernel_rounds

    from configs.kernels import KernelConfig
    from target.layers.linear import RowParallelLinear
    from tests.conftest import ASSETS

    configs = {k: KernelConfig(row_parallel=k, moe="reference") for k in ("torch", "triton")}
    out, launch_rows, model = kernel_rounds(ASSETS / "tiny" / "target", configs,
                                            splitk_linear, "splitk_linear")
    rows = [m for m in model.modules() if isinstance(m, RowParallelLinear)]
    return {"gap": (out["torch"] - out["triton"]).abs().max().item(),
            "scale": out["torch"].abs().max().item(),
            "kernels": sorted({m.kernel for m in rows}), "launch_rows": sorted(set(launch_rows))}


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
def test_splitk_linear_equals_f_linear(errors, name, dtype):
    err = errors(f"{name}/{dtype}")
    if err is None:
        pytest.skip("bf16 runs on CUDA only: numpy has no bf16")
    assert not isinstance(err, str), err
    assert err <= MAX_ERR


@needs_triton
def test_a_row_gets_the_same_bits_alone_in_a_batch_and_in_any_block(results):
    assert results["invariance"] == {"alone_vs_batch": 0, "block_sizes": 0,
                                     "counters_left": 0}


@needs_triton
def test_no_rows_or_no_columns(results):
    assert results["empties"] == [[0, 8], [3, 0]]


@needs_triton
def test_the_tiny_target_projects_alike_through_the_kernel(results):
    """set_kernels(row_parallel="triton") reaches every row-parallel projection, the kernel
    runs the verify block's 6 rows and the decode's 1 (not the prefill's 30), and their
    logits stay the reference's to fp16 rounding (the interpreter; on CUDA the engine's
    golden check covers it)."""
    if results["model"] is None:
        pytest.skip("the CPU harness in the interpreter; on CUDA tools/golden_check.py")
    r = results["model"]
    assert r["kernels"] == ["triton"]
    assert r["launch_rows"] == [1, 6]
    assert r["gap"] <= 4 * torch.finfo(torch.float16).eps * r["scale"]


def test_refusals():
    x = torch.randn(2, 32, dtype=torch.bfloat16)
    w = torch.randn(8, 32, dtype=torch.bfloat16)
    if splitk_linear.triton is None:
        with pytest.raises(RuntimeError, match="needs triton"):
            splitk_linear.splitk_linear(x, w)
        return
    cases = [(torch.randn(MAX_ROWS + 1, 32, dtype=torch.bfloat16), w, "M ≤"),
             (x.float(), w.float(), "share a dtype"), (x, w.half(), "share a dtype"),
             (x, torch.randn(32, 8, dtype=torch.bfloat16).t(), "rows must be contiguous"),
             (x, torch.randn(8, 16, dtype=torch.bfloat16), "x's K = 32")]
    if not splitk_linear._interpreted():
        cases.append((x, w, "TRITON_INTERPRET"))
    for a, b, reason in cases:
        assert not splitk_linear.available(a, b)
        with pytest.raises(ValueError, match=reason):
            splitk_linear.splitk_linear(a, b)


def test_a_tile_parses_from_its_fields_and_each_shape_has_one():
    assert Tile.parse("16,256,4,4,3") == Tile() == splitk_linear.tile_for(2048, 4096)
    assert Tile.parse("32") == Tile(block_n=32)
    assert [splitk_linear.tile_for(2048, k).splits for k in (512, 300, 100)] == [2, 1, 1]
    with pytest.raises(ValueError, match="6 given"):
        Tile.parse("16,256,4,4,3,1")


@pytest.mark.gpu
def test_real_sizes_repeated_launches_and_a_cuda_graph():
    """The 35B-A3B's output projection (2048 × 4096) and the shared expert's down (2048 ×
    512) at 1 and 16 rows against cuBLAS; 50 launches of one product give one result
    (whichever split arrives last); a replay with new inputs gives what a fresh call gives,
    and the counters stay zero."""
    for n, k in ((2048, 4096), (2048, 512)):
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5
        for m in (1, MAX_ROWS):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = F.linear(x.float(), w.float()).to(torch.bfloat16)
            got = splitk_linear.splitk_linear(x, w)
            assert relative_error(got, want) <= MAX_ERR
            assert all(torch.equal(got, splitk_linear.splitk_linear(x, w)) for _ in range(50))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = splitk_linear.splitk_linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(out, splitk_linear.splitk_linear(x, w))
    assert not splitk_linear._COUNTERS[x.device].any()


if __name__ == "__main__":  # the interpreter child
    print(json.dumps(all_results("cpu")))
