"""The CPU half of the Triton kernel tests (test_moe_triton.py, test_attention_triton.py): their
cases run in Triton's interpreter in one child process, the test file run as a script with
TRITON_INTERPRET=1. It only takes effect if set before triton is first imported, and in a
whole-suite run torch._dynamo has imported triton during collection already; setting it in
the test process would also leak into every later test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def case_errors(cases, dtypes, case_error: Callable[[str, str, str], float | str],
                device: str) -> dict[str, float | str]:
    """"name/dtype" → case_error(name, dtype, device), or the text of what it raised (reported
    by the test of that case)."""
    out = {}
    for name in cases:
        for dtype in dtypes:
            try:
                out[f"{name}/{dtype}"] = case_error(name, dtype, device)
            except Exception as e:
                out[f"{name}/{dtype}"] = f"{type(e).__name__}: {e}"
    return out


def max_ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """The largest difference between two tensors of one floating dtype, in spacings of that
    dtype at the larger magnitude of each pair."""
    big = torch.maximum(got.abs(), want.abs()).float().clamp_min(1e-30)
    spacing = torch.exp2(torch.floor(torch.log2(big))) * torch.finfo(got.dtype).eps
    return ((got.float() - want.float()).abs() / spacing).max().item()


def run(test_file: str) -> dict | None:
    """The JSON the test file prints as the interpreter child (its last line); None on CUDA,
    where the tests compute their own."""
    if torch.cuda.is_available():
        return None
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, test_file], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.splitlines()[-1])


def error_lookup(interpreted: dict | None, case_error: Callable[[str, str, str], float | str]
                 ) -> Callable[[str], float | str]:
    """"name/dtype" → error: on CUDA computed on the spot, else the child's."""
    if interpreted is None:
        return lambda key: case_error(*key.split("/"), "cuda")
    return interpreted["errors"].__getitem__


def fixtures(test_file: str, case_error: Callable[[str, str, str], float | str]):
    """The module-scoped fixtures a Triton test file shares: `interpreted` (the interpreter
    child's results, None on CUDA) and `errors` ("name/dtype" → error, error_lookup). Bind
    both at module level: `interpreted, errors = triton_child.fixtures(__file__, case_error)`."""
    import pytest

    @pytest.fixture(scope="module")
    def interpreted():
        return run(test_file)

    @pytest.fixture(scope="module")
    def errors(interpreted):
        return error_lookup(interpreted, case_error)

    return interpreted, errors
