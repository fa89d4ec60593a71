"""Prometheus metrics of one API server, in a registry of its own (never the global one, so
several apps or test servers in one process do not collide).

Request-side series are observed by the HTTP layer as requests end; engine-side series are
read from `EngineClient.snapshot()` at scrape time, so they cost nothing between scrapes.
Every series carries `model_name` (the served model's id). The speculative-decoding counters
mean what vLLM's of the same names do: drafts (rounds), draft tokens proposed, draft tokens
accepted, and accepted tokens per draft position.
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
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str):
        self.registry = r = CollectorRegistry()
        self.model_name = m = model_name
        self.requests = Counter("dflash_requests", "Requests finished, by finish reason",
                                ["model_name", "endpoint", "finish_reason"], registry=r)
        self.errors = Counter("dflash_request_errors", "Requests answered with an error",
                              ["model_name", "endpoint", "code"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens processed",
                                     ["model_name"], registry=r).labels(m)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated",
                                         ["model_name"], registry=r).labels(m)
        self.ttft = Histogram("dflash_time_to_first_token_seconds",
                              "From request arrival to the first generated token",
                              ["model_name"], buckets=LATENCY_BUCKETS, registry=r).labels(m)
        # A speculative round delivers a batch of k tokens after a gap dt: observed as k tokens
        # of dt/k each, so the mean is the per-token latency a streaming client sees.
        self.itl = Histogram("dflash_inter_token_latency_seconds",
                             "Time per generated token after the first", ["model_name"],
                             buckets=LATENCY_BUCKETS, registry=r).labels(m)
        self.e2e = Histogram("dflash_e2e_request_latency_seconds",
                             "From request arrival to its last token", ["model_name"],
                             buckets=LATENCY_BUCKETS, registry=r).labels(m)
        r.register(_EngineCollector(snapshot, m))

    def observe_request(self, endpoint: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int, timing: RequestTiming, now: float) -> None:
        self.requests.labels(self.model_name, endpoint, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        if timing.first_token is not None:
            self.ttft.observe(timing.first_token - timing.arrival)
        for gap, k in timing.token_batches:
            for _ in range(k):
                self.itl.observe(gap / k)
        self.e2e.observe((timing.finished or now) - timing.arrival)

    def observe_error(self, endpoint: str, status: int) -> None:
        self.errors.labels(self.model_name, endpoint, str(status)).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _histogram(name: str, doc: str, h: TimeHistogram, model: str) -> HistogramMetricFamily:
    buckets = [(floatToGoString(b), c) for b, c in zip(h.bounds, h.cumulative_counts,
                                                       strict=True)]
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], [*buckets, ("+Inf", h.count)], h.sum_s)
    return family


def _one(kind, name: str, doc: str, model: str, value: float) -> Metric:
    family = kind(name, doc, labels=["model_name"])
    family.add_metric([model], value)
    return family


class _EngineCollector:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str):
        self.snapshot, self.model = snapshot, model_name

    def collect(self) -> Iterator[Metric]:
        s, m = self.snapshot(), self.model
        yield _one(GaugeMetricFamily, "dflash_num_requests_running", "Sequences being decoded",
                   m, s.running)
        yield _one(GaugeMetricFamily, "dflash_num_requests_waiting",
                   "Sequences waiting for admission", m, s.waiting)
        yield _one(GaugeMetricFamily, "dflash_kv_cache_usage_ratio",
                   "Fraction of KV pages held (0..1)", m, s.cache_usage)
        ended = CounterMetricFamily(
            "dflash_engine_requests_finished", "Requests the engine ended, by how: stop, length, "
            "abort (the client left, or met a stop string), error", labels=["model_name",
                                                                            "finish_reason"])
        for how in ("stop", "length", "abort", "error"):
            ended.add_metric([m, how], s.finished.get(how, 0))
        yield ended
        acc = s.acceptance
        yield _one(CounterMetricFamily, "dflash_spec_decode_num_drafts",
                   "Draft proposals verified (one per sequence per round)", m, acc.rounds)
        yield _one(CounterMetricFamily, "dflash_spec_decode_num_draft_tokens",
                   "Tokens the draft proposed", m, acc.draft_tokens)
        yield _one(CounterMetricFamily, "dflash_spec_decode_num_accepted_tokens",
                   "Draft tokens the target accepted", m, acc.tokens - acc.rounds)
        per_pos = CounterMetricFamily("dflash_spec_decode_num_accepted_tokens_per_pos",
                                      "Draft tokens accepted at each position (0-based)",
                                      labels=["model_name", "position"])
        for i, n in enumerate(acc.accepted_at):
            per_pos.add_metric([m, str(i)], n)
        yield per_pos
        cum, buckets = 0, []
        for le in ACCEPTANCE_BUCKETS:
            cum += acc.lengths.get(le, 0)
            buckets.append((floatToGoString(le), cum))
        length = HistogramMetricFamily(
            "dflash_acceptance_length", "Tokens committed per verify round (accepted drafts + 1)",
            labels=["model_name"])
        length.add_metric([m], [*buckets, ("+Inf", acc.rounds)], acc.tokens)
        yield length
        if s.draft_time_per_round is not None:
            yield _histogram("dflash_draft_time_per_round_seconds",
                             "Wall time of one draft proposal, where the draft runs",
                             s.draft_time_per_round, m)
        if s.verify_time_per_round is not None:
            yield _histogram("dflash_verify_time_per_round_seconds",
                             "Wall time of one verify pass (forward, acceptance, commit) on TP "
                             "rank 0", s.verify_time_per_round, m)
