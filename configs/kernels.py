"""Every choice between kernels, in one place: `KernelConfig`. The engine builds it from
EngineConfig (`attention_backend`, `moe_backend`, and `kernel_overrides` for the others, as
"field=value,…": `parse_choices`); the benchmarks build it from their flags to measure one
path against another in the same build. A model takes it once, after loading
(`Qwen3_5MoeForCausalLM.set_kernels`, `DFlashDraftModel.set_kernels`), and each layer keeps
the choice it was given: nothing is switched per class or per process by a benchmark.

Plain values only: which kernel a choice takes on a device ("auto" per device and, for the
routed experts, per step size in FusedExperts) is resolved beside the kernels, in
target/kernels/selection.py. The defaults are the paths measured fastest on the H200
(docs/BENCHMARKS.md); the others are the references the tests compare against and the CPU
paths."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

# Decode steps, verify rounds and the draft's blocks: "triton" reads the KV pages in place,
# keys split across programs (target/kernels/attention_triton.py); "torch" gathers each
# sequence's pages, then batched matmuls or SDPA (target/kernels/attention.py); "auto" is
# triton where Triton runs (CUDA), torch elsewhere. Prefill chunks take PyTorch's flash kernels
# with either.
ATTENTION_BACKENDS = ("auto", "triton", "torch")
# Full attention's prologue (target/layers/attention.py): "triton"
# (target/kernels/qk_rope_triton.py: the q and k norms, RoPE and the K/V cache writes as one
# launch per layer) or "torch" (fused.qk_norm_rope, then attention.store_kv's index copies);
# "auto" is triton where Triton runs (CUDA), torch elsewhere.
ATTENTION_PROLOGUE = ("auto", "torch", "triton")
# The routed experts (target/layers/moe.py FusedExperts): "auto" takes, on CUDA, the Triton
# pair GEMVs up to PAIR_MAX (token, slot) pairs (small decode steps), the sorted-pair block
# GEMMs up to SORTED_MAX (pairs sorted by expert, block-aligned: each touched expert's
# weights read once per block of its pairs), and grouped GEMMs above that or where Triton
# does not run (gathered weights where torch._grouped_mm does not); the per-expert loop on
# CPU. The others force one path for every step size: the references the tests compare
# against.
MOE_BACKENDS = ("auto", "pairs", "sorted", "grouped", "gathered", "reference")
# The router's softmax → top-k → renormalise: "triton" (target/kernels/moe_route.py: one
# kernel) or "torch" (fused.moe_route: compiled, with torch.topk's kernels beside it); "auto"
# is triton where Triton runs (CUDA), torch elsewhere.
MOE_ROUTING = ("auto", "torch", "triton")
# The Gated DeltaNet recurrence of batched rounds and their commit: "slots"
# (target/kernels/gdn_slots.py: the states read and written in place by slot) or "fla" (fla's
# kernel on the states gathered out of the cache, scattered back; the torch reference off
# CUDA); "auto" is slots where Triton runs (CUDA), fla elsewhere.
GDN_RECURRENCE = ("auto", "fla", "slots")
# The Gated DeltaNet's elementwise work around the recurrence of uniform rounds: "torch"
# (fused.gdn_gates and fused.conv_split_heads before it, fused.gated_rms_norm after it,
# compiled) or, with the slots recurrence, "triton" (target/kernels/gdn_prologue.py: the conv,
# head split, q/k norms and gates in one launch per layer, a decode's conv state written in it;
# the gated output norm one program per token and head); "auto" is triton on CUDA with the
# slots recurrence, torch elsewhere.
GDN_PROLOGUE = ("auto", "torch", "triton")
# How the engine's GPU kernels are launched (target/kernels/pdl.py): "on", with CUDA's
# programmatic dependent launch, each kernel's launch and ramp overlapping the tail of the
# kernel before it: the engine's Triton kernels (each waits for that kernel's writes before it
# reads or writes anything: the same bits) and, where this torch's Inductor has its own PDL,
# the compiled elementwise chains (each waits before its first load of what the kernel before
# it wrote); "off", plainly; "auto" is on where it runs (a CUDA GPU of compute capability 9.0
# or later, a Triton with the launch_pdl option), off elsewhere. Process-wide.
PDL = ("auto", "on", "off")
# The sampling penalties (repetition, frequency, presence) of a step's penalized rows: "triton"
# (target/kernels/penalties.py: one read and one write of each penalized row) or "torch"
# (workers/logit_controls.py: each row's counts and factors as [rows, vocabulary] tensors: the
# reference); "auto" is triton where Triton runs (CUDA), torch elsewhere.
PENALTIES = ("auto", "torch", "triton")
# Gated DeltaNet in uniform rounds: one batched pass ("batched") or the per-sequence path that
# mixed batches take ("per-seq": the reference).
GDN_ROUNDS = ("batched", "per-seq")


def parse_choices(text: str, what: str = "kernel_overrides") -> dict[str, str]:
    """"field=value[,…]" over KernelConfig's choices (every field but compile_elementwise,
    which follows CUDA graphs) → {field: value}, the values checked when a KernelConfig is
    built; "" → {}. A ValueError naming `what` for a malformed item or an unknown field."""
    choices = [f.name for f in dataclasses.fields(KernelConfig)
               if f.name != "compile_elementwise"]
    out: dict[str, str] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, eq, value = item.partition("=")
        if not eq or not name or not value:
            raise ValueError(f"{what}: {item!r} is not field=value")
        if name not in choices:
            raise ValueError(f"{what}: {name!r} is not a kernel choice; one of {choices}")
        out[name] = value
    return out


def _check(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


@dataclass(frozen=True)
class KernelConfig:
    attention: str = "auto"  # ATTENTION_BACKENDS
    attention_prologue: str = "auto"  # ATTENTION_PROLOGUE
    moe: str = "auto"  # MOE_BACKENDS
    moe_routing: str = "auto"  # MOE_ROUTING
    gdn_rounds: str = "batched"  # GDN_ROUNDS
    gdn_recurrence: str = "auto"  # GDN_RECURRENCE
    gdn_prologue: str = "auto"  # GDN_PROLOGUE
    pdl: str = "auto"  # PDL
    penalties: str = "auto"  # PENALTIES
    # The elementwise chains compiled into one kernel each (target/kernels/fused.py; CUDA
    # only). None: whenever the engine captures CUDA graphs. Process-wide: torch.compile's
    # functions are shared by every model in the process.
    compile_elementwise: bool | None = None

    def __post_init__(self) -> None:
        _check("attention_backend", self.attention, ATTENTION_BACKENDS)
        _check("attention_prologue", self.attention_prologue, ATTENTION_PROLOGUE)
        _check("moe_backend", self.moe, MOE_BACKENDS)
        _check("moe_routing", self.moe_routing, MOE_ROUTING)
        _check("gdn_rounds", self.gdn_rounds, GDN_ROUNDS)
        _check("gdn_recurrence", self.gdn_recurrence, GDN_RECURRENCE)
        _check("gdn_prologue", self.gdn_prologue, GDN_PROLOGUE)
        _check("pdl", self.pdl, PDL)
        _check("penalties", self.penalties, PENALTIES)
        if self.compile_elementwise is not None and not isinstance(self.compile_elementwise,
                                                                   bool):
            raise ValueError(f"compile_elementwise must be True, False or None, got "
                             f"{self.compile_elementwise!r}")
