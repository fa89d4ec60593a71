"""Token bitmasks, the form every mask takes (xgrammar's): bit t % 32 of int32 word t // 32
allows token t. Built and edited on the host as numpy, applied on the device as bool rows."""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    """int32 words of a token bitmask over vocab_size tokens (bit t % 32 of word t // 32)."""
    return (vocab_size + 31) // 32


_SHIFTS: dict[torch.device, torch.Tensor] = {}


def pack_bits(allowed: np.ndarray) -> np.ndarray:
    """[N, V] bool → [N, words] int32 bitmask."""
    n, v = allowed.shape
    padded = np.zeros((n, bitmask_words(v) * 32), bool)
    padded[:, :v] = allowed
    return np.packbits(padded.reshape(n, -1, 32), axis=-1, bitorder="little") \
        .view(np.int32).reshape(n, -1)


def clear_bits(words: np.ndarray, tokens: list[int]) -> None:
    """Bans `tokens` in one row's bitmask [words] int32, in place."""
    for t in tokens:
        words[t // 32] &= np.int32(~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF)


def unpack_bits(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, words] int32 → [N, vocab_size] bool, on bitmask's device."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32,
                                                        device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
