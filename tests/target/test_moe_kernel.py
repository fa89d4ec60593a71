"""The grouped-GEMM experts (and the gathered-weights fallback) equal the per-expert
reference: every routing shape (one token, experts with no tokens, all tokens on one expert,
duplicates across slots), fp32 tightly and bf16 at bf16 rounding; on CUDA (sm90, bf16) the
path the model takes by default."""

from __future__ import annotations

import pytest
import torch

from target.kernels import fused
from target.kernels.moe import gathered_experts, grouped_experts, grouped_mm_available
from target.layers.moe import MoEOutput

E, H, INTER, K = 8, 64, 32, 2


def weights(dtype, device, seed=0):
    g = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(E, 2 * INTER, H, generator=g) * 0.1
    down = torch.randn(E, H, INTER, generator=g) * 0.1
    return gate_up.to(device, dtype), down.to(device, dtype)


def reference(x, gate_up, down, ids, w):
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            gate, up = (x[t].double() @ gate_up[e].double().T).chunk(2)
            out[t] += w[t, j].double() * (torch.nn.functional.silu(gate) * up) @ down[e].double().T
    return out


def routing(kind: str, tokens: int, g: torch.Generator):
    if kind == "random":
        ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(tokens)])
    elif kind == "one_expert":
        ids = torch.tensor([[3, 5]] * tokens)
    else:  # "skewed": experts 0 and 7 only, so experts 1..6 have empty groups
        ids = torch.tensor([[0, 7] if t % 2 else [7, 0] for t in range(tokens)])
    w = torch.rand(tokens, K, generator=g)
    return ids, w / w.sum(-1, keepdim=True)


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("kind", ["random", "one_expert", "skewed"])
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("kernel", [grouped_experts, gathered_experts])
def test_fused_experts_equal_the_reference(tokens, kind, dtype, tol, kernel):
    g = torch.Generator().manual_seed(tokens)
    gate_up, down = weights(dtype, "cpu")
    x = torch.randn(tokens, H, generator=g).to(dtype)
    ids, w = routing(kind, tokens, g)
    got = kernel(x, gate_up, down, ids, w.to(dtype))
    want = reference(x, gate_up, down, ids, w.to(dtype))
    assert got.dtype == dtype and got.shape == x.shape
    err = (got.double() - want).norm() / want.norm()
    assert err < tol
    # reduce=False: the slots' rows, which the shared weighted sum turns into the same bits
    rows = kernel(x, gate_up, down, ids, w.to(dtype), reduce=False)
    assert rows.shape == (tokens, K, H) and rows.dtype == dtype
    assert torch.equal(fused.weighted_slot_sum(rows, w.to(dtype)), got)


def test_the_moe_layer_takes_either_path_with_the_same_result(tiny_models):
    from target.loader import load_target

    model = load_target(tiny_models / "target")
    moe = model.model.layers[0].mlp
    x = torch.randn(9, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    moe.experts.kernel = "reference"
    want = moe(x)
    moe.experts.kernel = "grouped"
    got = moe(x)  # TP 1: the kernel paths leave the combine to the next norm
    assert isinstance(got, MoEOutput)
    torch.testing.assert_close(got.value(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 2, 3, 16, 17, 40])
def test_the_cuda_layer_picks_pairs_then_sorted_then_grouped_and_matches_the_reference(
        tiny_models, monkeypatch, tokens):
    from target.kernels import moe_triton
    from target.layers import moe as moe_layer
    from target.loader import load_target

    model = load_target(tiny_models / "target", dtype=torch.bfloat16, device="cuda")
    experts = model.model.layers[0].mlp.experts
    k = model.config.num_experts_per_tok
    # The tiny model routes few pairs: put the thresholds after 2 and after 16 tokens.
    monkeypatch.setattr(moe_layer, "PAIR_MAX", 2 * k)
    monkeypatch.setattr(moe_layer, "SORTED_MAX", 16 * k)
    x = torch.randn(tokens, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts.num_experts)[:k] for _ in range(tokens)]).cuda()
    w = torch.softmax(torch.randn(tokens, k), -1).cuda()
    want_kernel = "pairs" if tokens <= 2 else "sorted" if tokens <= 16 else "grouped"
    if not moe_triton.pair_experts_available(x) or not grouped_mm_available(x):
        pytest.skip("needs triton and torch._grouped_mm (sm90+)")
    assert experts._auto(x, ids.numel()) == want_kernel
    got = experts(x, ids, w)
    want = reference(x.cpu(), experts.gate_up_proj.cpu(), experts.down_proj.cpu(), ids.cpu(),
                     w.cpu())
    assert (got.cpu().double() - want).norm() / want.norm() < 2e-2


@pytest.mark.gpu
def test_cuda_default_is_grouped_and_matches_the_reference():
    x = torch.randn(40, H, device="cuda", dtype=torch.bfloat16)
    if not grouped_mm_available(x):
        pytest.skip("torch._grouped_mm needs sm90+")
    gate_up, down = weights(torch.bfloat16, "cuda")
    ids, w = routing("random", 40, torch.Generator().manual_seed(2))
    got = grouped_experts(x, gate_up, down, ids.cuda(), w.cuda().bfloat16())
    want = reference(x.cpu(), gate_up.cpu(), down.cpu(), ids, w.bfloat16())
    assert (got.cpu().double() - want).norm() / want.norm() < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 40])
def test_the_cuda_layer_through_the_sorted_path_matches_the_reference(tiny_models, tokens):
    """moe_backend "sorted" (KernelConfig) at decode and verify sizes."""
    from configs.kernels import KernelConfig
    from target.loader import load_target

    model = load_target(tiny_models / "target", dtype=torch.bfloat16, device="cuda")
    model.set_kernels(KernelConfig(moe="sorted"), graphs=False)
    experts = model.model.layers[0].mlp.experts
    assert experts.kernel == "sorted"
    k = model.config.num_experts_per_tok
    x = torch.randn(tokens, model.config.hidden_size, device="cuda", dtype=torch.bfloat16)
    ids = torch.stack([torch.randperm(experts.num_experts)[:k] for _ in range(tokens)]).cuda()
    w = torch.softmax(torch.randn(tokens, k), -1).cuda()
    got = experts(x, ids, w)
    want = reference(x.cpu(), experts.gate_up_proj.cpu(), experts.down_proj.cpu(), ids.cpu(),
                     w.cpu())
    assert (got.cpu().double() - want).norm() / want.norm() < 2e-2
