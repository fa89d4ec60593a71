"""The few-row Triton GEMV (target/kernels/linear_triton.py) equals x @ w.T in fp64 rounded to
the dtype (fp16, fp32), at 1, 3 and 16 rows, sizes that are not multiples of the blocks,
non-default blocks, both reductions and strided inputs; a row gets the same bits alone and
among 15 other rows; more than 16 rows is refused. On CUDA also bf16 at the real sizes against
F.linear, where the bits of a row are checked for the MMA reduction too (the interpreter's
tl.dot, numpy's BLAS, changes a row's fp32 bits with its position in the block).

Without CUDA the cases run in Triton's interpreter in one child process, this file run as a
script (tests/target/triton_child.py). The interpreter's bf16 casts truncate where the GPU's round
to nearest, so there it runs fp16 (numpy's own, rounded) and fp32."""

import dataclasses
import json

import pytest
import torch
import torch.nn.functional as F
import triton_child

triton = pytest.importorskip("triton")

from target.kernels import linear_triton  # noqa: E402
from target.kernels.linear_triton import (  # noqa: E402
    SMALL_LINEAR_MAX_ROWS,
    LinearBlocks,
    linear_blocks,
    small_linear,
    small_linear_available,
)

DTYPES = {"fp16": torch.float16, "fp32": torch.float32}
TOL = {"fp16": 1e-3, "fp32": 1e-6}  # relative error norm: the dtype's rounding of the output
SHAPES = [(40, 48), (96, 200)]  # (N, K): tails along both dims of every launch shape used
# name: (rows, N, K, LinearBlocks args or None for linear_blocks', extra)
CASES = {
    "decode": (1, 96, 200, None, None),
    "rows3": (3, 40, 48, None, None),
    "rows16": (16, 96, 200, None, None),
    "blocks": (3, 40, 48, (32, 32, 2, 2), None),  # partial tiles along N and K
    "blocks16": (16, 96, 200, (16, 64, 4, 2), None),
    "mma": (3, 96, 200, (32, 64, 4, 3, True), None),  # tl.dot on the zero-padded x block
    "mma16": (16, 40, 48, (16, 32, 4, 3, True), None),
    # x a column slice, w a transposed view; then x a transposed view, w a column slice.
    "strided_x_slice": (3, 96, 200, None, "x_slice"),
    "strided_x_view": (16, 40, 48, None, "x_view"),
}


def problem(rows: int, n: int, k: int, dtype: torch.dtype, device: str = "cpu", seed: int = 0):
    g = torch.Generator(device).manual_seed(seed)
    x = torch.randn(rows, k, generator=g, device=device)
    w = torch.randn(n, k, generator=g, device=device) * k**-0.5
    return x.to(dtype), w.to(dtype)


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def strided(x: torch.Tensor, w: torch.Tensor, extra: str):
    """The same values through non-contiguous views."""
    x_slice = torch.cat([x, x[:, :7]], dim=1)[:, :x.shape[1]]  # strides (K + 7, 1)
    x_view = x.T.contiguous().T  # strides (1, M)
    w_slice = torch.cat([w[:, :5], w], dim=1)[:, 5:]  # strides (K + 5, 1)
    w_view = w.T.contiguous().T  # strides (1, N)
    return (x_slice, w_view) if extra == "x_slice" else (x_view, w_slice)


def case_error(name: str, dtype: str, device: str) -> float | str:
    """small_linear's relative error against fp64 x @ w.T rounded to the dtype on CASES[name];
    for the strided cases the text of a mismatch with the contiguous result, if any."""
    rows, n, k, blocks, extra = CASES[name]
    x, w = problem(rows, n, k, DTYPES[dtype], device)
    kw = {} if blocks is None else dict(blocks=LinearBlocks(*blocks))
    want = (x.double() @ w.double().T).to(x.dtype)
    got = small_linear(x, w, **kw)
    assert got.dtype == x.dtype and got.shape == (rows, n)
    if extra is not None:
        xs, ws = strided(x, w, extra)
        assert not xs.is_contiguous() and not ws.is_contiguous()
        if not torch.equal(small_linear(xs, ws, **kw), got):
            return f"{extra}: strided result differs from the contiguous one"
    return rel_err(got, want)


def batch_mismatches(device: str) -> dict[str, int]:
    """"N/K/dtype" → elements where a row computed alone differs from the same row inside a
    16-row batch of random other rows (at a random position), or inside a 3-row batch. The
    per-row reduction: the interpreter's tl.dot is numpy's BLAS, which groups rows (the MMA
    path's property is the GPU test's)."""
    out = {}
    dtypes = {"bf16": torch.bfloat16, **DTYPES} if device == "cuda" else DTYPES
    for n, k in SHAPES:
        for dname, dtype in dtypes.items():
            x, w = problem(SMALL_LINEAR_MAX_ROWS, n, k, dtype, device, seed=1)
            g = torch.Generator().manual_seed(2)
            per_row = dataclasses.replace(linear_blocks(n, k), mma=False)
            bad = 0
            for i in range(SMALL_LINEAR_MAX_ROWS):
                alone = small_linear(x[i : i + 1], w, blocks=per_row)
                others = problem(SMALL_LINEAR_MAX_ROWS, n, k, dtype, device, seed=10 + i)[0]
                j = int(torch.randint(SMALL_LINEAR_MAX_ROWS, (1,), generator=g))
                others[j] = x[i]
                bad += int((small_linear(others, w, blocks=per_row)[j] != alone[0]).sum())
            batch = small_linear(x, w, blocks=per_row)
            bad += int((small_linear(x[5:8], w, blocks=per_row) != batch[5:8]).sum())
            out[f"{n}/{k}/{dname}"] = bad
    return out


