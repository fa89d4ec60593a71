"""tools/chaos.py's runs, short, against a real `dflash-serve serve` (TP 2, CPU, the tiny
pair): kills (SIGKILL of the process) of a worker, the draft, the driver and the raylet under
load, and a short soak with cancellations and kills. What they check is behaviour: every
stream ends (its output, or an error event and [DONE]; never a cut connection, but for the
raylet's death, which takes the server with it), requests sent during a recovery and after it
succeed, /health comes back, and /dev/shm holds nothing of ours afterwards. The timings they
report are docs/RELIABILITY.md's (the full-length runs there), not asserted here."""

from __future__ import annotations

import pytest

from tools import chaos

pytestmark = pytest.mark.ray


def test_kills_under_load_end_every_stream_and_lose_nothing():
    """Also, on the same server (run with an API key): a second server on its port refuses to
    start; nothing but Serve's proxy answers beyond loopback (the replica's inter-deployment
    gRPC port, under Ray's token authentication, aside), Serve's own routes ask for the key;
    and the raylet's death ends the server: non-zero exit, port closed, no process left. A
    worker is the actor killed here; the draft's and the driver's kills under a request are
    tests/deploy/test_serve_e2e.py's (the full run kills all three: docs/RELIABILITY.md)."""
    result = chaos.main_result(["kill", "--streams", "4", "--roles", "worker",
                                "--api-key", "chaos-key"])
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


def test_a_short_soak_loses_nothing_and_leaves_nothing():
    r = chaos.main_result(["soak", "--duration", "20", "--clients", "4", "--kill-every", "6"])
    assert r["requests"] > 0 and "cut" not in r["endings"], r["endings"]
    assert set(r["endings"]) <= {"finished", "cancelled", "error:engine_step_failed"}, r
    assert r["kills"] and all(k["health_back_s"] is not None for k in r["kills"])
    assert r["dev_shm_after_exit"] == []
