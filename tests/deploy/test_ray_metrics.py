"""/metrics' series in Ray's metrics export (deploy/ray_metrics.py), read where Prometheus reads
them: each node's metrics agent (ray.nodes()' MetricsExportPort, the targets of Ray's service-
discovery file). A registry copied by hand reaches it sample for sample, a reset counter keeps
counting; two Serve replicas add up to the requests sent, told apart by their `replica` label,
under the names of /metrics with `ray_` in front, the dashboard's included."""

from __future__ import annotations

import json
import re
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx2 as httpx
import pytest
import ray
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from ray import serve

from cluster.engine import AcceptanceStats
from cluster.stats import TimeAccumulator
from deploy.app import ServeArgs, build_deployment
from deploy.engine_client import EngineSnapshot, RequestTiming
from deploy.metrics import ServingMetrics
from deploy.ray_metrics import RayMetricsExport

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "tests" / "assets" / "tiny"
pytestmark = pytest.mark.ray

# Labels Ray adds to every series (OpenTelemetry's scope labels aside), and Serve's.
RAY_LABELS = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId"}
SERVE_LABELS = {"deployment", "replica", "application"}
Samples = dict[tuple[str, tuple], float]  # (sample name, sorted label pairs) → value


def ray_export(model: str, keep: set[str] = frozenset()) -> Samples:
    """The samples of `model` on every node's metrics endpoint; labels Ray or Serve add are
    left out of the keys, but those in `keep`."""
    samples: Samples = {}
    for node in ray.nodes():
        if not node["Alive"]:
            continue
        url = f"http://{node['NodeManagerAddress']}:{node['MetricsExportPort']}/metrics"
        for family in text_string_to_metric_families(httpx.get(url, timeout=30).text):
            for s in family.samples:
                if s.labels.get("model_name") != model:
                    continue
                labels = tuple(sorted((k, v) for k, v in s.labels.items() if k in keep or (
                    k not in RAY_LABELS | SERVE_LABELS and not k.startswith("otel_scope"))))
                assert (s.name, labels) not in samples, (s.name, labels)  # keep tells apart
                samples[(s.name, labels)] = s.value
    return samples


def wait_for(read: Callable[[], Samples], done: Callable[[Samples], bool],
             timeout: float = 120.0) -> Samples:
    """Ray's workers pass their metrics to the agent every 10 s: reads until `done`."""
    deadline = time.monotonic() + timeout
    while True:
        samples = read()
        if done(samples):
            return samples
        assert time.monotonic() < deadline, f"Ray's export never got there: {samples}"
        time.sleep(1.0)


def local(metrics: ServingMetrics) -> Samples:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples
            if not s.name.endswith("_created") and ":" not in s.name}  # vllm: twins stay out


def snapshot(accepted: list[int], seconds: list[float]) -> EngineSnapshot:
    """An engine that verified one round per entry of `accepted` (drafts accepted, of 7)."""
    acceptance, draft, verify = AcceptanceStats(), TimeAccumulator(), TimeAccumulator()
    for n, s in zip(accepted, seconds, strict=True):
        acceptance.record(n, 7)
        draft.observe(s)
        verify.observe(2 * s)
    return EngineSnapshot(running=len(accepted) % 3, waiting=1, cache_usage=0.25,
                          acceptance=acceptance, draft_time_per_round=draft.snapshot(),
                          verify_time_per_round=verify.snapshot())


def timing(first: float, gaps: list[tuple[float, int]]) -> RequestTiming:
    t = RequestTiming(arrival=0.0, first_token=first, token_batches=gaps)
    t.finished = first + sum(g for g, _ in gaps)
    return t


