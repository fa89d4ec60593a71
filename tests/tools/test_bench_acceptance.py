"""bench/engine.py --acceptance (bench/acceptance.py) on the CPU over the demo pair: plain
decoding against DFlash with replayed proposals, the same outputs, and every measured round
committing what the curve says."""

from __future__ import annotations

import json
from pathlib import Path

from bench import engine

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"


def test_plain_against_dflash_at_chosen_acceptances(tmp_path, capsys):
    engine.main([
        "--model", str(DEMO / "target"), "--draft-model", str(DEMO / "draft"),
        "--device", "cpu", "--dtype", "float32", "--acceptance", "[1, 1, 0]", "1",
        "--batch-sizes", "1", "3", "--block-sizes", "4", "--prompt-len", "12",
        "--output-len", "20", "--page-size", "4", "--adaptive",
        "--out", str(tmp_path / "a.json")])
    out = json.loads((tmp_path / "a.json").read_text())
    assert out["command"].startswith("python -m bench.engine --model")
    assert [(r["acceptance"], r["batch"]) for r in out["rows"]] == [
        ("[1, 1, 0]", 1), ("[1, 1, 0]", 3), ("1", 1), ("1", 3)]
    for r in out["rows"]:
        assert r["same_outputs"] and r["rounds_plain"] == 19 * r["batch"]
        assert r["acceptance_length_plain"] == 1
        # 19 tokens after the prefill's: six rounds of 3 and one of 1 at [1, 1, 0]; one a
        # round at τ = 1
        per_request = 7 if r["acceptance"] == "[1, 1, 0]" else 19
        assert r["rounds_dflash"] == per_request * r["batch"]
        assert r["acceptance_length_dflash"] == 19 / per_request
        assert r["rounds_adaptive"] >= per_request * r["batch"]  # never more than replay
        assert r["tokens_per_s_per_user_dflash"] > 0 and r["speedup_total_adaptive"] > 0
    assert "| [1, 1, 0] | 3 |" in capsys.readouterr().out
