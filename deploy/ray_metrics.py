"""Every series of a replica's /metrics, copied into Ray's metrics export. With several
replicas no single /metrics holds the deployment's totals; Prometheus scraping Ray's per-node
endpoints (`ray start --metrics-export-port`) sees every replica, and `sum by (model_name)`
adds them up.

A task in the replica copies its registry every EXPORT_PERIOD_S, so requests pay nothing for
it, and the engine-side series (snapshots of the engine's own counts) go the same way as the
request-side ones. Ray names each series `ray_` + its /metrics name and labels it with those
of /metrics, Serve's `deployment`, `replica` and `application`, and its own `WorkerId`,
`NodeAddress`, `SessionName`, `Version`, `Component`.

- Counters become Ray counters, increased by what the local one gained since the last copy.
  One that went down was reset (a new engine driver): all of its value is new, so Ray's keeps
  counting. A counter still at 0 has no Ray series yet (Ray's take increases > 0 only).
- Gauges, and the `_bucket`, `_count` and `_sum` series of histograms, become Ray gauges set
  to the value: Ray's histogram takes one observation per call, and replaying them would cost
  a call per generated token (inter-token latency). PromQL's rate() and histogram_quantile()
  read them the same; only the exported TYPE says gauge.
- The `vllm:` twins of /metrics' series are left out: Ray refuses a name with a `:`, and each is
  a copy of a `dflash_` series that is copied.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from contextlib import suppress

from prometheus_client import CollectorRegistry
from ray.serve.metrics import Counter, Gauge

log = logging.getLogger(__name__)

# Ray's workers pass their metrics to the node's agent every 10 s (metrics_report_interval_ms).
EXPORT_PERIOD_S = 5.0


class RayMetricsExport:
    def __init__(self, registry: CollectorRegistry, refresh: Callable[[], Awaitable[None]],
                 period_s: float = EXPORT_PERIOD_S):
        self.registry, self.refresh, self.period_s = registry, refresh, period_s
        self._metrics: dict[str, Counter | Gauge] = {}  # by Ray metric name
        self._counted: dict[tuple[str, tuple], float] = {}  # each counter as of the last copy
        self._task: asyncio.Task | None = None

    def push(self) -> None:
        """Copies the registry as it is now."""
        for family in self.registry.collect():
            for s in family.samples:
                if s.name.endswith("_created"):
                    continue  # prometheus_client's creation times: nothing to add up
                if ":" in s.name:
                    continue  # vLLM's names of dflash_ series: Ray refuses a `:` in a name
                if family.type != "counter":
                    self._metric(Gauge, s.name, family.documentation, s.labels).set(
                        s.value, s.labels)
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                last = self._counted.get(key, 0.0)
                self._counted[key] = s.value
                gained = s.value - last if s.value >= last else s.value
                if gained > 0:  # Ray appends _total to a counter's name, as /metrics does
                    self._metric(Counter, s.name.removesuffix("_total"), family.documentation,
                                 s.labels).inc(gained, s.labels)

    def _metric(self, kind: type[Counter | Gauge], name: str, doc: str,
                labels: dict[str, str]) -> Counter | Gauge:
        metric = self._metrics.get(name)
        if metric is None:
            metric = self._metrics[name] = kind(name, doc, tuple(sorted(labels)))
        return metric

    def start(self) -> None:
        """Copies now and every period_s from a task on the running event loop, for as long
        as the loop runs (a replica's, for its lifetime)."""
        self._task = asyncio.get_running_loop().create_task(self._run())  # held: not GC'd

    async def _run(self) -> None:
        failing = False
        while True:
            # A dead or stuck engine: its last snapshot (as /metrics), and the request series.
            with suppress(Exception):
                await asyncio.wait_for(self.refresh(), self.period_s)
            try:
                self.push()
                failing = False
            except Exception as e:  # said once per streak of failures, not every period
                if not failing:
                    log.warning("copying the metrics into Ray's export failed: %s", e)
                failing = True
            await asyncio.sleep(self.period_s)
