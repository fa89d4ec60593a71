"""What one target forward consumes: a flat varlen batch plus the cache tensors it reads/writes."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # [T] long, sequences concatenated
    positions: torch.Tensor  # [T] long, absolute token positions
    query_lens: list[int]  # [S] tokens of each sequence in this forward
    seq_lens: list[int] | None  # [S] context length after this forward (cached + new)
    slot_mapping: torch.Tensor  # [T] long, KV-cache slot of each new token
    block_tables: torch.Tensor  # [S, max_pages] int32, page ids of each sequence
    state_slots: list[int] | None  # [S] Gated DeltaNet state slot of each sequence
    # Verify sequences leave their committed GDN state untouched and journal the block instead;
    # `commit_verify` replays the accepted prefix. Others (prefill) advance their state in place.
    is_verify: list[bool]
    aux_layer_ids: tuple[int, ...] = ()  # residual stream after these layers is returned
    # Device copies of seq_lens and state_slots [S] long, for kernels that must not read host
    # lists (batched rounds; CUDA-graph capture). Built from the lists when not given. A
    # captured round (workers/cuda_graphs.py) has only these: its lists are None.
    seq_lens_t: torch.Tensor | None = None
    state_slots_t: torch.Tensor | None = None
    # Prefill: sequence index → (snapshot slot, n): the GDN layers also leave the sequence's
    # state after the first n tokens of its chunk in that slot (the prefix cache's snapshot).
    snapshots: dict[int, tuple[int, int]] = field(default_factory=dict)
    # Filled by the forward: per GDN layer, per verify sequence, what replay needs.
    journal: dict[int, list] = field(default_factory=dict)
    # Built once per forward by the first attention layer, shared by the others (the
    # FlexAttention BlockMask of a round).
    attn_meta: dict[str, object] = field(default_factory=dict)

    def __post_init__(self) -> None:
        dev = self.input_ids.device
        if self.seq_lens_t is None:
            self.seq_lens_t = torch.tensor(self.seq_lens, dtype=torch.long, device=dev)
        if self.state_slots_t is None:
            self.state_slots_t = torch.tensor(self.state_slots, dtype=torch.long, device=dev)

    @property
    def num_seqs(self) -> int:
        return len(self.query_lens)

    @property
    def cu_seqlens(self) -> list[int]:
        out = [0]
        for n in self.query_lens:
            out.append(out[-1] + n)
        return out


@dataclass
class TargetCaches:
    # full-attention layer -> (k_cache, v_cache),
    # each [num_pages, page_size, kv_heads_local, head_dim]
    kv: dict[int, tuple[torch.Tensor, torch.Tensor]]
    # GDN layer -> conv state [num_slots, conv_dim_local, kernel-1] (the last pre-conv inputs)
    conv: dict[int, torch.Tensor]
    # GDN layer -> recurrent state [num_slots, value_heads_local, key_dim, value_dim], fp32
    ssm: dict[int, torch.Tensor]

    @property
    def page_size(self) -> int:
        k_cache, _ = next(iter(self.kv.values()))
        return k_cache.shape[1]
