"""Tensor-parallel linear layers (the vLLM/nano-vllm split).

Each layer allocates only its own shard and owns a `weight_loader(param, src, shard_id)` that
reads its rows/columns out of the full checkpoint tensor `src` (a lazy `WeightSource`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from target.distributed import TPGroup, all_reduce
from target.weights import WeightSource, copy_into, expect_shape


class ReplicatedLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, dtype: torch.dtype):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype), False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
        expect_shape(src, tuple(param.shape))
        copy_into(param.data, src.read(), src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class ColumnParallelLinear(nn.Module):
    """Splits the output dim. `output_sizes` lists fused segments ([q, k, v], [gate, up]): each
    segment is split separately so a rank holds its part of every segment, in order.

    `num_shards`/`shard_rank` default to the TP group; attention's kv projections pass fewer
    shards when tp > num_kv_heads (ranks then hold replicated kv heads)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int],
        tp: TPGroup,
        dtype: torch.dtype,
        num_shards: int | None = None,
        shard_rank: int | None = None,
    ):
        super().__init__()
        self.num_shards = tp.size if num_shards is None else num_shards
        self.shard_rank = tp.rank if shard_rank is None else shard_rank
        for size in output_sizes:
            if size % self.num_shards:
                raise ValueError(f"output size {size} is not divisible by {self.num_shards} shards")
        self.in_features = in_features
        self.output_sizes = list(output_sizes)
        self.local_sizes = [s // self.num_shards for s in output_sizes]
        local_out = sum(self.local_sizes)
        self.weight = nn.Parameter(torch.empty(local_out, in_features, dtype=dtype), False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src: WeightSource,
                      shard_id: int | tuple[int, ...] | None = None):
        """`src` holds all segments (None), one (an int), or consecutive ones (a tuple: one
        checkpoint tensor feeding several segments, e.g. in_proj_qkv into [q, k, v, …])."""
        if shard_id is None:
            segments = tuple(range(len(self.output_sizes)))
        else:
            segments = shard_id if isinstance(shard_id, tuple) else (shard_id,)
        full = sum(self.output_sizes[i] for i in segments)
        expect_shape(src, (full, *param.shape[1:]))
        src_off = 0
        for i in segments:
            local = self.local_sizes[i]
            dst_off = sum(self.local_sizes[:i])
            start = src_off + self.shard_rank * local
            rows = src.read(slice(start, start + local))
            copy_into(param.data[dst_off : dst_off + local], rows, src)
            src_off += self.output_sizes[i]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class RowParallelLinear(nn.Module):
    """Splits the input dim; the partial products are summed across ranks (one all-reduce)
    unless `reduce=False`, when the caller fuses the reduction with another partial sum."""

    def __init__(self, in_features: int, out_features: int, tp: TPGroup, dtype: torch.dtype,
                 reduce: bool = True):
        super().__init__()
        self.tp = tp
        self.reduce = reduce
        self.in_local = tp.shard(in_features, "row-parallel input size")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_local, dtype=dtype), False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
        expect_shape(src, (param.shape[0], self.in_local * self.tp.size))
        start = self.tp.rank * self.in_local
        copy_into(param.data, src.read(slice(None), slice(start, start + self.in_local)), src)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return all_reduce(y, self.tp) if self.reduce else y


def load_sharded_1d(param: torch.Tensor, src: WeightSource, tp: TPGroup) -> None:
    """Per-head vectors (A_log, dt_bias) split contiguously like their heads."""
    local = param.shape[0]
    expect_shape(src, (local * tp.size,))
    copy_into(param.data, src.read(slice(tp.rank * local, (tp.rank + 1) * local)), src)


def stack_rows(layers: list[nn.Module], align: int = 8) -> tuple[torch.Tensor, list[int]]:
    """One [Σ out (rounded up to `align`), in] tensor whose row blocks become the layers'
    weights (views, each keeping its own weight_loader), so the layers that read the same
    input can also run as one GEMM; and each layer's row count. The rows past Σ out are zero
    and their outputs unused: they keep the GEMM's output rows 16-byte aligned in bf16 (an odd
    width, 1,281 for the MoE's router + shared expert + its gate, leaves cuBLAS only kernels
    that read the weight at a fraction of the bandwidth). The weights' values are not kept:
    call before loading."""
    sizes = [layer.weight.shape[0] for layer in layers]
    first = layers[0].weight
    rows = -(-sum(sizes) // align) * align
    stacked = torch.zeros(rows, first.shape[1], dtype=first.dtype, device=first.device)
    for layer, part in zip(layers, stacked[: sum(sizes)].split(sizes), strict=True):
        loader = layer.weight.weight_loader
        layer.weight = nn.Parameter(part, requires_grad=False)
        layer.weight.weight_loader = loader
    return stacked, sizes


def stacked_linear(x: torch.Tensor, stacked: torch.Tensor, rows: int,
                   align: int = 8) -> torch.Tensor:
    """x through the first `rows` rows of stack_rows' tensor: [T, rows], the padding's
    outputs dropped. One token (a decode at batch 1) multiplies by exactly those rows, a view
    that cuBLAS runs as a GEMV (4.5 µs on the H200 for the 35B's 1,281 rows, against 6.8
    padded); more tokens by the rows up to a multiple of `align` (the zero padding, or the
    next part's first rows when `rows` ends inside the stack), which keeps them off a slow
    kernel (5.9 µs against 12.1 at 16 tokens)."""
    padded = -(-rows // align) * align
    weight = stacked[:rows] if x.shape[0] == 1 else stacked[:padded]
    return F.linear(x, weight)[:, :rows]

