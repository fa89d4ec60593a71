"""tools/tp_check.py: TP 2 against TP 1 on dummy weights of the tiny preset (gloo, fp32)
agrees to summation order through prefill, verify, partial commit and verify, and the report
says so; the same tool runs the real 35B-A3B architecture on NCCL where GPUs are lent."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from tools.tp_check import compare

ROOT = Path(__file__).resolve().parents[2]


def test_tp2_equals_tp1_on_dummy_weights(tmp_path):
    out = tmp_path / "tp.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.tp_check", "--preset", "tiny", "--device", "cpu",
         "--dtype", "float32", "--tp", "2", "--prompt-lens", "9", "2", "30", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())["vs_tp1"]["2"]
    assert set(report) == {"prefill_last", "verify1", "verify2"}
    assert report["prefill_last"]["rows"] == 3 and report["verify1"]["rows"] == 3 * 16
    for r in report.values():
        assert r["max_rel_diff"] < 1e-5 and r["argmax_agree"] == 1.0, r


def test_compare_counts_disagreements_at_near_ties_only_there():
    want = {"x": torch.tensor([[10.0, 9.99, 0.0], [10.0, 2.0, 0.0]])}
    got = {"x": torch.tensor([[9.99, 10.0, 0.0], [2.0, 10.0, 0.0]])}  # both rows flip
    r = compare(got, want, tie_ulps=8)["x"]
    assert r["disagreeing_rows"] == 2 and r["near_tie_rows"] == 1 and r["argmax_agree"] == 0.0
