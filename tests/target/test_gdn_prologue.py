"""The Gated DeltaNet prologue in one Triton launch (target/kernels/gdn_prologue.py) against
the eager torch path it replaces (fused.gdn_gates, fused.conv_split_heads and, for a decode,
gdn_slots.commit_conv_reference): decode (the conv state written in place) and verify blocks
(conv_seq for the commit), slots out of order and the cache's other slots untouched, a conv
cache in fp32 beside half inputs, head dims that are not powers of two, three value heads per
key head, inputs as strided views of the projection. fp32 to rounding; half precision bit for
bit but where a sum's order moved a rounding (at most one spacing). Also: a token's outputs
are the same bits decoded alone as inside a block. The gated output norm (gated_rms_norm)
against fused.gated_rms_norm's eager form: a decode's and a block's rows, a head dim that is
not a power of two, z as a view of the projection. On CUDA also bf16 in a CUDA graph.

Without CUDA the cases run in Triton's interpreter in one child process, this file run as a
script (tests/target/triton_child.py says why)."""

import json

import pytest
import torch
import triton_child

triton = pytest.importorskip("triton")

from target.kernels import fused, gdn_prologue  # noqa: E402
from target.kernels.gdn_slots import commit_conv_reference  # noqa: E402

# "half": bf16 on CUDA, fp16 in the interpreter (numpy has no bf16: its casts truncate)
DTYPES = {"fp32": torch.float32, "half": torch.bfloat16}
# name: (S, L, Hk, Dk, Hv, Dv, K, conv cache in fp32)
CASES = {
    "decode": (3, 1, 2, 16, 4, 8, 4, False),
    "verify": (2, 5, 2, 16, 4, 8, 4, False),
    "odd_heads": (2, 3, 2, 12, 6, 10, 4, True),  # 3 value heads a key head, Dk 12, Dv 10
    "decode_fp32_cache": (2, 1, 1, 8, 2, 8, 3, True),
}


def dtype_on(name: str, device: str) -> torch.dtype:
    return torch.float16 if name == "half" and device == "cpu" else DTYPES[name]


