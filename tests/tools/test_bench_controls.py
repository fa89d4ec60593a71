"""bench/controls.py runs on the CPU (the tiny target's config and tokenizer): each setting's
round is timed against the free baseline, its json rounds walk legal drafts, and the
acceptance mode reports τ with constrained and with free proposals."""

from __future__ import annotations

import json
from pathlib import Path

from bench import controls

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"


def test_round_costs_and_acceptance(tmp_path):
    args = controls.parser().parse_args([
        "--config", str(DEMO / "target" / "config.json"), "--tokenizer", str(DEMO / "target"),
        "--device", "cpu", "--dtype", "float32", "--batch-sizes", "2", "--block-size", "4",
        "--iters", "2", "--warmup", "1", "--prompt-len", "8", "--out", str(tmp_path / "c.json")])
    out = controls.run(args)
    assert json.loads((tmp_path / "c.json").read_text()) == out
    (row,) = out["runs"]
    assert row["batch"] == 2 and {"baseline", "json", "penalties"} <= set(row)
    assert all(len(row[k]["samples_ms"]) == 2 for k in ("baseline", "json", "penalties"))
    assert out["compile_ms"] > 0

    args = controls.parser().parse_args([
        "--acceptance", "--model", str(DEMO / "target"), "--draft-model", str(DEMO / "draft"),
        "--block-size", "4", "--device", "cpu", "--dtype", "float32", "--prompts", "1",
        "--max-tokens", "12"])
    tau = controls.acceptance(args)["tau"]
    assert set(tau) == {f"{g}_{m}_proposals" for g in ("json", "regex", "choice")
                        for m in ("constrained", "free")}
    assert all(t >= 1 for t in tau.values())
