"""The fusable elementwise functions (target/kernels/fused.py, draft/fused.py), compiled by
torch.compile with dynamic shapes, equal their eager selves — on CPU (inductor's C++ backend)
here, on CUDA (Triton) in the gpu case; and one compiled function serves two token counts
(dynamic shapes: each layer and batch size reuses it)."""

from __future__ import annotations

import pytest
import torch

from draft import fused as draft_fused
from target.kernels import fused


def cases(device: str):
    g = torch.Generator().manual_seed(0)

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, generator=g).to(device, dtype)

    h, t = 64, 5
    return [
        (fused.rms_norm, (r(t, h), r(h) * 0.1, 1e-6)),
        (fused.add_rms_norm, (r(t, h), r(t, h), r(h) * 0.1, 1e-6)),
        (fused.gated_rms_norm, (r(t, 4, 16), r(t, 4, 16), r(16), 1e-6)),
        (fused.gdn_gates, (r(t, 4), r(t, 4), r(4, dtype=torch.float32),
                           r(4, dtype=torch.float32))),
        (fused.gdn_gates, (r(t, 4), r(t, 4), r(4, dtype=torch.float32),
                           r(4, dtype=torch.float32), torch.bfloat16)),
        (fused.gdn_split_heads, (r(2, t, 2 * 32 + 64), 32, 2, 16, 4, 16)),
        (fused.gdn_split_heads, (r(2, t, 2 * 32 + 64), 32, 2, 16, 4, 16, torch.bfloat16)),
        (fused.conv_split_heads, (r(t, 3, 2 * 32 + 64), r(9, 2 * 32 + 64, 3),
                                  torch.tensor([7, 0, 3, 8, 2][:t], device=device),
                                  r(2 * 32 + 64, 4), 32, 2, 16, 4, 16, torch.bfloat16, True)),
        (fused.conv_split_heads, (r(t, 3, 2 * 32 + 64), r(9, 2 * 32 + 64, 3),
                                  torch.tensor([7, 0, 3, 8, 2][:t], device=device),
                                  r(2 * 32 + 64, 4), 32, 2, 16, 4, 16, torch.float32, False)),
        (fused.moe_route, (r(t, 8), 2, torch.bfloat16)),
        (fused.silu_mul, (r(t, 2 * h),)),
        (fused.shared_expert_combine, (r(t, h), r(t, h), r(t, 1))),
        (fused.moe_combine, (r(t, 4, h), r(t, 4).softmax(-1), r(t, h), r(t, 1))),
        (fused.moe_combine_add_rms_norm, (r(t, 4, h), r(t, 4).softmax(-1), r(t, h), r(t, 1),
                                          r(t, h), r(h) * 0.1, 1e-6)),
        (fused.weighted_slot_sum, (r(t, 4, h), r(t, 4).softmax(-1))),
        (fused.sigmoid_gate, (r(t, h), r(t, h))),
        (fused.qk_norm_rope, (r(t, 4, 32), r(t, 2, 32), r(32) * 0.1, r(32) * 0.1, 1e-6,
                              r(t, 1, 16, dtype=torch.float32),
                              r(t, 1, 16, dtype=torch.float32), 16)),
        (draft_fused.rms_norm, (r(t, h), r(h), 1e-6)),
        (draft_fused.add_rms_norm, (r(t, h), r(t, h), r(h), 1e-6)),
        (draft_fused.norm_rope, (r(t, 4, 32), r(32), 1e-6, r(t, 32), r(t, 32))),
        (draft_fused.silu_mul, (r(t, h), r(t, h))),
        (draft_fused.rope_cos_sin, (torch.arange(40, 40 + t, device=device),
                                    1e4 ** -torch.arange(0, 1, 1 / 16, device=device),
                                    torch.bfloat16)),
        (fused.rope_cos_sin, (torch.arange(40, 40 + t, device=device),
                              1e4 ** -torch.arange(0, 1, 1 / 8, device=device))),
        (fused.rope, (r(t, 4, 32), r(t, 1, 16, dtype=torch.float32),
                      r(t, 1, 16, dtype=torch.float32), 16)),
    ]


