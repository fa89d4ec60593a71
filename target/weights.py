"""Lazy views of checkpoint tensors, so each rank reads only the slice it owns."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open

log = logging.getLogger(__name__)


class WeightSource(Protocol):
    name: str  # the checkpoint key, for error messages

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, *index: slice | int) -> torch.Tensor: ...


class TensorSource:
    def __init__(self, name: str, tensor: torch.Tensor):
        self.name = name
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, *index: slice | int) -> torch.Tensor:
        return self.tensor[index] if index else self.tensor


class SafetensorsSource:
    """A tensor inside an open safetensors file; `read` pulls only the requested slice."""

    def __init__(self, name: str, handle, key: str):
        self.name = name
        self._slice = handle.get_slice(key)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._slice.get_shape())

    def read(self, *index: slice | int) -> torch.Tensor:
        return self._slice[index] if index else self._slice[:]


def expect_shape(src: WeightSource, shape: tuple[int, ...]) -> None:
    if tuple(src.shape) != tuple(shape):
        raise ValueError(
            f"checkpoint tensor {src.name} has shape {list(src.shape)}, expected {list(shape)}"
        )


def copy_into(dst: torch.Tensor, value: torch.Tensor, src: WeightSource) -> None:
    if tuple(dst.shape) != tuple(value.shape):
        raise ValueError(
            f"checkpoint tensor {src.name}: slice of shape {list(value.shape)} does not fit "
            f"parameter shape {list(dst.shape)}"
        )
    dst.copy_(value.to(dst.dtype))


@contextmanager
def read_safetensors(path: str | Path, device: str = "cpu") -> Iterator:
    """safe_open(path), its failures (a truncated, zeroed or otherwise corrupt file, at the
    open or at a read) as a ValueError naming the file."""
    try:
        with safe_open(str(path), framework="pt", device=device) as handle:
            yield handle
    except SafetensorError as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e}); the checkpoint is "
                         f"incomplete or corrupt") from None


class ShardProgress:
    """Progress of a checkpoint's loading, by shard and bytes: a tqdm bar on a terminal,
    otherwise (Ray actors' logs) one line per shard; then one summary line."""

    def __init__(self, what: str, files: list[Path], where: str):
        self.what, self.files, self.where = what, files, where
        self.total = sum(f.stat().st_size for f in files)
        self.start = time.monotonic()
        self.bar = None
        if sys.stderr.isatty() and len(files) > 1:
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, unit="B", unit_scale=True, desc=f"loading {what}")

    def shard_done(self, i: int) -> None:
        size = self.files[i].stat().st_size
        if self.bar is not None:
            self.bar.update(size)
        elif len(self.files) > 1:
            log.info("loading %s: shard %d/%d (%s, %.2f GiB) after %.1f s", self.what, i + 1,
                     len(self.files), self.files[i].name, size / 2**30,
                     time.monotonic() - self.start)

    def finish(self) -> None:
        if self.bar is not None:
            self.bar.close()
        seconds = time.monotonic() - self.start
        log.info("loaded %s from %s: %d file(s), %.2f GiB in %.1f s (%.2f GiB/s), onto %s",
                 self.what, self.files[0].parent, len(self.files), self.total / 2**30, seconds,
                 self.total / 2**30 / max(seconds, 1e-9), self.where)
