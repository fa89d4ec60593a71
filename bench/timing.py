"""Wall-clock sampling, and CUDA-graph capture of a list of calls, shared by the benchmarks."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

UNITS = {"s": 1.0, "ms": 1e3, "us": 1e6}


def sample_times(fn: Callable[[], object], iters: int, warmup: int,
                 sync: Callable[[], None] | None = None) -> tuple[list[float], object]:
    """Seconds per fn() call over `iters` calls after `warmup` ones, with sync() (e.g. a CUDA
    synchronize) before and after each timed call; also fn's last result."""
    out, samples = None, []
    for i in range(warmup + iters):
        if sync is not None:
            sync()
        t = time.perf_counter()
        out = fn()
        if sync is not None:
            sync()
        if i >= warmup:
            samples.append(time.perf_counter() - t)
    return samples, out


def median_p90(samples: list[float], unit: str, digits: int) -> dict[str, float]:
    """{"median_<unit>", "p90_<unit>"} of samples given in seconds."""
    scaled = sorted(x * UNITS[unit] for x in samples)
    return {f"median_{unit}": round(statistics.median(scaled), digits),
            f"p90_{unit}": round(scaled[int(0.9 * (len(scaled) - 1))], digits)}


def graphed(calls: list[Callable[[], object]]) -> Callable[[], None]:
    """The calls captured in one CUDA graph, run once first on a side stream (Triton compiles,
    cuBLAS workspaces); returns the graph's replay."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return graph.replay
