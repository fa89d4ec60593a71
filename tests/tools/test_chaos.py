"""tools/chaos.py's runs, short, against a real `dflash-serve serve` (TP 2, CPU, the tiny
pair, an API key), one server for both: a short soak with cancellations and kills, then kills
(SIGKILL of the process) of a worker and of the raylet under load. What they check is
behaviour: every stream ends (its output, or an error event and [DONE]; never a cut
connection, but for the raylet's death, which takes the server with it), requests sent during
a recovery and after it succeed, /health comes back, and /dev/shm holds nothing of ours while
it serves and after it exited. The timings they report are docs/RELIABILITY.md's (the
full-length runs there), not asserted here."""

from __future__ import annotations

import pytest

from tools import chaos

pytestmark = pytest.mark.ray

FLAGS = ["--api-key", "chaos-key"]  # the server's, for every run on it


@pytest.fixture(scope="module")
def server():
    """The module's server, started on first use and again only if a run ended it (the kill
    run's raylet death does: it runs last)."""
    started: list[chaos.Server] = []

    def running() -> chaos.Server:
        if not started or started[-1].proc.poll() is not None:
            started.append(chaos.Server(chaos.parse_args(["soak", *FLAGS])))
        return started[-1]

    yield running
    for s in started:
        s.stop()


def test_a_short_soak_loses_nothing_and_leaves_nothing(server):
    """4 clients for 10 s (completions of at most 64 tokens, so that the ones in flight at the
    end finish soon), a worker killed 6 s in (one kill: the kill test below and the full run,
    docs/RELIABILITY.md, kill more)."""
    r = chaos.main_result(["soak", "--duration", "10", "--clients", "4", "--kill-every", "6",
                           "--max-tokens", "64", *FLAGS], server())
    assert r["requests"] > 0 and "cut" not in r["endings"], r["endings"]
    assert set(r["endings"]) <= {"finished", "cancelled", "error:engine_step_failed"}, r
    assert r["kills"] and all(k["health_back_s"] is not None for k in r["kills"])
    assert r["dev_shm_end"] == [], r  # the restarted engine unlinked what it created


def test_kills_under_load_end_every_stream_and_lose_nothing(server):
    """Also, on the same server: a second server on its port refuses to start; nothing but
    Serve's proxy answers beyond loopback (the replica's inter-deployment gRPC port, under
    Ray's token authentication, aside), Serve's own routes ask for the key; and the raylet's
    death ends the server: non-zero exit, port closed, no process left, nothing in /dev/shm.
    A worker is the actor killed here; the draft's and the driver's kills under a request are
    tests/deploy/test_serve_e2e.py's (the full run kills all three: docs/RELIABILITY.md)."""
    result = chaos.main_result(["kill", "--streams", "4", "--roles", "worker", *FLAGS],
                               server())
    second = result["second_server_on_the_port"]
    assert second["exit_code"] == 2 and "is in use" in second["message"], second
    beyond = result["listening_beyond_loopback"]
    assert all(s["process"].startswith("ray::ServeReplica") for s in beyond), beyond
    assert result["proxy_routes"] == {path: {"without_key": 401, "with_key": 200}
                                      for path in ("/-/routes", "/-/healthz")}
    for role in result["args"]["roles"]:
        r = result[role]
        assert set(r["in_flight"]) == {"error:engine_unavailable" if role == "driver"
                                       else "error:engine_step_failed"}, r
        assert r["health_back_s"] is not None, r
        assert r["sent_during_recovery"] == {"finished": 8}, r
        assert r["sent_after"] == {"finished": 4}, r
    raylet = result["raylet"]
    assert raylet["exit_code"] == 1 and "raylet" in raylet["message"], raylet
    assert raylet["port_closed_at_exit"] and raylet["processes_left"] == 0, raylet
    assert result["dev_shm_after_exit"] == []
