"""tools/gpu/env.sh's REQUIRE_GPU: a GPU check script stops before any work on the wrong
card (or none), and goes on where the card's name matches (nvidia-smi stubbed)."""

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def source(tmp_path, require: str | None, gpu_name: str | None) -> subprocess.CompletedProcess:
    """Sources the file in a shell run from tmp_path (no .whl there: no install), with a stub
    nvidia-smi naming gpu_name (None: no nvidia-smi on PATH), then prints 'went on'."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    stub = bin_dir / "nvidia-smi"
    stub.unlink(missing_ok=True)
    if gpu_name is not None:
        stub.write_text(f'#!/bin/sh\necho "{gpu_name}"\n')
        stub.chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "REQUIRE_GPU"}
    env["PATH"] = f"{bin_dir}:/usr/bin:/bin"
    if require is not None:
        env["REQUIRE_GPU"] = require
    return subprocess.run(["bash", "-c", f". {ROOT / 'tools/gpu/env.sh'}; echo went on"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=30)


def test_the_wrong_card_or_none_stops_before_any_work(tmp_path):
    for gpu in ("NVIDIA H100 80GB HBM3", None):
        run = source(tmp_path, "H200", gpu)
        assert run.returncode == 3 and "went on" not in run.stdout
        assert "REQUIRE_GPU=H200" in run.stderr


def test_the_named_card_or_no_requirement_goes_on(tmp_path):
    for require, gpu in (("H200", "NVIDIA H200"), (None, "NVIDIA H100 80GB HBM3")):
        run = source(tmp_path, require, gpu)
        assert run.returncode == 0 and run.stdout.strip() == "went on", run.stderr
