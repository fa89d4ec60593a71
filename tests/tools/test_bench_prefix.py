"""bench/prefix.py runs on the CPU over the demo pair: the conversation's turns with and
without the cache, the same prompts in both, hits from the second turn on, and each cached
turn prefilled in one step (its prompt's snapshot taken inside the chunk)."""

from __future__ import annotations

import json
from pathlib import Path

from bench import prefix

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"


def test_a_conversation_with_and_without_the_cache(tmp_path):
    out = prefix.main([
        "--model", str(DEMO / "target"), "--draft-model", str(DEMO / "draft"),
        "--device", "cpu", "--dtype", "float32", "--block-size", "4", "--page-size", "8",
        "--max-model-len", "160", "--max-num-seqs", "2", "--history-len", "40", "--turns", "3",
        "--turn-len", "10", "--output-len", "8", "--warmup-turns", "1",
        "--out", str(tmp_path / "p.json")])
    assert json.loads((tmp_path / "p.json").read_text()) == json.loads(json.dumps(out))
    on, off = out["on"]["turns"], out["off"]["turns"]
    assert [t["prompt_tokens"] for t in on] == [t["prompt_tokens"] for t in off] == [50, 68, 86]
    assert [t["cached_tokens"] for t in off] == [0, 0, 0]
    # each turn after the first resumes at the previous answer's last full page (pages of 8)
    assert [t["cached_tokens"] for t in on] == [0, 56, 72]
    assert all(len(t["prefill_steps"]) == 1 for t in on)
    # the warm-up's one turn (other tokens) is a miss; turns 2 and 3 hit
    assert out["on"]["prefix_cache"]["hits"] == 2 and out["off"]["prefix_cache"] is None
    assert [s["turn"] for s in out["summary"]] == [1, 2, 3]
    assert all(s["ttft_on_over_off"] > 0 and s["round_ms_on"] > 0 for s in out["summary"])
    assert out["command"].startswith("python -m bench.prefix --model")
