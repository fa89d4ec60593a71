"""tools/triton_aot.py: every Triton kernel of the engine compiles ahead of time for the H200
(sm90) at the real model's shapes and dtypes, within its shared memory, with no GPU here —
a kernel that would not compile on the GPU fails in CI instead."""

import json

import pytest

pytest.importorskip("triton")


def test_every_kernel_compiles_for_sm90(tmp_path):
    from tools import triton_aot

    out = tmp_path / "aot.json"
    assert triton_aot.main(["--out", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == len(triton_aot.variants())
    for r in rows:
        assert "error" not in r, r
        assert 0 <= r["shared"] <= triton_aot.SHARED_LIMIT and r["registers"] > 0, r


def test_a_kernel_that_cannot_compile_is_reported(monkeypatch, tmp_path):
    """A variant whose constexprs do not fit its kernel is an error row and exit status 1."""
    from tools import triton_aot

    bad = triton_aot.Variant("broken", "target.kernels.moe_route", "_route_kernel",
                             {"logits_ptr": "*bf16"}, {"TOP_K": 8}, {"num_warps": 4})
    monkeypatch.setattr(triton_aot, "variants", lambda attention_launches=(): [bad])
    out = tmp_path / "aot.json"
    assert triton_aot.main(["--out", str(out)]) == 1
    assert "error" in json.loads(out.read_text())[0]
