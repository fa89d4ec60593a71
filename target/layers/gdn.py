"""Gated DeltaNet (Qwen3.5's linear-attention mixer), tensor-parallel over heads.

Prefill sequences advance their conv/recurrent state in place, and where the prefix cache
asks (ForwardBatch.snapshots) leave a copy of it after a given token of their chunk in a
snapshot slot: at the chunk's end, or inside it, where the recurrence then runs in two parts
(the second from the state the first leaves). Verify sequences read the
committed state without writing it and journal what a replay needs (pre-conv inputs and the
block's k, v, g, β); `commit` then replays only the accepted prefix from the committed state,
so rollback is exact and a sequence never holds more than its one committed state (plus the
transient state of the replay itself).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from configs.model import TargetConfig
from target.batch import ForwardBatch, TargetCaches
from target.distributed import TPGroup
from target.kernels import fused, gdn, gdn_prologue, gdn_slots
from target.layers.linear import ColumnParallelLinear, RowParallelLinear, load_sharded_1d
from target.layers.norm import GatedRMSNorm
from target.weights import WeightSource, copy_into, expect_shape


@dataclass
class GDNJournalEntry:
    mixed_qkv: torch.Tensor  # [B, C] pre-conv inputs of the block
    k: torch.Tensor  # [B, H, Dk] L2-normalised, expanded to value heads
    v: torch.Tensor  # [B, H, Dv]
    g: torch.Tensor  # [B, H] fp32 log-decay
    beta: torch.Tensor  # [B, H] (the recurrence dtype: bf16 on fla, else fp32)


@dataclass
class GDNBlockJournal:
    """The same for a uniform round (every sequence verifies L tokens), batched."""

    slots: torch.Tensor  # [S] long, state slots
    conv_seq: torch.Tensor  # [S, C, K-1+L]: the committed conv state, then the block's inputs
    k: torch.Tensor  # [S, L, H, Dk] (at the key heads [S, L, Hk, Dk] for the slots kernel)
    v: torch.Tensor  # [S, L, H, Dv]
    g: torch.Tensor  # [S, L, H] fp32
    beta: torch.Tensor  # [S, L, H] (as above)


# Checkpoint tensor → the segments of GatedDeltaNet.in_proj it fills.
IN_PROJ_PARTS = {"in_proj_qkv": (0, 1, 2), "in_proj_z": (3,), "in_proj_b": (4,),
                 "in_proj_a": (5,)}


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: TargetConfig, layer_idx: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        # Rounds (every sequence verifies the same L tokens) run batched; False
        # (KernelConfig.gdn_rounds "per-seq") takes the per-sequence path, which mixed batches
        # always take (tests compare the two).
        self.batched_rounds = True
        # The batched rounds' recurrence (KernelConfig.gdn_recurrence): "fla" on gathered
        # states (the torch reference off CUDA), or "slots" (target/kernels/gdn_slots.py: the
        # states read and written in place by slot).
        self.recurrence = "fla"
        # The batched rounds' conv, head split, norms and gates, and their gated output norm
        # (KernelConfig.gdn_prologue): "torch" (compiled chains) or, with the slots
        # recurrence, "triton" (target/kernels/gdn_prologue.py: one launch before the
        # recurrence, a decode's conv state written in it; one after it, a program per row)
        self.prologue = "torch"
        self.layer_idx = layer_idx
        self.tp = tp
        self.num_k_heads = tp.shard(cfg.linear_num_key_heads, "linear_num_key_heads")
        self.num_v_heads = tp.shard(cfg.linear_num_value_heads, "linear_num_value_heads")
        self.head_k_dim = cfg.linear_key_head_dim
        self.head_v_dim = cfg.linear_value_head_dim
        key_dim = cfg.linear_num_key_heads * self.head_k_dim
        value_dim = cfg.linear_num_value_heads * self.head_v_dim
        self.segments = [key_dim, key_dim, value_dim]  # q | k | v rows of in_proj_qkv and conv1d
        self.local_segments = [s // tp.size for s in self.segments]
        self.conv_dim = sum(self.local_segments)
        self.kernel = cfg.linear_conv_kernel_dim

        h, heads = cfg.hidden_size, cfg.linear_num_value_heads
        # The four input projections as one GEMM: rows [q | k | v | z | b | a] (each segment
        # split over ranks); the checkpoint's in_proj_qkv / _z / _b / _a load into their
        # segments (IN_PROJ_PARTS).
        self.in_proj = ColumnParallelLinear(h, [*self.segments, value_dim, heads, heads], tp,
                                            dtype)
        self.in_proj_splits = [self.conv_dim, *self.in_proj.local_sizes[3:]]
        self.conv1d = nn.Module()  # holds `weight` [C, 1, K] so names match the checkpoint
        conv = torch.empty(self.conv_dim, 1, self.kernel, dtype=dtype)
        self.conv1d.weight = nn.Parameter(conv, False)
        self.conv1d.weight.weight_loader = self._load_conv
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32), False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads, dtype=torch.float32), False)
        for p in (self.A_log, self.dt_bias):
            p.weight_loader = lambda param, src, shard_id=None: load_sharded_1d(param, src, tp)
        self.norm = GatedRMSNorm(self.head_v_dim, cfg.rms_norm_eps, dtype)
        self.out_proj = RowParallelLinear(value_dim, h, tp, dtype)

    def _load_conv(self, param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
        expect_shape(src, (sum(self.segments), 1, self.kernel))
        src_off = dst_off = 0
        for full, local in zip(self.segments, self.local_segments, strict=True):
            start = src_off + self.tp.rank * local
            rows = src.read(slice(start, start + local))
            copy_into(param.data[dst_off : dst_off + local], rows, src)
            src_off += full
            dst_off += local

    def forward(self, x: torch.Tensor, batch: ForwardBatch, caches: TargetCaches) -> torch.Tensor:
        # x [T, hidden]
        mixed_qkv, z, b, a = self.in_proj(x).split(self.in_proj_splits, dim=-1)  # [T, C] …
        z = z.reshape(-1, self.num_v_heads, self.head_v_dim)
        conv_cache, ssm_cache = caches.conv[self.layer_idx], caches.ssm[self.layer_idx]
        weight = self.conv1d.weight[:, 0, :]
        journal = batch.journal.setdefault(self.layer_idx, [])
        if self.batched_rounds and all(batch.is_verify) and len(set(batch.query_lens)) == 1:
            o = self._verify_round(mixed_qkv, b, a, batch, conv_cache, ssm_cache, weight,
                                   journal)
            if self.prologue == "triton":  # o comes in x's dtype from the slots recurrence
                o = gdn_prologue.gated_rms_norm(o, z, self.norm.weight, self.norm.eps)
            else:
                o = self.norm(o.to(x.dtype), z).reshape(x.shape[0], -1)
            return self.out_proj(o)
        # [T, H]: g fp32, β in the recurrence's dtype
        g, beta = fused.gdn_gates(b, a, self.A_log, self.dt_bias, gdn.recurrence_dtype(x))
        cu = batch.cu_seqlens
        inputs, new_convs, heads = [], [], {}
        for s in range(batch.num_seqs):
            lo, hi, slot = cu[s], cu[s + 1], batch.state_slots[s]
            conv_out, new_conv = gdn.causal_conv(mixed_qkv[lo:hi], conv_cache[slot], weight)
            q, k, v = self._split_heads(conv_out)
            state = ssm_cache[slot]
            snap, at = batch.snapshots.get(s, (None, hi - lo))
            if at < hi - lo:  # a snapshot inside the chunk: the recurrence in two parts
                heads[s], state = gdn.gated_delta_rule(q[:at], k[:at], v[:at], g[lo : lo + at],
                                                       beta[lo : lo + at], state)
                width = conv_cache.shape[-1]  # the conv state there: the K−1 inputs before it
                conv_cache[snap] = torch.cat([conv_cache[slot], mixed_qkv[lo : lo + at].t().to(
                    conv_cache.dtype)], dim=-1)[:, -width:]
                ssm_cache[snap] = state
                q, k, v, lo = q[at:], k[at:], v[at:], lo + at
            inputs.append((q, k, v, g[lo:hi], beta[lo:hi], state))
            new_convs.append(new_conv)
        outs = []
        for s, ((_, k, v, *_), new_conv, (o, new_state)) in enumerate(zip(
                inputs, new_convs, gdn.gated_delta_rule_many(inputs), strict=True)):
            lo, hi, slot = cu[s], cu[s + 1], batch.state_slots[s]
            if batch.is_verify[s]:
                journal.append(GDNJournalEntry(mixed_qkv[lo:hi], k, v, g[lo:hi], beta[lo:hi]))
            else:
                conv_cache[slot] = new_conv
                ssm_cache[slot] = new_state
                snap, at = batch.snapshots.get(s, (None, None))
                if at == hi - lo:  # a snapshot at the chunk's end: the state it leaves
                    conv_cache[snap] = new_conv
                    ssm_cache[snap] = new_state
            outs.append(o if s not in heads else torch.cat([heads[s], o]))
        o = torch.cat(outs).to(x.dtype)  # [T, H, Dv]
        o = self.norm(o, z).reshape(x.shape[0], -1)
        return self.out_proj(o)

    def _verify_round(self, mixed_qkv, b, a, batch, conv_cache, ssm_cache, weight,
                      journal) -> torch.Tensor:
        """Every sequence verifies L tokens: one batched conv and one batched recurrence (one
        fla call on CUDA) instead of a loop over sequences. Reads the committed states, writes
        nothing; journals the block for `commit`. L = 1 (plain decode: the token is always
        kept) writes the new states in place instead. Returns o [S·L, H, Dv]."""
        n_seqs, width = batch.num_seqs, batch.query_lens[0]
        slots = batch.state_slots_t
        x = mixed_qkv.view(n_seqs, width, -1)  # [S, L, C]
        in_place = self.recurrence == "slots"
        qk_dtype = gdn.recurrence_dtype(x)
        # q, k, v [S, L, H, D] (q and k at the key heads for the slots kernel: it maps value
        # heads to them); g, β [S, L, Hv]; conv_seq [S, C, K-1+L] the committed conv state,
        # then the inputs (None where the Triton prologue wrote a decode's state already)
        if self.prologue == "triton":
            q, k, v, g, beta, conv_seq = gdn_prologue.conv_split_gates(
                x, conv_cache, slots, weight, a, b, self.A_log, self.dt_bias, self.num_k_heads,
                self.head_k_dim, self.num_v_heads, self.head_v_dim, qk_dtype, qk_dtype)
        else:
            g, beta = fused.gdn_gates(b, a, self.A_log, self.dt_bias, qk_dtype)
            g, beta = g.view(n_seqs, width, -1), beta.view(n_seqs, width, -1)
            q, k, v, conv_seq = fused.conv_split_heads(
                x, conv_cache, slots, weight, self.local_segments[0], self.num_k_heads,
                self.head_k_dim, self.num_v_heads, self.head_v_dim, qk_dtype, not in_place)
        if in_place:  # decode writes its final states in place, a verify only reads them
            o = gdn_slots.recurrent_slots(q, k, v, g, beta, ssm_cache, slots,
                                          write_state=width == 1)
        else:
            o, final = gdn.gated_delta_rule_batched(q, k, v, g, beta, ssm_cache[slots])
        if width == 1:  # autoregressive decode: its one token is always kept, commit in place
            if conv_seq is not None:
                commit = gdn_slots.commit_conv if in_place else gdn_slots.commit_conv_reference
                commit(conv_seq, conv_cache, slots, 1)
            if not in_place:
                ssm_cache[slots] = final.to(ssm_cache.dtype)
        else:
            journal.append(GDNBlockJournal(slots, conv_seq, k, v, g, beta))
        return o.reshape(n_seqs * width, *o.shape[2:])

    def _split_heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, ...]:
        # conv_out [..., C] → q, k [..., Hv, Dk] (normalised, q scaled, key heads expanded to
        # the value heads), v [..., Hv, Dv]
        return fused.gdn_split_heads(conv_out, self.local_segments[0], self.num_k_heads,
                                     self.head_k_dim, self.num_v_heads, self.head_v_dim,
                                     gdn.recurrence_dtype(conv_out))

    def commit(self, batch: ForwardBatch, caches: TargetCaches, num_kept: list[int],
               taps: gdn_slots.Taps | None = None) -> None:
        """Advance each verify sequence's committed state over the first num_kept tokens;
        with taps, also leave its state at the last page boundary they reach in its boundary
        slot (gdn_slots.Taps)."""
        conv_cache, ssm_cache = caches.conv[self.layer_idx], caches.ssm[self.layer_idx]
        entries = batch.journal.get(self.layer_idx, [])
        if not entries:  # nothing held back (a one-token round committed in its forward)
            return
        if isinstance(entries[0], GDNBlockJournal):
            self._commit_round(entries[0], conv_cache, ssm_cache, num_kept,
                               self.recurrence == "slots", taps)
            return
        entries = iter(entries)
        kept = iter(num_kept)
        tap_slots, tap_ends = ((taps.slots.tolist(), taps.ends.tolist()) if taps is not None
                               else ([-1] * batch.num_seqs, [0] * batch.num_seqs))
        for s in range(batch.num_seqs):
            if not batch.is_verify[s]:
                continue
            e, n, slot = next(entries), int(next(kept)), batch.state_slots[s]
            if n == 0:
                continue
            width = conv_cache.shape[-1]
            seq = torch.cat([conv_cache[slot], e.mixed_qkv[:n].t().to(conv_cache.dtype)], dim=-1)
            start = batch.seq_lens[s] - batch.query_lens[s]
            reach = min(start + n, tap_ends[s])  # (gdn_slots.Taps)
            tap = reach // caches.page_size * caches.page_size - start
            if tap_slots[s] >= 0 and tap > 0:  # the state at the boundary, before the commit's
                conv_cache[tap_slots[s]] = seq[:, tap : tap + width]
                ssm_cache[tap_slots[s]] = gdn.replay_state(
                    e.k[:tap], e.v[:tap], e.g[:tap], e.beta[:tap], ssm_cache[slot])
            conv_cache[slot] = seq[:, seq.shape[1] - width :]
            ssm_cache[slot] = gdn.replay_state(e.k[:n], e.v[:n], e.g[:n], e.beta[:n],
                                               ssm_cache[slot])

    @staticmethod
    def _commit_round(e: GDNBlockJournal, conv_cache, ssm_cache, num_kept: list[int],
                      in_place: bool, taps: gdn_slots.Taps | None = None) -> None:
        """Batched commit: sequence i keeps its first n_i block tokens. The replay runs all L
        steps for everyone with g = β = 0 past n_i, which leaves a state exactly unchanged (the
        slots kernel, `in_place`, stops at n_i instead and writes the states where they are);
        the conv state is the K−1 inputs ending at n_i: conv_seq[:, :, n_i : n_i + K−1] (in
        place by slot in one launch with the slots kernel). Taps: the slots kernel stores the
        state at the boundary as it passes it; the batched replay runs a second time up to
        the boundaries (writing a sequence's own slot where it has none, before the commit
        overwrites it: no host sync)."""
        n = torch.as_tensor(num_kept, device=e.g.device)  # [S]; a device tensor stays put
        if in_place:
            gdn_slots.recurrent_slots(e.k, e.k, e.v, e.g, e.beta, ssm_cache, e.slots,
                                      num_kept=n, write_state=True, need_output=False, taps=taps)
            gdn_slots.commit_conv(e.conv_seq, conv_cache, e.slots, n, taps)
            return
        if taps is not None:
            tap = taps.kept(n)
            ssm_cache[torch.where(tap > 0, taps.slots, e.slots)] = _replayed(e, ssm_cache, tap)
        ssm_cache[e.slots] = _replayed(e, ssm_cache, n)
        gdn_slots.commit_conv_reference(e.conv_seq, conv_cache, e.slots, n, taps)


def _replayed(e: GDNBlockJournal, ssm_cache: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """[S, H, Dk, Dv] each sequence's committed state advanced over its first n_s block tokens
    (g = β = 0 past them), in the cache's dtype."""
    _, state = gdn.gated_delta_rule_batched(e.k, *gdn_slots.kept_only(e.k, e.v, e.g, e.beta, n),
                                            ssm_cache[e.slots])
    return state.to(ssm_cache.dtype)
