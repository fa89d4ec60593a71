"""Which kernel each of KernelConfig's choices (configs/kernels.py) takes on a device: "auto"
resolved, and a Triton kernel asked for where it cannot run refused with a ValueError naming
the choice. The models' set_kernels take their layers' kernels from here; the engine checks
a configuration against its device with `check` before it starts a process.

"auto" takes a Triton kernel on CUDA only (on CPU it would run in Triton's interpreter: that
is for tests that ask for it). The routed experts' "auto" resolves per step size, in
FusedExperts (target/layers/moe.py)."""

from __future__ import annotations

from types import ModuleType

import torch

from configs.kernels import KernelConfig
from target.kernels import (
    attention_triton,
    gdn,
    gdn_prologue,
    gdn_slots,
    moe_route,
    moe_sorted,
    moe_triton,
    pdl,
    penalties,
    qk_rope_triton,
)

# The Triton attention's launch shape in the models (attention_triton.ADAPTIVE_LAUNCH: each
# sequence's keys split by its length, split² ≥ 4 · keys, at most 256 splits; 16-row tiles
# for a launch whose rows fit, as a decode's).
ATTENTION_LAUNCH = attention_triton.ADAPTIVE_LAUNCH


def _check_triton(what: str, module: ModuleType, device: torch.device | str) -> None:
    """A Triton kernel module's kernels run on `device`: Triton imports, and the device is
    CUDA or the interpreter is on."""
    device = torch.device(device)
    if module.triton is None or (device.type != "cuda" and not module._interpreted()):
        raise ValueError(f"{what} needs Triton and a CUDA device (or TRITON_INTERPRET=1), "
                         f"not {device}")


def _triton_or(value: str, name: str, module: ModuleType, device: torch.device | str,
               other: str, triton_name: str = "triton") -> str:
    """A choice between a Triton kernel and `other`: "auto" takes the kernel on CUDA (never
    the interpreter); the kernel asked for is checked."""
    if value == "auto":
        device = torch.device(device)
        return triton_name if device.type == "cuda" and module.triton is not None else other
    if value == triton_name:
        _check_triton(f"{name} {value!r}", module, device)
    return value


def attention_kernel(kcfg: KernelConfig, device: torch.device | str) -> str:
    """The attention of decode, rounds and draft blocks on this device: "triton" or
    "torch"."""
    device = torch.device(device)
    if kcfg.attention == "auto":
        cuda = device.type == "cuda" and attention_triton.triton is not None
        return "triton" if cuda else "torch"
    if kcfg.attention == "triton" and not attention_triton.available(device):
        raise ValueError(f"attention_backend 'triton' needs Triton and a CUDA device (or "
                         f"TRITON_INTERPRET=1), not {device}"
                         + (" without Triton" if attention_triton.triton is None else ""))
    return kcfg.attention


def round_attention(kcfg: KernelConfig, device: torch.device | str, graphs: bool) -> str:
    """The target's uniform rounds (target/layers/attention.py ROUND_ATTENTION): "triton";
    or with torch, "gathered" (no host values: CUDA graphs capture it) when rounds are
    captured and the per-sequence "reference" when they run eagerly."""
    if attention_kernel(kcfg, device) == "triton":
        return "triton"
    return "gathered" if graphs else "reference"


def block_attention(kcfg: KernelConfig, device: torch.device | str) -> str:
    """The draft's blocks (draft/model.py BLOCK_ATTENTION): "triton" or "gathered"."""
    return "triton" if attention_kernel(kcfg, device) == "triton" else "gathered"


def attention_prologue_kernel(kcfg: KernelConfig, device: torch.device | str) -> str:
    """attention_prologue on this device: "triton" (needs Triton and CUDA, or
    TRITON_INTERPRET=1) or "torch"."""
    return _triton_or(kcfg.attention_prologue, "attention_prologue", qk_rope_triton, device,
                      "torch")


def experts_kernel(kcfg: KernelConfig, device: torch.device | str) -> str:
    """moe, checked against the device: the Triton paths ("pairs", "sorted") need Triton and
    CUDA (or TRITON_INTERPRET=1); "auto" stays, resolved per step (FusedExperts)."""
    if kcfg.moe in ("pairs", "sorted"):
        module = moe_triton if kcfg.moe == "pairs" else moe_sorted
        _check_triton(f"moe_backend {kcfg.moe!r}", module, device)
    return kcfg.moe


