"""Prometheus metrics of one API server, in a registry of its own (never the global one, so
several apps or test servers in one process do not collide).

Request-side series are observed by the HTTP layer as requests end; engine-side series are
read from `EngineClient.snapshot()` at scrape time, so they cost nothing between scrapes.
Every series carries `model_name` (the served model's id). The speculative-decoding counters
mean what vLLM's of the same names do: drafts (rounds), draft tokens proposed, draft tokens
accepted, and accepted tokens per draft position.

Each series whose meaning matches one of vLLM's (V1 engine, `vllm/v1/metrics/loggers.py`) is
also served under vLLM's name (VLLM_NAMES), so dashboards and alerts written for vLLM read it:
the twin is a renamed copy made at scrape time from the same family, so the two never differ.
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

from cluster.prefix_cache import PrefixCacheSnapshot
from cluster.stats import TimeHistogram
from deploy.engine_client import EngineSnapshot, RequestTiming

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5,
                   0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0)
ACCEPTANCE_BUCKETS = tuple(range(1, 17))  # tokens committed per round; longer ones land in +Inf
TOKEN_BUCKETS = tuple(m * 10**e for e in range(6) for m in (1, 2, 5))  # vLLM's 1-2-5 series

# Our family -> the vLLM names it is also served under (same values, same labels). Only names
# whose meaning is ours; docs/DEPLOYMENT.md lists vLLM's others and why they are left out.
VLLM_NAMES: dict[str, tuple[str, ...]] = {
    "dflash_num_requests_running": ("vllm:num_requests_running",),
    "dflash_num_requests_waiting": ("vllm:num_requests_waiting",),
    # vLLM's "perc" is a fraction 0..1 too; gpu_cache_usage_perc is its older name
    "dflash_kv_cache_usage_ratio": ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    "dflash_prompt_tokens": ("vllm:prompt_tokens",),
    "dflash_generation_tokens": ("vllm:generation_tokens",),
    "dflash_time_to_first_token_seconds": ("vllm:time_to_first_token_seconds",),
    "dflash_e2e_request_latency_seconds": ("vllm:e2e_request_latency_seconds",),
    # per token (see ServingMetrics.itl); vLLM observes once per engine step, the same thing
    # without speculative decoding. time_per_output_token_seconds is its older name.
    "dflash_inter_token_latency_seconds": ("vllm:inter_token_latency_seconds",
                                           "vllm:time_per_output_token_seconds"),
    "dflash_request_prompt_tokens": ("vllm:request_prompt_tokens",),
    "dflash_request_generation_tokens": ("vllm:request_generation_tokens",),
    # vLLM counts prompt tokens looked up and hit (prefix_cache_queries/hits); its V0 engine's
    # hit-rate gauge had the older name
    "dflash_prefix_cache_queries": ("vllm:prefix_cache_queries",),
    "dflash_prefix_cache_hits": ("vllm:prefix_cache_hits",),
    "dflash_prefix_cache_hit_rate": ("vllm:gpu_prefix_cache_hit_rate",),
    "dflash_spec_decode_num_drafts": ("vllm:spec_decode_num_drafts",),
    "dflash_spec_decode_num_draft_tokens": ("vllm:spec_decode_num_draft_tokens",),
    "dflash_spec_decode_num_accepted_tokens": ("vllm:spec_decode_num_accepted_tokens",),
    "dflash_spec_decode_num_accepted_tokens_per_pos": (
        "vllm:spec_decode_num_accepted_tokens_per_pos",),
}


class ServingMetrics:
    def __init__(self, snapshot: Callable[[], EngineSnapshot], model_name: str):
        self.registry = CollectorRegistry()
        self.model_name = m = model_name
        # registry=None: _WithVllmNames collects them, with their vLLM twins
        self.requests = Counter("dflash_requests", "Requests finished, by finish reason",
                                ["model_name", "endpoint", "finish_reason"], registry=None)
        self.errors = Counter("dflash_request_errors", "Requests answered with an error",
                              ["model_name", "endpoint", "code"], registry=None)
        prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens processed",
                                ["model_name"], registry=None)
        generation_tokens = Counter("dflash_generation_tokens", "Tokens generated",
                                    ["model_name"], registry=None)
        ttft = Histogram("dflash_time_to_first_token_seconds",
                         "From request arrival to the first generated token",
                         ["model_name"], buckets=LATENCY_BUCKETS, registry=None)
        # A speculative round delivers a batch of k tokens after a gap dt: observed as k tokens
        # of dt/k each, so the mean is the per-token latency a streaming client sees.
        itl = Histogram("dflash_inter_token_latency_seconds",
                        "Time per generated token after the first", ["model_name"],
                        buckets=LATENCY_BUCKETS, registry=None)
        e2e = Histogram("dflash_e2e_request_latency_seconds",
                        "From request arrival to its last token", ["model_name"],
                        buckets=LATENCY_BUCKETS, registry=None)
        request_prompt = Histogram("dflash_request_prompt_tokens", "Prompt tokens per request",
                                   ["model_name"], buckets=TOKEN_BUCKETS, registry=None)
        request_generation = Histogram("dflash_request_generation_tokens",
                                       "Tokens generated per request", ["model_name"],
                                       buckets=TOKEN_BUCKETS, registry=None)
        sources = [self.requests, self.errors, prompt_tokens, generation_tokens, ttft, itl, e2e,
                   request_prompt, request_generation, _EngineCollector(snapshot, m)]
        self.registry.register(_WithVllmNames(sources, m))
        self.prompt_tokens, self.generation_tokens = (prompt_tokens.labels(m),
                                                      generation_tokens.labels(m))
        self.ttft, self.itl, self.e2e = ttft.labels(m), itl.labels(m), e2e.labels(m)
        self.request_prompt_tokens = request_prompt.labels(m)
        self.request_generation_tokens = request_generation.labels(m)

    def observe_request(self, endpoint: str, finish_reason: str, prompt_tokens: int,
                        completion_tokens: int, timing: RequestTiming, now: float) -> None:
        self.requests.labels(self.model_name, endpoint, finish_reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.generation_tokens.inc(completion_tokens)
        self.request_prompt_tokens.observe(prompt_tokens)
        self.request_generation_tokens.observe(completion_tokens)
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


class _WithVllmNames:
    """The families of `sources`, each followed by its twins under vLLM's names."""

    def __init__(self, sources: list, model_name: str):
        self.sources, self.model = sources, model_name

    def collect(self) -> Iterator[Metric]:
        for source in self.sources:
            for family in source.collect():
                yield family
                for name in VLLM_NAMES.get(family.name, ()):
                    yield _renamed(family, name)
                if family.name == "dflash_requests":
                    yield _request_success(family)
        # Admission waits until every page a sequence can reach is free (cluster/scheduler.py),
        # so the engine never preempts: vLLM's alert on preemptions reads a true 0.
        yield _one(CounterMetricFamily, "vllm:num_preemptions",
                   "Requests preempted by the engine (never, here)", self.model, 0)


