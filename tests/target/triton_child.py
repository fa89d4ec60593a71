"""The CPU half of the Triton kernel tests (test_moe_triton.py, test_attention_triton.py): their
cases run in Triton's interpreter in one child process, the test file run as a script with
TRITON_INTERPRET=1. It only takes effect if set before triton is first imported, and in a
whole-suite run torch._dynamo has imported triton during collection already; setting it in
the test process would also leak into every later test.

The children take minutes together in the interpreter, one core each. Once the session's tests
are collected, every selected test file that has its own child is queued (tests/conftest.py),
and CHILDREN of them run at a time at the lowest CPU priority while the tests go on: they take
the cores the tests leave idle (a Ray test waiting on its actors, a timeout), and a file's
results are usually ready by the time its tests run. A file whose tests come first waits for
its child, which then has the machine."""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _dot_by_element() -> None:
    """In the interpreter tl.dot is numpy's matmul, whose BLAS sums in an order set by the
    operands' shapes and the host CPU (a one-row product takes another kernel than a 16-row
    one), so a row's bits could change with the rows beside it, which a GPU's mma never does,
    and the bit-invariance tests would test the host's BLAS. The children's dot is computed in
    float64 and rounded once: each element from its own row and column, the same bits at any
    shape on any CPU (but for a float64 sum's rounding that lands on a float32 tie)."""
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    blas_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if not (a.dtype.is_floating() and b.dtype.is_floating()) or 8 in (
                a.dtype.primitive_bitwidth, b.dtype.primitive_bitwidth):
            return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.matmul(a.data.astype(np.float64), b.data.astype(np.float64))
        return interpreter.TensorHandle(product.astype(d.data.dtype) + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _dot_by_element()


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


# children running at once: one a core, and never more than 2 (the tests go on beside them)
CHILDREN = max(1, min(2, os.cpu_count() or 1))
CHILD_TIMEOUT = 600  # seconds a test waits for its file's child

_FILES: list[str] = []  # the test files with a child, as their modules were imported
_queue: list[str] = []  # files whose children wait for a free slot, in the session's order
_children: dict[str, tuple[subprocess.Popen, object, object]] = {}
_lock = threading.Lock()  # the queue is topped up from the tests and from a thread


def _start(test_file: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(["nice", "-n", "19", sys.executable, test_file], env=env, cwd=ROOT,
                            stdout=out, stderr=err, text=True)
    _children[test_file] = (proc, out, err)


def _top_up() -> None:
    with _lock:
        running = sum(proc.poll() is None for proc, *_ in _children.values())
        while _queue and running < CHILDREN:
            _start(_queue.pop(0))
            running += 1


def _keep_topped_up() -> None:
    while _queue:
        _top_up()
        time.sleep(1.0)


def queue_session(test_files: Sequence[str]) -> None:
    """Queues the children of the session's files (those of them with a child, in order) and
    keeps CHILDREN running until none is left; nothing on CUDA."""
    if torch.cuda.is_available():
        return
    with _lock:
        _queue.extend(path for path in test_files
                      if path in _FILES and path not in _children and path not in _queue)
    threading.Thread(target=_keep_topped_up, name="triton-children", daemon=True).start()


@atexit.register
def _stop_children() -> None:  # a session cut short leaves none running
    for proc, *_ in _children.values():
        if proc.poll() is None:
            proc.kill()


def run(test_file: str, session_files: Sequence[str] = ()) -> dict | None:
    """The JSON the test file prints as the interpreter child (its last line); None on CUDA,
    where the tests compute their own. `session_files`: the other files whose children the
    session will want, queued behind this one's if not started yet."""
    if torch.cuda.is_available():
        return None
    with _lock:
        for path in [test_file, *session_files]:
            if path not in _children and path not in _queue:
                _queue.append(path)
        if test_file in _queue:  # its tests wait on it: it goes first
            _queue.remove(test_file)
            _start(test_file)
    proc, out, err = _children[test_file]
    waited = time.monotonic()
    while proc.poll() is None:
        _top_up()
        if time.monotonic() - waited > CHILD_TIMEOUT:
            proc.kill()
            raise TimeoutError(f"{test_file}'s interpreter child ran {CHILD_TIMEOUT} s more")
        time.sleep(0.2)
    _top_up()
    out.seek(0), err.seek(0)
    assert proc.returncode == 0, err.read()[-4000:]
    return json.loads(out.read().splitlines()[-1])


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

    _FILES.append(str(Path(test_file).resolve()))

    @pytest.fixture(scope="module")
    def interpreted(request):
        selected = {str(item.path) for item in request.session.items}
        return run(str(Path(test_file).resolve()),
                   [path for path in _FILES if path in selected])

    @pytest.fixture(scope="module")
    def errors(interpreted):
        return error_lookup(interpreted, case_error)

    return interpreted, errors
