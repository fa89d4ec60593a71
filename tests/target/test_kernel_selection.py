"""target/kernels/selection.py: each of KernelConfig's choices resolved per device in one
place ("auto" takes a Triton kernel on CUDA only; one asked for where it cannot run is a
ValueError naming the choice, at start-up), reaching each layer through the models'
set_kernels — from the engine's EngineConfig (the workers) as from the benchmarks' flags."""

from __future__ import annotations

import pytest

from cluster.startup import EnginePlan
from configs.engine import EngineConfig
from configs.kernels import GDN_ROUNDS, MOE_BACKENDS, KernelConfig
from target.kernels import fused, selection


def test_triton_kernels_where_they_cannot_run_are_value_errors(monkeypatch, tiny_demo):
    from target.kernels import (
        gdn_prologue,
        gdn_slots,
        moe_route,
        moe_sorted,
        moe_triton,
        qk_rope_triton,
    )

    for module in (moe_route, gdn_slots, moe_sorted, moe_triton, qk_rope_triton, gdn_prologue):
        monkeypatch.setattr(module, "_interpreted", lambda: False)
    with pytest.raises(ValueError, match="moe_routing 'triton'"):
        selection.routing_kernel(KernelConfig(moe_routing="triton"), "cpu")
    with pytest.raises(ValueError, match="gdn_recurrence 'slots'"):
        selection.recurrence_kernel(KernelConfig(gdn_recurrence="slots"), "cpu")
    with pytest.raises(ValueError, match="attention_prologue 'triton'"):
        selection.attention_prologue_kernel(KernelConfig(attention_prologue="triton"), "cpu")
    with pytest.raises(ValueError, match="gdn_prologue 'triton'"):
        selection.gdn_prologue_kernel(KernelConfig(gdn_prologue="triton"), "cpu")
    for moe in ("pairs", "sorted"):  # at start-up, before loading: `serve --moe-backend pairs`
        with pytest.raises(ValueError, match=f"moe_backend '{moe}'"):
            EnginePlan.from_config(EngineConfig(model=str(tiny_demo[0]), moe_backend=moe))
    default = KernelConfig()
    resolved = [resolve(default, "cpu") for resolve in (
        selection.routing_kernel, selection.recurrence_kernel, selection.experts_kernel,
        selection.attention_prologue_kernel)]
    assert resolved == ["torch", "fla", "auto", "torch"]


def test_auto_takes_the_triton_kernels_on_cuda_only():
    """The defaults measured fastest on the H200 (docs/BENCHMARKS.md): on a CUDA device the
    router's Triton kernel, the in-place GDN recurrence and both Triton prologues; elsewhere
    their torch / fla references, never the interpreter unless asked for."""
    from target.kernels import gdn, gdn_slots, moe_route

    default = KernelConfig()
    on = (selection.routing_kernel, selection.recurrence_kernel,
          selection.attention_prologue_kernel, selection.gdn_prologue_kernel)

    def resolved(config: KernelConfig, device: str) -> tuple[str, ...]:
        return tuple(resolve(config, device) for resolve in on)

    assert resolved(default, "cpu") == ("torch", "fla", "torch", "torch")
    # the start-up log names what runs: off CUDA the "fla" choice is the torch reference
    assert selection.recurrence_label(default, "cpu") == "torch (fla runs on CUDA only)"
    fla = KernelConfig(gdn_recurrence="fla")
    assert selection.recurrence_label(fla, "cuda") in ("fla", "torch (fla is not installed)")
    assert (selection.recurrence_label(fla, "cuda") == "fla") == gdn.has_fla()
    if moe_route.triton is None or gdn_slots.triton is None:
        pytest.skip("Triton is not installed")
    assert resolved(default, "cuda") == ("triton", "slots", "triton", "triton")
    forced = KernelConfig(moe_routing="torch", gdn_recurrence="fla", attention_prologue="torch")
    # the GDN prologue's "auto" follows the recurrence: the fla path takes the torch one
    assert resolved(forced, "cuda") == ("torch", "fla", "torch", "torch")
    # the Triton GDN prologue leaves q and k at the key heads: the slots recurrence only
    assert selection.gdn_prologue_kernel(KernelConfig(gdn_prologue="triton"), "cuda") == "triton"
    with pytest.raises(ValueError, match="needs gdn_recurrence 'slots'"):
        selection.gdn_prologue_kernel(
            KernelConfig(gdn_prologue="triton", gdn_recurrence="fla"), "cuda")