def _renamed(family: Metric, name: str) -> Metric:
    twin = Metric(name, family.documentation, family.type)
    for s in family.samples:
        if not s.name.endswith("_created"):
            twin.add_sample(name + s.name.removeprefix(family.name), s.labels, s.value)
    return twin


def _request_success(requests: Metric) -> Metric:
    """vLLM's request_success{finished_reason}: dflash_requests summed over endpoints."""
    by_reason: dict[tuple[str, str], float] = {}
    for s in requests.samples:
        if s.name.endswith("_total"):
            key = (s.labels["model_name"], s.labels["finish_reason"])
            by_reason[key] = by_reason.get(key, 0.0) + s.value
    family = CounterMetricFamily("vllm:request_success", "Requests finished, by finish reason",
                                 labels=["model_name", "finished_reason"])
    for labels, n in sorted(by_reason.items()):
        family.add_metric(list(labels), n)
    return family


def _histogram(name: str, doc: str, h: TimeHistogram, model: str) -> HistogramMetricFamily:
    buckets = [(floatToGoString(b), c) for b, c in zip(h.bounds, h.cumulative_counts,
                                                       strict=True)]
    family = HistogramMetricFamily(name, doc, labels=["model_name"])
    family.add_metric([model], [*buckets, ("+Inf", h.count)], h.sum_s)
    return family