def all_case_errors(device: str) -> dict[str, float | str]:
    return triton_child.case_errors(CASES, DTYPES, case_error, device)


interpreted, errors = triton_child.fixtures(__file__, case_error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_small_linear_equals_the_reference(errors, name, dtype):
    err = errors(f"{name}/{dtype}")
    assert not isinstance(err, str), err
    assert err < TOL[dtype]


def test_a_row_gets_the_same_bits_alone_and_in_a_batch(interpreted):
    """One launch shape per weight and one binary for every row count: a token's projection
    is bit for bit the same decoded alone or inside a 16-token verify block."""
    got = interpreted["batch"] if interpreted is not None else batch_mismatches("cuda")
    assert got and not any(got.values()), got


def test_more_than_16_rows_are_refused_and_none_launch_nothing():
    x, w = problem(SMALL_LINEAR_MAX_ROWS + 1, 40, 48, torch.float32)
    with pytest.raises(ValueError, match="17 rows"):
        small_linear(x, w)
    assert small_linear(x[:0], w).shape == (0, 40)
    with pytest.raises(ValueError, match="dtype|is torch"):
        small_linear(x[:1], w.double())


def test_cpu_tensors_need_the_interpreter():
    if linear_triton._interpreted():
        pytest.skip("this process runs Triton's interpreter")
    x, w = problem(1, 40, 48, torch.float32)
    assert not small_linear_available(x)
    with pytest.raises(RuntimeError, match="interpreter"):
        small_linear(x, w)


def test_dense_dispatch():
    from target.layers.linear import dense

    x, w = problem(SMALL_LINEAR_MAX_ROWS + 1, 40, 48, torch.float32)
    assert torch.equal(dense(x, w), F.linear(x, w))  # the engine's default
    assert torch.equal(dense(x, w, "small"), F.linear(x, w))  # past 16 rows: F.linear
    with pytest.raises(ValueError, match="dense kernel 'cublas'"):
        dense(x, w, "cublas")
    if not linear_triton._interpreted():
        with pytest.raises(RuntimeError, match="interpreter"):  # CPU, no interpreter
            dense(x[:2], w, "small")


def test_one_launch_shape_per_weight():
    # MMA, 16 × 256 (or the reduction length rounded up to a power of two, at least 16)
    for n, k in [(12352, 2048), (2048, 4096), (256, 2048), (1, 2048)]:
        assert linear_blocks(n, k) == LinearBlocks(16, 256, 4, 3, mma=True)
    assert linear_blocks(40, 48).block_k == 64  # not past the reduction length
    assert linear_blocks(40, 8).block_k == 16  # tl.dot's smallest K


@pytest.mark.gpu
@pytest.mark.parametrize("mma", [False, True])
@pytest.mark.parametrize("n,k", [(12352, 2048), (2048, 4096), (1, 2048), (256, 2048)])
def test_real_sizes_match_f_linear_in_bf16(n, k, mma):
    x, w = problem(SMALL_LINEAR_MAX_ROWS, n, k, torch.bfloat16, "cuda", seed=4)
    assert small_linear_available(x)
    blocks = dataclasses.replace(linear_blocks(n, k), mma=mma)
    batch = small_linear(x, w, blocks=blocks)
    want = F.linear(x, w).float()
    scale = want.abs().max().item()
    assert (batch.float() - want).abs().max().item() <= 2e-2 * scale
    assert rel_err(batch, want) < 1e-2
    # Each row alone, and at another position among other rows.
    others = problem(SMALL_LINEAR_MAX_ROWS, n, k, torch.bfloat16, "cuda", seed=5)[0]
    for i in range(SMALL_LINEAR_MAX_ROWS):
        assert torch.equal(small_linear(x[i : i + 1], w, blocks=blocks)[0], batch[i])
        j = (i + 7) % SMALL_LINEAR_MAX_ROWS
        others[j] = x[i]
        assert torch.equal(small_linear(others, w, blocks=blocks)[j], batch[i])
    assert torch.equal(small_linear(x[2:5], w, blocks=blocks), batch[2:5])


if __name__ == "__main__":  # the interpreter child of interpreted()
    print(json.dumps({"errors": all_case_errors("cpu"), "batch": batch_mismatches("cpu")}))