def test_attention_resolves_per_device_and_use():
    auto = KernelConfig()
    assert selection.attention_kernel(auto, "cpu") == "torch"
    assert selection.round_attention(auto, "cpu", graphs=False) == "reference"
    # captured: no host values
    assert selection.round_attention(auto, "cpu", graphs=True) == "gathered"
    assert selection.block_attention(auto, "cpu") == "gathered"
    assert selection.compiles_elementwise(auto, True)
    assert not selection.compiles_elementwise(auto, False)
    assert not selection.compiles_elementwise(KernelConfig(compile_elementwise=False), True)


def layers(model, cls):
    return [m for m in model.modules() if isinstance(m, cls)]


def choices(target, draft) -> dict[str, set]:
    from draft.model import DraftAttention
    from target.layers.attention import GatedAttention
    from target.layers.gdn import GatedDeltaNet
    from target.layers.moe import SparseMoE

    moes = layers(target, SparseMoE)
    return {
        "round_attention": {m.round_attention for m in layers(target, GatedAttention)},
        "prologue": {m.prologue for m in layers(target, GatedAttention)},
        "launch": {m.triton_launch for m in layers(target, GatedAttention)
                   + layers(draft, DraftAttention)},
        "batched_rounds": {m.batched_rounds for m in layers(target, GatedDeltaNet)},
        "gdn_prologue": {m.prologue for m in layers(target, GatedDeltaNet)},
        "routing": {m.routing for m in moes},
        "experts": {m.experts.kernel for m in moes},
        "block_attention": {m.block_attention for m in layers(draft, DraftAttention)},
    }


# (the Triton paths refuse CPU outside the interpreter: the test below)
@pytest.mark.parametrize("moe", [m for m in MOE_BACKENDS if m not in ("auto", "pairs",
                                                                      "sorted")])
def test_set_kernels_reaches_every_layer_of_both_models(tiny_demo, moe):
    from draft.model import DFlashDraftModel
    from target.kernels import attention_triton
    from target.loader import load_target

    target = load_target(str(tiny_demo[0]))
    draft = DFlashDraftModel.from_pretrained(str(tiny_demo[1]))
    kernels = KernelConfig(moe=moe, gdn_rounds=GDN_ROUNDS[-1])
    try:
        target.set_kernels(kernels, graphs=True)
        draft.set_kernels(kernels, graphs=True)
        assert choices(target, draft) == {
            "round_attention": {"gathered"}, "prologue": {"torch"}, "batched_rounds": {False},
            "gdn_prologue": {"torch"},
            "launch": {attention_triton.ADAPTIVE_LAUNCH},
            "routing": {"torch"}, "experts": {moe}, "block_attention": {"gathered"}}
    finally:
        fused.enable(False)


def test_the_engine_workers_take_the_engine_configs_kernels(tiny_demo):
    """What `serve --moe-backend …` reaches: the in-process engine's target worker and draft
    worker set their models' kernels from EngineConfig."""
    from cluster.engine import LLMEngine

    target, draft = map(str, tiny_demo)
    cfg = EngineConfig(model=target, draft_model=draft, moe_backend="reference",
                       attention_backend="torch", max_num_seqs=2, max_model_len=64)
    engine = LLMEngine(cfg)
    executor = engine.executor  # a LocalExecutor over the workers' runners
    found = choices(executor.runner.model, executor.drafter.model)
    assert found["experts"] == {"reference"}
    assert found["round_attention"] == {"reference"}  # CPU: rounds run eagerly
    assert found["block_attention"] == {"gathered"}
    assert found["launch"] == {selection.ATTENTION_LAUNCH}  # "adaptive"
    assert not fused._enabled  # no CUDA graphs, no compiled chains
    out = engine.generate([[1, 2, 3]], [cfg_params()])[0]
    assert len(out.output_ids) == 4 and out.finish_reason == "length"


def test_kernel_overrides_reach_every_layer_and_are_checked_at_start_up(tiny_demo,
                                                                       monkeypatch):
    """EngineConfig.kernel_overrides (`serve --kernel-overrides`, tools/golden_check.py):
    "field=value,…" over the defaults reaches the workers' models; a Triton kernel asked for
    where it cannot run is a ValueError naming it when the engine starts, before loading (the
    values themselves are checked at configuration: tests/configs/test_kernels.py)."""
    from cluster.engine import LLMEngine

    target, draft = map(str, tiny_demo)
    cfg = EngineConfig(model=target, draft_model=draft, max_num_seqs=2, max_model_len=64,
                       kernel_overrides="gdn_rounds=per-seq, moe_routing=torch")
    executor = LLMEngine(cfg).executor
    found = choices(executor.runner.model, executor.drafter.model)
    assert found["batched_rounds"] == {False} and found["routing"] == {"torch"}
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for text, match in (("gdn_prologue=triton", "gdn_prologue 'triton'"),
                        ("pdl=on", "pdl 'on': it needs a CUDA device")):
        cfg = EngineConfig(model=target, kernel_overrides=text)
        with pytest.raises(ValueError, match=match):
            EnginePlan.from_config(cfg)
        with pytest.raises(ValueError, match=match):
            LLMEngine(cfg)


