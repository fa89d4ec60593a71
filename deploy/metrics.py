"""Prometheus metrics of one API server, in a registry of its own (never the global one, so
several apps or test servers in one process do not collide).

Request-side series are observed by the HTTP layer as requests end; engine-side series are
read from `EngineClient.snapshot()` at scrape time, so they cost nothing between scrapes.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from cluster.stats import TimeHistogram
from deploy.engine_client import EngineSnapshot, RequestTiming

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ACCEPTANCE_BUCKETS = tuple(range(1, 17))  # tokens committed per round; longer ones land in +Inf


class ServingMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("dflash_requests", "Requests finished, by finish reason",
                                ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("dflash_request_errors", "Requests answered with an error",
                              ["endpoint", "code"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens processed",
                                     registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated",
                                         registry=r)
        self.ttft = Histogram("dflash_time_to_first_token_seconds",
                              "From request arrival to the first generated token",
                              buckets=LATENCY_BUCKETS, registry=r)
        # A speculative round delivers a batch of k tokens after a gap dt: observed as k tokens
        # of dt/k each, so the mean is the per-token latency a streaming client sees.
        self.itl = Histogram("dflash_inter_token_latency_seconds",
                             "Time per generated token after the first", buckets=LATENCY_BUCKETS,
                             registry=r)
        self.e2e = Histogram("dflash_e2e_request_latency_seconds",
                             "From request arrival to its last token", buckets=LATENCY_BUCKETS,
                             registry=r)
        r.register(_EngineCollector(snapshot))

    def observe_request(self, endpoint: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int, timing: RequestTiming, now: float) -> None:
        self.requests.labels(endpoint, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if timing.first_token is not None:
            self.ttft.observe(timing.first_token - timing.arrival)
        for gap, k in timing.token_batches:
            for _ in range(k):
                self.itl.observe(gap / k)
        self.e2e.observe((timing.finished or now) - timing.arrival)

    def observe_error(self, endpoint: str, status: int) -> None:
        self.errors.labels(endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _histogram(name: str, doc: str, h: TimeHistogram) -> HistogramMetricFamily:
    buckets = [(floatToGoString(b), c) for b, c in zip(h.bounds, h.cumulative_counts,
                                                       strict=True)]
    return HistogramMetricFamily(name, doc, buckets=[*buckets, ("+Inf", h.count)],
                                 sum_value=h.sum_s)


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], EngineSnapshot]):
        self.snapshot = snapshot

    def collect(self) -> Iterator[Metric]:
        s = self.snapshot()
        yield GaugeMetricFamily("dflash_num_requests_running", "Sequences being decoded",
                                value=s.running)
        yield GaugeMetricFamily("dflash_num_requests_waiting", "Sequences waiting for admission",
                                value=s.waiting)
        yield GaugeMetricFamily("dflash_kv_cache_usage_ratio", "Fraction of KV pages held (0..1)",
                                value=s.cache_usage)
        acc = s.acceptance
        yield CounterMetricFamily("dflash_spec_decode_rounds", "Verify rounds run",
                                  value=acc.rounds)
        yield CounterMetricFamily("dflash_spec_decode_committed_tokens",
                                  "Tokens committed by verify rounds", value=acc.tokens)
        cum, buckets = 0, []
        for le in ACCEPTANCE_BUCKETS:
            cum += acc.lengths.get(le, 0)
            buckets.append((floatToGoString(le), cum))
        yield HistogramMetricFamily(
            "dflash_acceptance_length", "Tokens committed per verify round (accepted drafts + 1)",
            buckets=[*buckets, ("+Inf", acc.rounds)], sum_value=acc.tokens)
        rate = GaugeMetricFamily("dflash_spec_decode_position_acceptance_rate",
                                 "Fraction of rounds whose draft at position i (1-based) was "
                                 "accepted", labels=["position"])
        for i, r in enumerate(acc.position_acceptance_rate, start=1):
            rate.add_metric([str(i)], r)
        yield rate
        if s.draft_time_per_round is not None:
            yield _histogram("dflash_draft_time_per_round_seconds",
                             "Wall time of one draft proposal, where the draft runs",
                             s.draft_time_per_round)
        if s.verify_time_per_round is not None:
            yield _histogram("dflash_verify_time_per_round_seconds",
                             "Wall time of one verify pass (forward, acceptance, commit) on TP "
                             "rank 0", s.verify_time_per_round)
