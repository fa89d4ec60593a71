"""Programmatic dependent launch (PDL; CUDA, sm90 and later) for the engine's GPU kernels.

A kernel launched with PDL (CUDA's programmatic stream serialization) may have its programs
started while the kernel before it in the stream is still running: once every program of
that kernel has executed `griddepcontrol.launch_dependents`, or exited. With PDL on, each of
the engine's Triton kernels executes, before anything else, `launch_dependents` (its
successor may be launched) and then `griddepcontrol.wait`, which returns once the kernel
before it has completed and its memory writes are visible. Nothing is read or written before
the wait, so each kernel still does all its work after the previous one's, on the same data,
with the same bits: what overlaps is a kernel's launch and ramp with its predecessor's tail,
the gaps between the few-microsecond kernels of a decode step. A kernel without PDL (cuBLAS,
fla's) waits for everything before it, as ever, and a PDL kernel after one of them is
launched when it ends. Stream capture keeps the programmatic dependencies in the engine's
CUDA graphs (docs/BENCHMARKS.md's decode figures with PDL are graph replays).

The compiled elementwise chains (norms, gates, the MoE combine: ~90 kernels a decode step)
take PDL too where this torch's Inductor has its own code generation for it (`enable(compiled=
True)`): Inductor puts `griddepcontrol.wait` before a kernel's first load of a buffer the
kernel before it in the same compiled graph writes, and `launch_dependents` after that wait.
Its loads of other buffers may come before the wait. That is safe beside the engine's
kernels: a chain's first kernel waits before its first load, and every kernel that loads
anything has the wait and lets the next one launch only after it, so a later kernel of a
chain starts only once everything before the kernel before it has completed. (Every kernel
of the chains here, target/kernels/fused.py and draft/fused.py, loads: they create no tensors
of their own.) Its bits are not always those of the chain compiled without PDL: in one
of the tests' chains (the GDN conv with fp32 q and k) some values came out apart by rounding
(at most 1.2e-7, the same each run), though Inductor's Triton source differed only by the two
PDL lines (docs/BENCHMARKS.md). What exactness needs holds either way: a decode, a verify
block and a prefill run the same compiled chains, so the goldens (docs/ARCHITECTURE.md)
compare like with like.

Process-wide, like the compiled elementwise chains (target/kernels/fused.py): the models'
`set_kernels` call `enable()` with KernelConfig's `pdl` resolved (selection.pdl_launch); each
launch reads it, so a captured graph keeps the setting in force when it was captured. Off
CUDA (Triton's interpreter: the tests) a kernel's PDL is always off.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

_enabled = False


def supported(device: torch.device | str) -> str | None:
    """Why PDL cannot run on `device`, or None: it needs a CUDA device of compute capability
    9.0 or later, and a Triton that takes the `launch_pdl` launch option."""
    device = torch.device(device)
    if triton is None:
        return "Triton is not installed"
    if device.type != "cuda":
        return f"it needs a CUDA device, not {device}"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"it needs compute capability 9.0 or later, this GPU has {major}.{minor}"
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:
        return "this Triton has no CUDA backend"
    if "launch_pdl" not in CUDAOptions.__dataclass_fields__:
        return f"Triton {triton.__version__} has no launch_pdl option"
    return None


def compiled_supported() -> str | None:
    """Why the compiled elementwise chains cannot take PDL (beyond `supported`), or None:
    it needs an Inductor with its own PDL code generation."""
    try:
        import torch._inductor.config as inductor
    except ImportError:
        return "torch has no Inductor"
    if not hasattr(inductor.triton, "enable_pdl"):
        return f"torch {torch.__version__}'s Inductor has no enable_pdl"
    return None


def enable(on: bool, compiled: bool = False) -> None:
    """Launch the engine's Triton kernels with PDL (on) or plainly, from now on, in this
    process (selection.pdl_launch says whether the device can). compiled: the elementwise
    chains torch.compile makes (target/kernels/fused.py) too, through Inductor's own PDL
    (torch._inductor.config.triton.enable_pdl; selection.pdl_compiled); a change of it
    drops what torch.compile has compiled, so that the chains compile again under it."""
    global _enabled
    _enabled = on
    if compiled_supported() is not None:
        if compiled:
            raise ValueError(f"PDL for the compiled chains: {compiled_supported()}")
        return
    import torch._inductor.config as inductor

    if inductor.triton.enable_pdl != compiled:
        inductor.triton.enable_pdl = compiled
        torch._dynamo.reset()


def enabled() -> bool:
    return _enabled


def options(x: torch.Tensor) -> dict:
    """A launch's keyword arguments for the kernel that works on `x`: the kernel's PDL
    constexpr, and with it on (enabled, x on CUDA) Triton's launch_pdl option."""
    if _enabled and x.is_cuda:
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def await_prior(PDL: tl.constexpr):
        """A kernel's first statement: with PDL, let the next kernel launch, then wait for
        the previous one to complete (its writes visible); without, nothing."""
        if PDL:
            gdc_launch_dependents()
            gdc_wait()