def routing_kernel(kcfg: KernelConfig, device: torch.device | str) -> str:
    """moe_routing on this device: "triton" (needs Triton and CUDA, or TRITON_INTERPRET=1)
    or "torch"."""
    return _triton_or(kcfg.moe_routing, "moe_routing", moe_route, device, "torch")


def penalties_kernel(kcfg: KernelConfig, device: torch.device | str) -> str:
    """penalties on this device: "triton" (as routing_kernel's) or "torch"."""
    return _triton_or(kcfg.penalties, "penalties", penalties, device, "torch")


def recurrence_kernel(kcfg: KernelConfig, device: torch.device | str) -> str:
    """gdn_recurrence on this device: "slots" (as routing_kernel's triton) or "fla"."""
    return _triton_or(kcfg.gdn_recurrence, "gdn_recurrence", gdn_slots, device, "fla",
                      triton_name="slots")


def recurrence_label(kcfg: KernelConfig, device: torch.device | str) -> str:
    """recurrence_kernel as it runs, for the start-up log: "fla" falls back to the torch forms
    off CUDA and where fla is not installed (target/kernels/gdn.py's dispatch)."""
    kind = recurrence_kernel(kcfg, device)
    if kind != "fla":
        return kind
    if torch.device(device).type != "cuda":
        return "torch (fla runs on CUDA only)"
    return "fla" if gdn.has_fla() else "torch (fla is not installed)"


def gdn_prologue_kernel(kcfg: KernelConfig, device: torch.device | str) -> str:
    """gdn_prologue on this device: "triton" needs Triton and CUDA (or TRITON_INTERPRET=1)
    and the slots recurrence (it leaves q and k at the key heads); "auto" takes it on CUDA
    with the slots recurrence."""
    slots = recurrence_kernel(kcfg, device) == "slots"
    if kcfg.gdn_prologue == "auto":
        cuda = torch.device(device).type == "cuda" and gdn_prologue.triton is not None
        return "triton" if slots and cuda else "torch"
    if kcfg.gdn_prologue == "triton":
        _check_triton("gdn_prologue 'triton'", gdn_prologue, device)
        if not slots:
            raise ValueError("gdn_prologue 'triton' needs gdn_recurrence 'slots'")
    return kcfg.gdn_prologue


def pdl_launch(kcfg: KernelConfig, device: torch.device | str) -> bool:
    """Whether the engine's Triton kernels launch with programmatic dependent launch on this
    device. "on" where it cannot run is a ValueError saying why (on a CUDA device this asks
    the GPU its compute capability)."""
    if kcfg.pdl == "off":
        return False
    reason = pdl.supported(device)
    if kcfg.pdl == "on" and reason is not None:
        raise ValueError(f"pdl 'on': {reason}")
    return reason is None


def pdl_compiled(kcfg: KernelConfig, device: torch.device | str) -> bool:
    """Whether the compiled elementwise chains take PDL too: wherever the Triton kernels do
    and Inductor has its own PDL (torch._inductor.config.triton.enable_pdl)."""
    return pdl_launch(kcfg, device) and pdl.compiled_supported() is None


def compiles_elementwise(kcfg: KernelConfig, graphs: bool) -> bool:
    """Whether the elementwise chains compile (target/kernels/fused.py): as asked, else
    whenever the engine captures CUDA graphs."""
    return graphs if kcfg.compile_elementwise is None else kcfg.compile_elementwise


def check(kcfg: KernelConfig, device: str) -> None:
    """A Triton kernel asked for where it cannot run, as a ValueError naming the choice: the
    engine's check at start-up, before any process loads weights. PDL is checked here off
    CUDA only: a GPU's compute capability is asked on its worker (set_kernels)."""
    attention_kernel(kcfg, device)
    experts_kernel(kcfg, device)
    attention_prologue_kernel(kcfg, device)
    routing_kernel(kcfg, device)
    gdn_prologue_kernel(kcfg, device)  # (and the recurrence)
    penalties_kernel(kcfg, device)
    if not device.startswith("cuda"):
        pdl_launch(kcfg, device)
