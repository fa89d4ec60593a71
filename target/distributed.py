"""Every collective the target model issues goes through this module.

Layers receive a `TPGroup` and call these functions inside their own forward, so reading a
layer's forward shows exactly where ranks communicate (two all-reduces per decoder layer, one
all-gather for the logits).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # torch.distributed ProcessGroup; None means the default group

    def shard(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {self.size}")
        return n // self.size


SINGLE = TPGroup()


def all_reduce(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size > 1:
        dist.all_reduce(x, group=tp.group)
    return x


def all_gather_last_dim(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    if tp.size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp.size)]
    dist.all_gather(parts, x.contiguous(), group=tp.group)
    return torch.cat(parts, dim=-1)
