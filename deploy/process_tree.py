"""The processes below this one, for a command that starts its own Ray (`dflash-serve serve`):
it becomes their subreaper, so Ray's processes orphaned by a dying raylet (the HTTP proxy among
them, still holding the port) are re-parented to it rather than to PID 1, and it ends every one
of them before it exits. Linux only (prctl, /proc); elsewhere these are no-ops."""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import time
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def become_subreaper() -> bool:
    """Orphaned descendants are re-parented to this process from now on. False where the
    platform has no such thing."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (not `pid` itself), parents before children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def end_descendants(grace_s: float = 3.0) -> list[int]:
    """SIGTERM to every process below this one, SIGKILL to those still alive after `grace_s`;
    reaps the ones re-parented here. Returns the pids it signalled."""
    pids = descendants(os.getpid())
    for pid in pids:
        _signal(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        _reap()
        time.sleep(0.05)
    for pid in pids:
        if _alive(pid):
            _signal(pid, signal.SIGKILL)
    _reap()
    return pids


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _reap() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