def _prefix_cache(p: PrefixCacheSnapshot, m: str) -> Iterator[Metric]:
    yield _one(CounterMetricFamily, "dflash_prefix_cache_queries",
               "Prompt tokens looked up in the prefix cache", m, p.query_tokens)
    yield _one(CounterMetricFamily, "dflash_prefix_cache_hits",
               "Prompt tokens served from the prefix cache (not prefilled)", m, p.hit_tokens)
    yield _one(CounterMetricFamily, "dflash_prefix_cache_query_requests",
               "Prompts looked up in the prefix cache", m, p.queries)
    yield _one(CounterMetricFamily, "dflash_prefix_cache_hit_requests",
               "Prompts that hit the prefix cache", m, p.hits)
    yield _one(GaugeMetricFamily, "dflash_prefix_cache_hit_rate",
               "Prompt tokens served from the prefix cache / prompt tokens looked up (0..1)",
               m, p.hit_tokens / p.query_tokens if p.query_tokens else 0.0)
    yield _one(GaugeMetricFamily, "dflash_prefix_cache_pages",
               "KV pages the prefix cache holds, in use or evictable", m, p.cached_pages)
    yield _one(GaugeMetricFamily, "dflash_prefix_cache_snapshots",
               "Gated DeltaNet state snapshots held", m, p.snapshots)
    yield _one(GaugeMetricFamily, "dflash_prefix_cache_snapshot_slots",
               "Snapshot pool size", m, p.snapshot_slots)
    yield _one(GaugeMetricFamily, "dflash_prefix_cache_boundary_slots",
               "Snapshot slots lent to decoding sequences (each becomes the snapshot of its "
               "answer's last full page when it ends)", m, p.boundary_slots)
    yield _one(GaugeMetricFamily, "dflash_prefix_cache_snapshot_bytes",
               "Memory the held snapshots take on a TP-1 rank", m,
               p.snapshots * p.snapshot_bytes)
    evictions = CounterMetricFamily("dflash_prefix_cache_evictions",
                                    "Cached pages and snapshots evicted, by kind",
                                    labels=["model_name", "kind"])
    evictions.add_metric([m, "page"], p.page_evictions)
    evictions.add_metric([m, "snapshot"], p.snapshot_evictions)
    yield evictions


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
        chosen = CounterMetricFamily(
            "dflash_spec_decode_rounds_by_draft_length", "Verify rounds (one per sequence per "
            "round) by their drafts: B - 1 with a fixed block, or the adaptive rule's pick (0: "
            "a plain decode step)", labels=["model_name", "drafts"])
        for k, n in sorted(acc.draft_lengths.items()):
            chosen.add_metric([m, str(k)], n)
        yield chosen
        cum, buckets = 0, []
        for le in ACCEPTANCE_BUCKETS:
            cum += acc.lengths.get(le, 0)
            buckets.append((floatToGoString(le), cum))
        length = HistogramMetricFamily(
            "dflash_acceptance_length", "Tokens committed per verify round (accepted drafts + 1)",
            labels=["model_name"])
        length.add_metric([m], [*buckets, ("+Inf", acc.rounds)], acc.tokens)
        yield length
        if s.prefix_cache is not None:
            yield from _prefix_cache(s.prefix_cache, m)
        if s.draft_time_per_round is not None:
            yield _histogram("dflash_draft_time_per_round_seconds",
                             "Wall time of one draft proposal, where the draft runs",
                             s.draft_time_per_round, m)
        if s.step_time:
            steps = HistogramMetricFamily(
                "dflash_engine_step_seconds", "Wall time of one engine step as the driver sees "
                "it, by kind (round, prefill): from its submission to its result applied",
                labels=["model_name", "kind"])
            for kind, h in sorted(s.step_time.items()):
                steps.add_metric([m, kind], [*((floatToGoString(b), c) for b, c in zip(
                    h.bounds, h.cumulative_counts, strict=True)), ("+Inf", h.count)], h.sum_s)
            yield steps
        if s.verify_time_per_round is not None:
            yield _histogram("dflash_verify_time_per_round_seconds",
                             "Wall time of one verify pass (forward, acceptance, commit) on TP "
                             "rank 0", s.verify_time_per_round, m)