def check(device: str) -> None:
    for fn, args in cases(device):
        compiled = fn.compile()
        want = fn.eager(*args)
        got = compiled(*args)
        for a, b in zip(got if isinstance(got, tuple) else (got,),
                        want if isinstance(want, tuple) else (want,), strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, fn.__name__
            torch.testing.assert_close(a.float(), b.float(), atol=2e-2, rtol=2e-2,
                                       msg=fn.__name__)
        # another token count through the same compiled function
        more = [torch.cat([a, a[:1]]) if isinstance(a, torch.Tensor) and a.dim() >= 1
                and a.shape[0] == args[0].shape[0] else a for a in args]
        out = compiled(*more)
        first = out[0] if isinstance(out, tuple) else out
        assert first.shape[0] == args[0].shape[0] + 1, fn.__name__


def test_compiled_fusions_equal_eager_on_cpu():
    check("cpu")


@pytest.mark.gpu
def test_compiled_fusions_equal_eager_on_cuda():
    check("cuda")


@pytest.mark.gpu
def test_compiled_fusions_with_inductors_pdl_equal_eager():
    """KernelConfig pdl on (target/kernels/pdl.py): the chains compiled with Inductor's own
    PDL equal their eager selves as those compiled without do, and give the same bits each
    time."""
    from target.kernels import pdl

    if torch.cuda.get_device_capability()[0] < 9 or pdl.compiled_supported() is not None:
        pytest.skip("needs sm90 and Inductor's PDL")
    try:
        pdl.enable(False, compiled=True)
        check("cuda")
        for fn, args in cases("cuda"):
            compiled = fn.compile()
            first, again = compiled(*args), compiled(*args)
            for a, b in zip(first if isinstance(first, tuple) else (first,),
                            again if isinstance(again, tuple) else (again,), strict=True):
                assert torch.equal(a, b), fn.__name__
    finally:
        pdl.enable(False)


def test_enable_routes_only_cuda_tensors_through_the_compiler():
    x, w = torch.randn(3, 8), torch.zeros(8)
    fused.enable()
    try:  # CPU tensors stay eager: the same values as the reference, no compile
        torch.testing.assert_close(fused.rms_norm(x, w, 1e-6), fused.rms_norm.eager(x, w, 1e-6),
                                   atol=0, rtol=0)
    finally:
        fused.enable(False)


def test_the_folded_residual_add_is_the_add_then_the_norm():
    """Eager, add_rms_norm gives the bits of the add and rms_norm run apart (the stream the
    decoder layers carried before the add was folded)."""
    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(5, 64, generator=g).bfloat16() for _ in range(2))
    w = torch.randn(64, generator=g).bfloat16() * 0.1
    s, h = fused.add_rms_norm(x, residual, w, 1e-6)
    assert torch.equal(s, residual + x)
    assert torch.equal(h, fused.rms_norm(residual + x, w, 1e-6))


def test_the_folded_moe_combine_is_the_combine_then_the_add_and_norm():
    """Eager, a MoE output folded into the next norm (TP 1) gives the bits of moe_combine and
    add_rms_norm run apart; RMSNorm takes the uncombined output (MoEOutput) that way."""
    from target.layers.moe import MoEOutput
    from target.layers.norm import RMSNorm

    g = torch.Generator().manual_seed(2)
    t, k, h = 5, 4, 64
    rows = torch.randn(t, k, h, generator=g).bfloat16()
    weights = torch.randn(t, k, generator=g).softmax(-1).bfloat16()
    shared, residual = (torch.randn(t, h, generator=g).bfloat16() for _ in range(2))
    gate = torch.randn(t, 1, generator=g).bfloat16()
    norm = RMSNorm(h, 1e-6, torch.bfloat16)
    norm.weight.data = torch.randn(h, generator=g).bfloat16() * 0.1
    out = MoEOutput(rows, weights, shared, gate)
    want = fused.add_rms_norm(fused.moe_combine(rows, weights, shared, gate), residual,
                              norm.weight, 1e-6)
    for got in (norm(out, residual), fused.moe_combine_add_rms_norm(*out, residual,
                                                                     norm.weight, 1e-6)):
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert torch.equal(out.value(), fused.moe_combine(rows, weights, shared, gate))