def test_pdl_is_off_where_it_cannot_run_and_on_asks_for_it(monkeypatch, tiny_demo):
    """KernelConfig.pdl (target/kernels/pdl.py): "auto" launches with PDL only where it runs,
    "on" where it cannot is a ValueError saying why, "off" never; the models' set_kernels set
    it for the process, and a kernel on a CPU tensor (Triton's interpreter) never takes it."""
    import torch

    from target.kernels import pdl
    from target.loader import load_target

    for choice in ("auto", "off"):
        assert selection.pdl_launch(KernelConfig(pdl=choice), "cpu") is False
    with pytest.raises(ValueError, match="pdl 'on': it needs a CUDA device, not cpu"):
        selection.pdl_launch(KernelConfig(pdl="on"), "cpu")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match="compute capability 9.0 or later, this GPU has 8.0"):
        selection.pdl_launch(KernelConfig(pdl="on"), "cuda")
    assert selection.pdl_launch(KernelConfig(), "cuda") is False
    if pdl.triton is not None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
        assert selection.pdl_launch(KernelConfig(), "cuda") is True
        assert selection.pdl_launch(KernelConfig(pdl="off"), "cuda") is False
    with pytest.raises(ValueError, match="pdl 'on': it needs a CUDA device"):
        selection.pdl_compiled(KernelConfig(pdl="on"), "cpu")
    assert selection.pdl_compiled(KernelConfig(), "cpu") is False
    target = load_target(str(tiny_demo[0]))
    try:
        pdl.enable(True)
        assert pdl.options(torch.zeros(1)) == {"PDL": False}  # a CPU tensor
        target.set_kernels(KernelConfig(), graphs=False)  # CPU: off
        assert not pdl.enabled()
    finally:
        pdl.enable(False)


def test_pdl_takes_the_compiled_chains_through_inductors_own_pdl(monkeypatch):
    """pdl on: the Triton kernels' PDL and Inductor's (torch._inductor.config.triton.
    enable_pdl) for the compiled chains, where Inductor has it; a change of the latter drops
    what torch.compile compiled (they compile again under it), no change drops nothing."""
    import torch

    from target.kernels import pdl

    if pdl.triton is None or pdl.compiled_supported() is not None:
        pytest.skip(f"needs Triton and Inductor's PDL: {pdl.compiled_supported()}")
    import torch._inductor.config as inductor

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    for choice in ("auto", "on"):
        assert selection.pdl_launch(KernelConfig(pdl=choice), "cuda") is True
        assert selection.pdl_compiled(KernelConfig(pdl=choice), "cuda") is True
    assert selection.pdl_compiled(KernelConfig(pdl="off"), "cuda") is False
    monkeypatch.setattr(pdl, "compiled_supported", lambda: "torch 2.4's Inductor has no PDL")
    assert selection.pdl_launch(KernelConfig(pdl="on"), "cuda") is True  # the Triton kernels alone
    assert selection.pdl_compiled(KernelConfig(pdl="on"), "cuda") is False
    monkeypatch.undo()
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    resets = []
    monkeypatch.setattr(torch._dynamo, "reset", lambda: resets.append(1))
    try:
        pdl.enable(True, compiled=True)
        assert pdl.enabled() and inductor.triton.enable_pdl and len(resets) == 1
        pdl.enable(True, compiled=True)
        assert len(resets) == 1
        pdl.enable(True)
        assert not inductor.triton.enable_pdl and len(resets) == 2
    finally:
        pdl.enable(False)
    assert not inductor.triton.enable_pdl


def cfg_params():
    from configs.engine import SamplingParams

    return SamplingParams(max_tokens=4, ignore_eos=True)


def test_a_draft_alone_in_its_process_compiles_its_chains_with_graphs(tiny_demo):
    """The draft actor's process holds no target: the draft's set_kernels decides whether
    the elementwise chains compile, as the target's does in the workers."""
    from draft.model import DFlashDraftModel

    draft = DFlashDraftModel.from_pretrained(str(tiny_demo[1]))
    try:
        fused.enable(False)
        draft.set_kernels(KernelConfig(), graphs=True)
        assert fused._enabled
        draft.set_kernels(KernelConfig(), graphs=False)
        assert not fused._enabled
        draft.set_kernels(KernelConfig(compile_elementwise=False), graphs=True)
        assert not fused._enabled
    finally:
        fused.enable(False)
