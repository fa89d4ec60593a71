"""tools/triton_aot.py: every Triton kernel of the engine compiles ahead of time for the H200
(sm90) at the real model's shapes and dtypes, within its shared memory, with no GPU here —
a kernel that would not compile on the GPU fails in CI instead."""

import json

import pytest

pytest.importorskip("triton")


@pytest.mark.parametrize("pdl", [False, True])
def test_every_kernel_compiles_for_sm90(tmp_path, pdl):
    """With pdl (target/kernels/pdl.py) every kernel's PTX waits on griddepcontrol; without,
    none does."""
    from tools import triton_aot

    out = tmp_path / "aot.json"
    assert triton_aot.main(["--out", str(out)] + ["--pdl"] * pdl) == 0
    rows = json.loads(out.read_text())
    assert len(rows) == len(triton_aot.variants())
    for r in rows:
        assert "error" not in r, r
        assert 0 <= r["shared"] <= triton_aot.SHARED_LIMIT and r["registers"] > 0, r
        assert r["gdc_wait"] is pdl, r


def test_every_engine_kernel_takes_pdl_and_is_compiled():
    """Each Triton kernel the engine launches has the PDL constexpr (a kernel launched with
    PDL that did not wait first could read its predecessor's outputs before they are
    written), and tools/triton_aot.py compiles each."""
    import importlib
    import pkgutil

    import triton

    import target.kernels
    from tools import triton_aot

    kernels = set()
    for info in pkgutil.iter_modules(target.kernels.__path__):
        module = importlib.import_module(f"target.kernels.{info.name}")
        for name, obj in vars(module).items():
            if isinstance(obj, triton.runtime.JITFunction) and name.endswith("_kernel"):
                assert "PDL" in obj.arg_names, f"{info.name}.{name}"
                kernels.add((module.__name__, name))
    assert kernels
    assert kernels <= {(v.module, v.kernel) for v in triton_aot.variants()}


def test_a_kernel_that_cannot_compile_is_reported(monkeypatch, tmp_path):
    """A variant whose constexprs do not fit its kernel is an error row and exit status 1."""
    from tools import triton_aot

    bad = triton_aot.Variant("broken", "target.kernels.moe_route", "_route_kernel",
                             {"logits_ptr": "*bf16"}, {"TOP_K": 8}, {"num_warps": 4})
    monkeypatch.setattr(triton_aot, "variants", lambda attention_launches=(): [bad])
    out = tmp_path / "aot.json"
    assert triton_aot.main(["--out", str(out)]) == 1
    assert "error" in json.loads(out.read_text())[0]