def problem(case, dtype, device="cpu", seed=0):
    n_seqs, width, hk, dk, hv, dv, taps, fp32_cache = case
    g = torch.Generator(device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    channels = 2 * hk * dk + hv * dv
    # the projection's output [T, C + z + b + a], the conv inputs and gates as its views
    proj = torch.randn(n_seqs * width, channels + 5 + 2 * hv, **kw).to(dtype)
    x = proj[:, :channels].view(n_seqs, width, channels)
    b, a = proj[:, channels + 5 : channels + 5 + hv], proj[:, channels + 5 + hv :]
    n_slots = 2 * n_seqs + 1
    cache = torch.randn(n_slots, channels, taps - 1, **kw)
    cache = cache if fp32_cache else cache.to(dtype)
    slots = torch.randperm(n_slots, **kw)[:n_seqs]
    weight = (torch.randn(channels, 1, taps, **kw) * 0.5).to(dtype)[:, 0, :]  # as the layer
    a_log, dt_bias = torch.rand(hv, **kw) * 2 - 1, torch.randn(hv, **kw)
    heads = (hk, dk, hv, dv)
    return x, cache, slots, weight, a, b, a_log, dt_bias, heads


def reference(x, cache, slots, weight, a, b, a_log, dt_bias, heads, qk_dtype):
    """The layer's torch path, eager: q, k, v, g, β, conv_seq (None for a decode) and the
    cache it leaves."""
    hk, dk, hv, dv = heads
    n_seqs, width = x.shape[:2]
    cache = cache.clone()
    g, beta = fused.gdn_gates.eager(b, a, a_log, dt_bias, qk_dtype)
    q, k, v, conv_seq = fused.conv_split_heads.eager(x, cache, slots, weight, hk * dk, hk, dk,
                                                     hv, dv, qk_dtype, False)
    if width == 1:
        commit_conv_reference(conv_seq, cache, slots, 1)
        conv_seq = None
    return (q, k, v, g.view(n_seqs, width, -1), beta.view(n_seqs, width, -1), conv_seq,
            cache)


def kernel(x, cache, slots, weight, a, b, a_log, dt_bias, heads, qk_dtype):
    cache = cache.clone()
    out = gdn_prologue.conv_split_gates(x, cache, slots, weight, a, b, a_log, dt_bias, *heads,
                                        qk_dtype, qk_dtype)
    return (*out, cache)


def compare(got, want) -> dict:
    """Over the fp32 outputs (g; all of them in an fp32 case): the largest relative error.
    Over the half ones: the largest difference in spacings of the dtype and the share of
    elements equal."""
    ulps, equal, n, err = 0.0, 0, 0, 0.0
    for a, b in zip(got, want, strict=True):
        if b is None:
            assert a is None
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        if a.dtype == torch.float32:
            err = max(err, ((a.double() - b.double()).norm() / b.double().norm()).item())
            continue
        ulps = max(ulps, triton_child.max_ulps(a, b))
        equal += int((a == b).sum())
        n += a.numel()
    return {"fp32_rel_err": err, "half_max_ulps": ulps, "half_equal": equal / n if n else 1.0}


def case_result(name: str, dtype: str, device: str) -> dict:
    args = problem(CASES[name], dtype_on(dtype, device), device)
    qk_dtype = args[0].dtype  # as on fla: the model's dtype
    return compare(kernel(*args, qk_dtype), reference(*args, qk_dtype))


def decode_vs_block(device: str) -> int:
    """Elements where a token's q, k, v, g, β differ between its sequence's 4-token verify
    block and the same token decoded alone from the state the block's first tokens leave."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    x, cache, slots, weight, a, b, a_log, dt_bias, heads = problem(CASES["verify"], dtype,
                                                                   device, seed=4)
    n_seqs, width = x.shape[:2]
    block = kernel(x, cache, slots, weight, a, b, a_log, dt_bias, heads, dtype)
    state = cache.clone()
    mismatches = 0
    for i in range(width):  # decode the block's tokens one by one
        rows = torch.arange(n_seqs, device=x.device) * width + i
        step = gdn_prologue.conv_split_gates(x[:, i : i + 1], state, slots, weight, a[rows],
                                             b[rows], a_log, dt_bias, *heads, dtype, dtype)
        for got, want in zip(step[:5], block[:5], strict=True):
            mismatches += int((got[:, 0] != want[:, i]).sum())
    return mismatches


def model_rounds() -> str | None:
    """The tiny target through prefill and two rounds per L (decode L = 1; L = 5 keeping
    [5, 1, 2]) with gdn_prologue "triton" against "torch", both on the slots
    recurrence: None if every logit and state agrees, else what differs
    (test_gdn_batched_round.run)."""
    from target_harness import TargetHarness
    from test_gdn_batched_round import assert_runs_close, run

    from configs.kernels import KernelConfig
    from tests.conftest import ASSETS

    for L, kept in ((1, [1, 1, 1]), (5, [5, 1, 2])):
        runs = [run(TargetHarness(ASSETS / "tiny" / "target"),
                    KernelConfig(gdn_recurrence="slots", gdn_prologue=prologue), kept, L)
                for prologue in ("torch", "triton")]
        try:
            assert_runs_close(runs[1], runs[0])
        except AssertionError as e:
            return f"L {L}, kept {kept}: {e}"
    return None


# name: (T, H, D)
NORM_CASES = {"decode": (1, 4, 16), "block": (6, 3, 32), "odd_dim": (5, 2, 24)}


def norm_result(name: str, dtype: str, device: str) -> dict:
    """gated_rms_norm against fused.gated_rms_norm.eager on NORM_CASES[name]: o contiguous
    as the recurrence leaves it, z a view of a wider projection row, weight near 1."""
    tokens, heads, dim = NORM_CASES[name]
    dt = dtype_on(dtype, device)
    g = torch.Generator(device).manual_seed(5)
    kw = dict(generator=g, device=device)
    o = (torch.randn(tokens, heads, dim, **kw) * 3).to(dt)
    proj = torch.randn(tokens, heads * dim + 7, **kw).to(dt)
    z = proj[:, 7:].view(tokens, heads, dim)
    weight = (1 + 0.1 * torch.randn(dim, **kw)).to(dt)
    got = gdn_prologue.gated_rms_norm(o, z, weight, 1e-6)
    want = fused.gated_rms_norm.eager(o, z, weight, 1e-6).reshape(tokens, -1)
    return compare((got,), (want,))


def all_case_results() -> dict[str, dict | str]:
    return triton_child.case_errors(CASES, DTYPES, case_result, "cpu")


interpreted, results = triton_child.fixtures(__file__, case_result)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_prologue_equals_the_torch_path(results, name, dtype):
    got = results(f"{name}/{dtype}")
    assert not isinstance(got, str), got
    assert got["fp32_rel_err"] < 1e-6, got  # the sums' order, rsqrt's, exp's and log's roundings
    assert got["half_max_ulps"] <= 1, got
    assert got["half_equal"] > 0.99, got


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", NORM_CASES)
def test_gated_norm_equals_the_torch_path(interpreted, name, dtype):
    got = (interpreted["norm"] if interpreted is not None else triton_child.case_errors(
        NORM_CASES, DTYPES, norm_result, "cuda"))[f"{name}/{dtype}"]
    assert not isinstance(got, str), got
    assert got["fp32_rel_err"] < 1e-6, got  # the sum's order, rsqrt's and exp's roundings
    assert got["half_max_ulps"] <= 1 and got["half_equal"] > 0.97, got


def test_a_token_gets_the_same_bits_decoded_and_in_a_block(interpreted):
    got = interpreted["decode_vs_block"] if interpreted is not None else decode_vs_block("cuda")
    assert got == 0


def test_the_tiny_target_rounds_the_same_through_the_kernel(interpreted):
    """set_kernels(gdn_prologue="triton") through the layer: decode writing its conv state
    in the prologue, verify journaling conv_seq for the commit (fp32, interpreter)."""
    if interpreted is None:
        pytest.skip("the CPU harness in the interpreter; on CUDA the engine's golden check "
                    "(tools/golden_check.py) covers the model")
    assert interpreted["model_rounds"] is None, interpreted["model_rounds"]


@pytest.mark.gpu
def test_bf16_decode_inside_a_cuda_graph():
    x, cache, slots, weight, a, b, a_log, dt_bias, heads = problem(
        (4, 1, 16, 128, 32, 128, 4, False), torch.bfloat16, "cuda")
    want = reference(x, cache, slots, weight, a, b, a_log, dt_bias, heads, torch.bfloat16)
    gdn_prologue.conv_split_gates(x, cache.clone(), slots, weight, a, b, a_log,  # compiles
                                  dt_bias, *heads, torch.bfloat16, torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gdn_prologue.conv_split_gates(x, cache, slots, weight, a, b, a_log, dt_bias,
                                            *heads, torch.bfloat16, torch.bfloat16)
    graph.replay()
    got = compare((*out, cache), want)
    assert got["fp32_rel_err"] < 1e-5 and got["half_max_ulps"] <= 1, got
    assert got["half_equal"] > 0.99, got


if __name__ == "__main__":  # the interpreter child of results()
    print(json.dumps({"errors": all_case_results(), "decode_vs_block": decode_vs_block("cpu"),
                      "norm": triton_child.case_errors(NORM_CASES, DTYPES, norm_result, "cpu"),
                      "model_rounds": model_rounds()}))
