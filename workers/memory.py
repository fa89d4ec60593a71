"""How many KV pages an engine gets: measured at start-up, after the weights are loaded and
before any cache exists (vLLM's `gpu_memory_utilization` scheme).

Each process on a GPU reports a `MemoryProfile`: what the GPU has left for caches within its
utilisation share after the weights (every process on that GPU counted, through
`cudaMemGetInfo`) and this process's activation peak (measured by a dummy forward of the
largest step), and what one page / one state slot costs it. The driver adds up the processes
sharing a GPU (TP rank 0 + the draft) and takes the smallest page count over GPUs: every rank
holds the same page ids. On CPU nothing is measured: the pool holds `max_num_seqs`
full-length sequences (or `num_pages`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryProfile:
    """One process's view of its GPU; crosses the actor boundary."""

    gpu_id: str  # physical GPU (UUID): processes with the same id share its memory
    cache_budget: int  # bytes left for caches on this GPU (shared by all its processes)
    activation_peak: int  # bytes this process needs beyond its caches while running a step
    bytes_per_page: int  # this process's KV bytes per page (all its layers)
    bytes_per_slot: int  # this process's recurrent-state bytes per sequence slot


def gpu_id(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


def measure_peak(device: torch.device, run: Callable[[], None]) -> int:
    """Extra bytes `run` allocates at its peak (its transient buffers are freed after)."""
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    run()
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    torch.cuda.empty_cache()
    return peak


def cache_budget(device: torch.device, utilization: float) -> int:
    """Bytes of this GPU still free within `utilization` × total, all processes counted."""
    free, total = torch.cuda.mem_get_info(device)
    return int(total * utilization) - (total - free)


def plan_snapshots(profiles: list[MemoryProfile], num_slots: int, state_gb: float | None,
                   fraction: float, cap: int) -> int:
    """The prefix cache's state snapshots every GPU can hold: `state_gb` GiB of them per GPU,
    or `fraction` of what a GPU has left for caches once its processes have their running
    state slots and activation headroom; the fewest over GPUs, at most `cap`. 0 where no
    process keeps recurrent state."""
    by_gpu: dict[str, list[MemoryProfile]] = {}
    for p in profiles:
        by_gpu.setdefault(p.gpu_id, []).append(p)
    counts = []
    for procs in by_gpu.values():
        slot = sum(p.bytes_per_slot for p in procs)
        if not slot:
            continue
        budget = min(p.cache_budget for p in procs)
        left = budget - sum(p.activation_peak + num_slots * p.bytes_per_slot for p in procs)
        want = state_gb * (1 << 30) if state_gb is not None else fraction * max(left, 0)
        counts.append(int(want // slot))
    return min([cap, *counts]) if counts else 0


def plan_num_pages(profiles: list[MemoryProfile], num_slots: int, min_pages: int) -> int:
    """Pages every GPU can hold once each of its processes has its state slots and activation
    headroom. Raises ValueError (the tightest GPU's figures, and what to change) when one
    full-length sequence does not fit."""
    by_gpu: dict[str, list[MemoryProfile]] = {}
    for p in profiles:
        by_gpu.setdefault(p.gpu_id, []).append(p)
    plans = []  # (pages, GPU id, its budget, its processes)
    for gpu, procs in by_gpu.items():
        budget = min(p.cache_budget for p in procs)  # measured at different moments: the least
        left = budget - sum(p.activation_peak + num_slots * p.bytes_per_slot for p in procs)
        per_page = sum(p.bytes_per_page for p in procs)
        plans.append((max(left, 0) // per_page if per_page else 0, gpu, budget, procs))
    num_pages, gpu, budget, procs = min(plans, key=lambda plan: plan[0])
    if num_pages < min_pages:
        gib = 1 << 30
        slot = sum(p.bytes_per_slot for p in procs)
        per_page = sum(p.bytes_per_page for p in procs)
        raise ValueError(
            f"the GPU memory left after weights, activations and {num_slots} state slots holds "
            f"{num_pages} KV pages; one full-length sequence needs {min_pages}. On GPU {gpu}: "
            f"{budget / gib:.2f} GiB left within gpu_memory_utilization once the weights were "
            f"loaded, {sum(p.activation_peak for p in procs) / gib:.2f} GiB of activation "
            f"peaks, {num_slots * slot / gib:.2f} GiB for {num_slots} state slots "
            f"(max_num_seqs; {slot / (1 << 20):.1f} MiB each), and a full-length sequence's "
            f"pages take {min_pages * per_page / gib:.2f} GiB. Lower max_model_len or "
            f"max_num_seqs, raise gpu_memory_utilization, or use more GPUs (tp)")
    return num_pages
