"""A Gated DeltaNet decode in two launches (target/kernels/gdn_decode.py: the prologue inside
the recurrence's launch, the conv state shifted by the output norm) against the three it
replaces (gdn_prologue.conv_split_gates, gdn_slots.recurrent_slots writing the states,
gdn_prologue.gated_rms_norm): the same bits in the output, the norm's output, the recurrent
states and the conv states, every slot of the caches (the others untouched), for slots out
of order, two and three value heads per key head, a value head dim that is no power of two,
a conv cache in fp32 beside half inputs, fp32 and half (bf16 on CUDA, fp16 in the
interpreter). Through the tiny target: decode rounds with gdn_prologue "fused" give the
logits and states of "triton", bit for bit. On CUDA also at the real sizes in a CUDA graph.

Without CUDA the cases run in Triton's interpreter in one child process, this file run as a
script (tests/target/triton_child.py says why)."""

import json

import pytest
import torch
import triton_child

triton = pytest.importorskip("triton")

from test_gdn_prologue import dtype_on, problem  # noqa: E402

from target.kernels import gdn_decode, gdn_prologue, gdn_slots  # noqa: E402

DTYPES = {"fp32": torch.float32, "half": torch.bfloat16}
# name: (S, 1, Hk, Dk, Hv, Dv, K, conv cache in fp32), test_gdn_prologue.problem's layout
CASES = {
    "decode": (3, 1, 2, 16, 4, 8, 4, False),
    "three_per_key_head": (2, 1, 2, 16, 6, 10, 4, True),  # Dv 10: a ragged value tile
    "one_seq_fp32_cache": (1, 1, 1, 8, 2, 8, 3, True),
}


def decode_problem(case, dtype, device, seed=0):
    """test_gdn_prologue.problem's decode, with recurrent states for every slot, the norm's
    z (a view of a wider projection row) and weight."""
    x, cache, slots, weight, a, b, a_log, dt_bias, heads = problem(case, dtype, device, seed)
    hk, dk, hv, dv = heads
    g = torch.Generator(device).manual_seed(seed + 1)
    kw = dict(generator=g, device=device)
    states = torch.randn(cache.shape[0], hv, dk, dv, **kw) * 0.3
    z = torch.randn(x.shape[0], hv * dv + 3, **kw).to(dtype)[:, 3:].view(-1, hv, dv)
    norm_w = (1 + 0.1 * torch.randn(dv, **kw)).to(dtype)
    return x, cache, slots, weight, a, b, a_log, dt_bias, heads, states, z, norm_w


def three_launches(x, cache, slots, weight, a, b, a_log, dt_bias, heads, states, z, norm_w):
    cache, states = cache.clone(), states.clone()
    q, k, v, g, beta, _ = gdn_prologue.conv_split_gates(x, cache, slots, weight, a, b, a_log,
                                                        dt_bias, *heads, x.dtype, x.dtype)
    o = gdn_slots.recurrent_slots(q, k, v, g, beta, states, slots, write_state=True)[:, 0]
    return o, gdn_prologue.gated_rms_norm(o, z, norm_w, 1e-6), cache, states


def two_launches(x, cache, slots, weight, a, b, a_log, dt_bias, heads, states, z, norm_w):
    cache, states = cache.clone(), states.clone()
    x = x[:, 0]  # [S, C]: one token a sequence, a row view of the projection
    o = gdn_decode.decode_recurrence(x, cache, slots, weight, a, b, a_log, dt_bias, states,
                                     *heads, x.dtype)
    return o, gdn_prologue.gated_rms_norm(o, z, norm_w, 1e-6, (x, cache, slots)), cache, states


def case_result(name: str, dtype: str, device: str) -> dict:
    args = decode_problem(CASES[name], dtype_on(dtype, device), device)
    want, got = three_launches(*args), two_launches(*args)
    names = ("output", "norm", "conv_cache", "states")
    return {"differ": {n: int((g != w).sum()) for n, g, w in zip(names, got, want, strict=True)},
            "shapes_equal": all(g.shape == w.shape and g.dtype == w.dtype
                                for g, w in zip(got, want, strict=True)),
            "conv_changed": bool((got[2] != args[1]).any())}


def model_rounds() -> str | None:
    """The tiny target (fp32) through a prefill and two decode rounds with gdn_prologue
    "fused" against "triton", both on the slots recurrence: None if every logit and state is
    the same bits, else what differs (test_gdn_batched_round.run)."""
    from target_harness import TargetHarness
    from test_gdn_batched_round import run

    from configs.kernels import KernelConfig
    from tests.conftest import ASSETS

    runs = [run(TargetHarness(ASSETS / "tiny" / "target"),
                KernelConfig(gdn_recurrence="slots", gdn_prologue=prologue), [1, 1, 1], 1)
            for prologue in ("triton", "fused")]
    (first_a, second_a, states_a), (first_b, second_b, states_b) = runs
    for what, a, b in (("first round", first_a, first_b), ("second round", second_a, second_b)):
        if not all(torch.equal(x, y) for x, y in zip(a, b, strict=True)):
            return f"{what}: logits differ"
    for i, ((conv_a, ssm_a), (conv_b, ssm_b)) in enumerate(zip(states_a, states_b,
                                                               strict=True)):
        if not (torch.equal(conv_a, conv_b) and torch.equal(ssm_a, ssm_b)):
            return f"GDN layer {i}: states differ"
    return None


interpreted, results = triton_child.fixtures(__file__, case_result)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_two_launches_give_the_three_launches_bits(results, name, dtype):
    got = results(f"{name}/{dtype}")
    assert not isinstance(got, str), got
    assert got["shapes_equal"] and got["conv_changed"]
    assert got["differ"] == {"output": 0, "norm": 0, "conv_cache": 0, "states": 0}


def test_the_tiny_target_decodes_the_same_bits_through_the_kernel(interpreted):
    if interpreted is None:
        pytest.skip("the CPU harness in the interpreter; on CUDA the engine's golden check "
                    "(tools/golden_check.py) covers the model")
    assert interpreted["model_rounds"] is None, interpreted["model_rounds"]


def test_refuses_cpu_tensors_outside_the_interpreter():
    if gdn_decode._interpreted():
        pytest.skip("this process runs Triton's interpreter")
    args = decode_problem(CASES["decode"], torch.float32, "cpu")
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        two_launches(*args)


@pytest.mark.gpu
def test_real_sizes_bf16_inside_a_cuda_graph():
    """The 35B-A3B's GDN heads (16 key heads, 32 value heads, 128 × 128), 4 sequences: a
    replay gives the three launches' bits."""
    args = decode_problem((4, 1, 16, 128, 32, 128, 4, False), torch.bfloat16, "cuda")
    want = three_launches(*args)
    x, cache, slots, weight, a, b, a_log, dt_bias, heads, states, z, norm_w = args
    cache, states = cache.clone(), states.clone()
    two_launches(x, cache.clone(), slots, weight, a, b, a_log, dt_bias, heads,  # compiles
                 states.clone(), z, norm_w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o = gdn_decode.decode_recurrence(x[:, 0], cache, slots, weight, a, b, a_log, dt_bias,
                                         states, *heads, x.dtype)
        out = gdn_prologue.gated_rms_norm(o, z, norm_w, 1e-6, (x[:, 0], cache, slots))
    graph.replay()
    for got, w in zip((o, out, cache, states), want, strict=True):
        assert torch.equal(got, w)


if __name__ == "__main__":  # the interpreter child of results()
    print(json.dumps({"errors": triton_child.case_errors(CASES, DTYPES, case_result, "cpu"),
                      "model_rounds": model_rounds()}))
