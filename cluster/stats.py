"""Engine-side statistics that outlive a step: round timings in Prometheus' histogram shape.
Kept by the engine (which times its own calls), copied into each published snapshot."""

from __future__ import annotations

import bisect
from dataclasses import dataclass

# Seconds. A decode round on an H200 takes a few ms; on the CPU demo, tens of ms.
ROUND_TIME_BUCKETS = (0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05,
                      0.075, 0.1, 0.2, 0.5, 1.0, 2.5, 5.0)


@dataclass(frozen=True)
class TimeHistogram:
    """Cumulative timings in Prometheus' shape."""

    bounds: tuple[float, ...]  # bucket upper bounds in seconds, increasing
    cumulative_counts: tuple[int, ...]  # observations <= each bound
    count: int  # all observations (the +Inf bucket)
    sum_s: float


class TimeAccumulator:
    def __init__(self, bounds: tuple[float, ...] = ROUND_TIME_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * len(bounds)  # per bucket, not cumulative
        self.count = 0
        self.sum_s = 0.0

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.bounds, seconds)
        if i < len(self.bounds):
            self.counts[i] += 1
        self.count += 1
        self.sum_s += seconds

    def snapshot(self) -> TimeHistogram:
        cumulative, total = [], 0
        for c in self.counts:
            total += c
            cumulative.append(total)
        return TimeHistogram(self.bounds, tuple(cumulative), self.count, self.sum_s)
