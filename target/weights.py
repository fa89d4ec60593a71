"""Lazy views of checkpoint tensors, so each rank reads only the slice it owns."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Protocol

import torch
from safetensors import SafetensorError, safe_open


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
