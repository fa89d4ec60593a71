"""What an actor's weight load reports to the driver, which logs one line per actor (Ray folds
identical lines of different processes into "[repeated Nx]"; the driver's lines differ)."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LoadReport:
    who: str  # "target rank 0", "draft"
    host: str  # the node's IP (Ray's), else the host name
    gpu: str  # CUDA_VISIBLE_DEVICES of the actor ("cpu" off CUDA)
    weight_bytes: int  # this process's shard (and the draft's own embedding and head)
    seconds: float  # the load's wall time

    def line(self) -> str:
        gib, rate = self.weight_bytes / 2**30, self.weight_bytes / max(self.seconds, 1e-9) / 1e9
        size = f"{gib:.2f} GiB" if gib >= 0.1 else f"{self.weight_bytes / 2**20:.1f} MiB"
        where = "cpu" if self.gpu == "cpu" else f"GPU {self.gpu}"
        return (f"{self.who} on {self.host} ({where}): weights {size} in {self.seconds:.1f} s "
                f"({rate:.2f} GB/s)")


def weight_bytes(*modules: torch.nn.Module | None) -> int:
    """Parameters and buffers of `modules`, each tensor counted once."""
    seen, total = set(), 0
    for m in modules:
        if m is None:
            continue
        for t in (*m.parameters(), *m.buffers()):
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def load_report(who: str, device: torch.device, nbytes: int, seconds: float) -> LoadReport:
    try:
        import ray

        host = ray.util.get_node_ip_address()
    except Exception:
        host = socket.gethostname()
    gpu = os.environ.get("CUDA_VISIBLE_DEVICES", "?") if device.type == "cuda" else "cpu"
    return LoadReport(who, host, gpu, nbytes, seconds)
