"""bench/engine.py --acceptance (bench/acceptance.py) on the CPU over the demo pair: plain
decoding against DFlash with replayed proposals, the same outputs, and every measured round
committing what the curve says."""

from __future__ import annotations

import json
from pathlib import Path

from bench import engine

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"


def test_plain_against_dflash_at_a_chosen_acceptance(tmp_path, capsys):
    engine.main([
        "--model", str(DEMO / "target"), "--draft-model", str(DEMO / "draft"),
        "--device", "cpu", "--dtype", "float32", "--acceptance", "[1, 1, 0]",
        "--batch-sizes", "1", "3", "--block-sizes", "4", "--prompt-len", "12",
        "--output-len", "20", "--page-size", "4", "--adaptive",
        "--out", str(tmp_path / "a.json")])
    out = json.loads((tmp_path / "a.json").read_text())
    assert out["command"].startswith("python -m bench.engine --model")
    assert [r["batch"] for r in out["batches"]] == [1, 3]
    for r in out["batches"]:
        assert r["same_outputs"]
        # 19 tokens after the prefill's: six rounds of 3, then one of 1
        assert r["rounds_dflash"] == 7 * r["batch"] and r["rounds_plain"] == 19 * r["batch"]
        assert r["acceptance_length_dflash"] == 19 / 7 and r["acceptance_length_plain"] == 1
        assert r["tokens_per_s_per_user_dflash"] > 0 and r["tokens_per_s_plain"] > 0
        assert r["speedup_per_user"] > 0 and r["adaptive_speedup_total"] > 0
        assert r["rounds_adaptive"] >= 7 * r["batch"]  # never more tokens a round than replay
    assert "| 3 |" in capsys.readouterr().out