def test_a_registry_reaches_rays_export_sample_for_sample_and_reset_counters_keep_counting(
        ray_cluster):
    model = "copied-by-hand"
    engine = {"now": snapshot([7, 3, 0, 5], [0.004, 0.006, 0.03, 0.2])}
    metrics = ServingMetrics(lambda: engine["now"], model)
    metrics.observe_request("completions", "length", 12, 9, timing(0.05, [(0.02, 1), (0.3, 7)]),
                            now=1.0)

    async def refresh() -> None:
        pass

    export = RayMetricsExport(metrics.registry, refresh)
    export.push()
    before = local(metrics)
    engine["now"] = snapshot([1, 2], [0.01, 0.5])  # a new engine driver: its counts restart
    metrics.observe_request("chat.completions", "stop", 30, 2, timing(0.5, [(0.1, 1)]), now=2.0)
    metrics.observe_error("completions", 400)
    export.push()
    after = local(metrics)

    want = {}
    for key, value in after.items():
        if key[0].endswith("_total"):  # a counter: what it gained, counting from 0 at a reset
            was = before.get(key, 0.0)
            value = was + value if value < was else value
            if value == 0:
                continue  # Ray's counters have no series until they first increase
        want[("ray_" + key[0], key[1])] = value
    reset = ("ray_dflash_spec_decode_num_drafts_total", (("model_name", model),))
    assert want[reset] == 4 + 2 and after[reset[0][4:], reset[1]] == 2
    assert ("ray_dflash_inter_token_latency_seconds_bucket",
            (("le", "0.04"), ("model_name", model))) in want
    got = wait_for(lambda: ray_export(model), lambda got: got == pytest.approx(want))
    assert got == pytest.approx(want)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


MODEL = "tiny-two-replicas"


@pytest.fixture(scope="module")
def two_replicas(ray_cluster):
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = ServeArgs(model=str(DEMO / "target"), draft_model=str(DEMO / "draft"), device="cpu",
                     speculative_dflash_block_size=8, served_model_name=MODEL, max_num_seqs=8,
                     page_size=8)
    serve.run(build_deployment(args, num_replicas=2), name="ray-metrics", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()


def test_two_replicas_add_up_in_rays_export(two_replicas):
    url, n, max_tokens = two_replicas, 8, 6
    body = {"model": MODEL, "prompt": "Totals across replicas", "max_tokens": max_tokens,
            "temperature": 0.0, "ignore_eos": True}
    with ThreadPoolExecutor(n) as pool:  # at once, so that both replicas get some
        codes = list(pool.map(lambda _: httpx.post(f"{url}/v1/completions", json=body,
                                                   timeout=300).status_code, range(n)))
    assert codes == [200] * n
    assert httpx.post(f"{url}/v1/completions", json={"prompt": ""}).status_code == 400

    def total(samples: Samples, name: str) -> float:
        return sum(v for (s, _), v in samples.items() if s == name)

    def arrived(samples: Samples) -> bool:
        return (total(samples, "ray_dflash_requests_total") == n
                and total(samples, "ray_dflash_generation_tokens_total") == n * max_tokens
                and total(samples, "ray_dflash_request_errors_total") == 1
                and len(replicas(samples)) == 2)

    def replicas(samples: Samples) -> set[str]:  # every replica sets its gauges, idle or not
        return {dict(labels)["replica"] for (s, labels), _ in samples.items()
                if s == "ray_dflash_num_requests_running"}

    got = wait_for(lambda: ray_export(MODEL, keep={"replica"}), arrived)
    per_replica = {r: total({k: v for k, v in got.items() if ("replica", r) in k[1]},
                            "ray_dflash_requests_total") for r in replicas(got)}
    assert sum(per_replica.values()) == n, per_replica
    assert total(got, "ray_dflash_e2e_request_latency_seconds_count") == n
    print("requests per replica:", per_replica)

    # the names of /metrics (one replica's, through the proxy), ray_ in front; a counter
    # reaches Ray's export once it has counted something (no eviction happened here)
    text = httpx.get(f"{url}/metrics", timeout=30).text
    served = {s.name for family in text_string_to_metric_families(text) for s in family.samples
              if not s.name.endswith("_created") and ":" not in s.name  # vllm: twins stay out
              and (family.type != "counter" or s.value > 0)}
    exported = {name for name, _ in got}
    assert {"ray_" + name for name in served} <= exported, served - exported
    assert {name for name in exported if not name.startswith("ray_dflash_")} == set()

    # the dashboard with its series picked from Ray's export
    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    prefix = next(v for v in dash["templating"]["list"] if v["name"] == "prefix")
    assert {o["value"] for o in prefix["options"]} == {"dflash_", "ray_dflash_"}
    exprs = [t["expr"].replace("${prefix}", "ray_dflash_") for p in dash["panels"]
             for t in p["targets"]]
    named = {m for e in exprs for m in re.findall(r"ray_dflash_[a-z0-9_]+", e)}
    assert named and named <= exported, named - exported
