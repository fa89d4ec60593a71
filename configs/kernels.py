"""Every choice between kernels, in one place: `KernelConfig`. The engine builds it from
EngineConfig (`attention_backend`, `moe_backend`, and `kernel_overrides` for the others, as
"field=value,…": `parse_choices`); the benchmarks build it from their flags to measure one
path against another in the same build. A model takes it once, after loading
(`Qwen3_5MoeForCausalLM.set_kernels`, `DFlashDraftModel.set_kernels`), and each layer keeps
the choice it was given: nothing is switched per class or per process by a benchmark.

"auto" resolves per device and, for the routed experts, per step size (FusedExperts): the
defaults are the paths measured fastest on the H200 (docs/BENCHMARKS.md); the others are the
references the tests compare against and the CPU paths."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

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


def _check_triton(what: str, module, device: torch.device | str) -> None:
    """A Triton kernel module's kernels run on `device`: Triton imports, and the device is
    CUDA or the interpreter is on."""
    device = torch.device(device)
    if module.triton is None or (device.type != "cuda" and not module._interpreted()):
        raise ValueError(f"{what} needs Triton and a CUDA device (or TRITON_INTERPRET=1), "
                         f"not {device}")


def _triton_or(value: str, name: str, module, device: torch.device | str, other: str,
               triton_name: str = "triton") -> str:
    """A choice between a Triton kernel and `other`: "auto" takes the kernel on CUDA (never
    the interpreter: that is for tests that ask for it); the kernel asked for is checked."""
    if value == "auto":
        device = torch.device(device)
        return triton_name if device.type == "cuda" and module.triton is not None else other
    if value == triton_name:
        _check_triton(f"{name} {value!r}", module, device)
    return value


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

    def attention_kernel(self, device: torch.device | str) -> str:
        """The resolved attention on this device: "triton" or "torch". "auto" takes triton on
        CUDA only (on CPU it would run in Triton's interpreter: tests)."""
        from target.kernels import attention_triton

        device = torch.device(device)
        if self.attention == "auto":
            cuda = device.type == "cuda" and attention_triton.triton is not None
            return "triton" if cuda else "torch"
        if self.attention == "triton" and not attention_triton.available(device):
            raise ValueError(f"attention_backend 'triton' needs Triton and a CUDA device (or "
                             f"TRITON_INTERPRET=1), not {device}"
                             + (" without Triton" if attention_triton.triton is None else ""))
        return self.attention

    def attention_launch(self):
        """The Triton attention's launch shape in the models (attention_triton.ADAPTIVE_LAUNCH:
        each sequence's keys split by its length, split² ≥ 4 · keys, at most 256 splits; 16-row
        tiles for a launch whose rows fit, as a decode's)."""
        from target.kernels import attention_triton

        return attention_triton.ADAPTIVE_LAUNCH

    def attention_prologue_kernel(self, device: torch.device | str) -> str:
        """attention_prologue resolved on this device: "triton" (needs Triton and CUDA, or
        TRITON_INTERPRET=1) or "torch"."""
        from target.kernels import qk_rope_triton

        return _triton_or(self.attention_prologue, "attention_prologue", qk_rope_triton,
                          device, "torch")

    def experts_kernel(self, device: torch.device | str) -> str:
        """moe, checked against the device: the Triton paths ("pairs", "sorted") need Triton
        and CUDA (or TRITON_INTERPRET=1); "auto" resolves per step (FusedExperts)."""
        from target.kernels import moe_sorted, moe_triton

        if self.moe in ("pairs", "sorted"):
            module = moe_triton if self.moe == "pairs" else moe_sorted
            _check_triton(f"moe_backend {self.moe!r}", module, device)
        return self.moe

    def routing_kernel(self, device: torch.device | str) -> str:
        """moe_routing resolved on this device: "triton" (needs Triton and CUDA, or
        TRITON_INTERPRET=1) or "torch"."""
        from target.kernels import moe_route

        return _triton_or(self.moe_routing, "moe_routing", moe_route, device, "torch")

    def recurrence_kernel(self, device: torch.device | str) -> str:
        """gdn_recurrence resolved on this device: "slots" (as routing_kernel's triton) or
        "fla"."""
        from target.kernels import gdn_slots

        return _triton_or(self.gdn_recurrence, "gdn_recurrence", gdn_slots, device, "fla",
                          triton_name="slots")

    def gdn_prologue_kernel(self, device: torch.device | str) -> str:
        """gdn_prologue resolved on this device: "triton" needs Triton and CUDA (or
        TRITON_INTERPRET=1) and the slots recurrence (it leaves q and k at the key heads);
        "auto" takes it on CUDA with the slots recurrence (never the interpreter)."""
        from target.kernels import gdn_prologue

        slots = self.recurrence_kernel(device) == "slots"
        if self.gdn_prologue == "auto":
            cuda = torch.device(device).type == "cuda" and gdn_prologue.triton is not None
            return "triton" if slots and cuda else "torch"
        if self.gdn_prologue == "triton":
            _check_triton("gdn_prologue 'triton'", gdn_prologue, device)
            if not slots:
                raise ValueError("gdn_prologue 'triton' needs gdn_recurrence 'slots'")
        return self.gdn_prologue

    def pdl_launch(self, device: torch.device | str) -> bool:
        """pdl resolved on this device: whether the engine's Triton kernels launch with
        programmatic dependent launch. "on" where it cannot run is a ValueError saying why (on
        a CUDA device this asks the GPU its compute capability)."""
        from target.kernels import pdl

        if self.pdl == "off":
            return False
        reason = pdl.supported(device)
        if self.pdl == "on" and reason is not None:
            raise ValueError(f"pdl 'on': {reason}")
        return reason is None

    def pdl_compiled(self, device: torch.device | str) -> bool:
        """Whether the compiled elementwise chains take PDL too: wherever the Triton kernels
        do and Inductor has its own PDL (torch._inductor.config.triton.enable_pdl)."""
        from target.kernels import pdl

        return self.pdl_launch(device) and pdl.compiled_supported() is None

    def round_attention(self, device: torch.device | str, graphs: bool) -> str:
        """The target's uniform rounds (target/layers/attention.py ROUND_ATTENTION): "triton";
        or with torch, "gathered" (no host values: CUDA graphs capture it) when rounds are
        captured and the per-sequence "reference" when they run eagerly."""
        if self.attention_kernel(device) == "triton":
            return "triton"
        return "gathered" if graphs else "reference"

    def block_attention(self, device: torch.device | str) -> str:
        """The draft's blocks (draft/model.py BLOCK_ATTENTION): "triton" or "gathered"."""
        return "triton" if self.attention_kernel(device) == "triton" else "gathered"

    def compiles_elementwise(self, graphs: bool) -> bool:
        return graphs if self.compile_elementwise is None else self.compile_elementwise
