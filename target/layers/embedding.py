"""Vocab-parallel input embedding and output head: rank r owns vocab rows
[r·V/tp, (r+1)·V/tp) (V padded up to a multiple of tp; padding rows are zero)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from target.distributed import TPGroup, all_gather_last_dim, all_reduce
from target.weights import WeightSource, copy_into, expect_shape


class _VocabShard(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = -(-vocab_size // tp.size)
        self.start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.zeros(self.local_vocab, hidden_size, dtype=dtype), False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
        expect_shape(src, (self.vocab_size, param.shape[1]))
        end = min(self.start + self.local_vocab, self.vocab_size)
        param.data.zero_()
        if end > self.start:
            copy_into(param.data[: end - self.start], src.read(slice(self.start, end)), src)


class VocabParallelEmbedding(_VocabShard):
    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return all_reduce(out, self.tp)


class ParallelLMHead(_VocabShard):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = all_gather_last_dim(F.linear(hidden, self.weight), self.tp)  # [T, tp·V/tp]
        return logits[..., : self.vocab_size]
