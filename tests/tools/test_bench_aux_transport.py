"""bench/aux_transport.py runs end to end on CPU, the pair transport (gloo) included, so it
cannot rot between GPU runs."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_bench_aux_transport_runs_every_transport_on_cpu(tmp_path):
    out = tmp_path / "aux.json"
    subprocess.run([sys.executable, "-m", "bench.aux_transport", "--device", "cpu",
                    "--pair-device", "cpu", "--rows", "4", "64", "--width", "32", "--iters", "3",
                    "--out", str(out)], cwd=ROOT, check=True, timeout=300, capture_output=True)
    res = json.loads(out.read_text())
    assert [r["rows"] for r in res["rows"]] == [4, 64]
    for row in res["rows"]:
        for transport in ("ring", "pickle", "pair"):
            assert row[transport]["median_us"] > 0, (row["rows"], transport)
