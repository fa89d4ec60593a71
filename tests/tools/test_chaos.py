"""tools/chaos.py's runs, short, against a real `dflash-serve serve` (TP 2, CPU, the tiny
pair): kills (SIGKILL of the process) of a worker, the draft and the driver under load, and a
one-minute soak with cancellations and kills. What they check is behaviour: every stream ends
(its output, or an error event and [DONE]; never a cut connection), requests sent during a
recovery and after it succeed, /health comes back, and /dev/shm holds nothing of ours
afterwards. The timings they report are docs/RELIABILITY.md's (the full-length runs there),
not asserted here."""

from __future__ import annotations

import pytest

from tools import chaos

pytestmark = pytest.mark.ray


def test_kills_under_load_end_every_stream_and_lose_nothing():
    result = chaos.main_result(["kill", "--streams", "4"])
    for role in ("worker", "draft", "driver"):
        r = result[role]
        assert set(r["in_flight"]) == {"error:engine_unavailable" if role == "driver"
                                       else "error:engine_step_failed"}, r
        assert r["health_back_s"] is not None, r
        assert r["sent_during_recovery"] == {"finished": 8}, r
        assert r["sent_after"] == {"finished": 4}, r


def test_a_short_soak_loses_nothing_and_leaves_nothing():
    r = chaos.main_result(["soak", "--duration", "60", "--clients", "4", "--kill-every", "20"])
    assert r["requests"] > 0 and "cut" not in r["endings"], r["endings"]
    assert set(r["endings"]) <= {"finished", "cancelled", "error:engine_step_failed"}, r
    assert r["kills"] and all(k["health_back_s"] is not None for k in r["kills"])
    assert r["dev_shm_after_exit"] == []
