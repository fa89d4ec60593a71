"""The Gated DeltaNet recurrence of a uniform round (decode: L = 1; a speculative verify: L
tokens for each of S sequences; the commit's replay of the kept tokens) reading and writing the
recurrent states in place, by slot, in the state cache.

Without it a round gathers each sequence's state out of the cache (`ssm_cache[slots]`, fp32
[Hv, Dk, Dv]: 2 MB per sequence per layer on Qwen3.5-35B-A3B), runs fla's fused_recurrent
kernel on the copy and scatters the final state back (decode); the commit after a verify
gathers again, replays the kept tokens with g = β = 0 past each kept count and scatters back.
In a profile of a decode step on an H200 the round's gathers and scatters of the states were
~4 index kernels per GDN layer per step, ~0.5 ms of a 6 ms step over the 30 GDN layers. This
kernel reads state_cache[slots[s]] itself and, where asked, writes the final state back to
the same place: the recurrent state's gathers and scatters go. `commit_conv` writes the conv
states (C·(K−1) values per sequence) the same way, one launch for the gather and the indexed
store torch needs. On an H200 (docs/BENCHMARKS.md) the in-place
recurrence takes 0.5–0.7 ms off a batch-1 decode and 1.5–3 ms off a 16-token verify; the
conv commit's share is not measured on its own.

  Grid (S·Hv, cdiv(Dv, BLOCK_V)): a program owns one sequence's value head and BLOCK_V of its
  value columns, keeps that [Dk, BLOCK_V] fp32 tile of the state in registers over the L
  tokens and per token, in fp32 and in the order of gdn_torch.recurrent_gated_delta_rule:
      S = e^g·S;  kv = Sᵀk;  δ = (v − kv)·β;  S = S + k ⊗ δ;  o = Sᵀq.
  Value columns never mix, so the tiles are independent. Value head j reads key head
  j // (Hv / Hk) (grouped value attention): q and k come at the key heads, unexpanded.

Three call sites, three compiled variants (the flags are constexpr, fixed per call site):
  decode   write_state=True                       the one token is always kept
  verify   write_state=False                      the cache is only read; commit follows
  commit   num_kept=n, write_state=True, need_output=False
           the first n_s tokens only: the loop stops at n_s (the reference's g = β = 0 past
           n_s leaves the state exactly as it is; stopping there leaves it untouched).
           With taps (the prefix cache's boundary slots, `Taps`) the program also stores its
           tile into the sequence's boundary slot right after the token that completes the
           last page boundary its kept tokens reach: one extra tile store for a sequence
           that crosses one, decided on the device from the kept count.

The launch shape is one per model (SlotsLaunch: BLOCK_V, warps; Dv alone picks the tile), never
per step, and programs share nothing: a sequence's result is the same bits alone or in a
batch, whatever the other sequences are, and a decode, a verify and the commit after it run
the same arithmetic per token. No host sync and nothing read back, so a round captures in a
CUDA graph with its slots and kept counts in device tensors.

Triton is optional, as in moe_triton.py: without it `recurrent_slots_available` is False and
CPU callers take `recurrent_slots_reference` (plain torch, same signature and meaning). On CPU
tensors the kernel runs only in Triton's interpreter (TRITON_INTERPRET=1 set before triton is
first imported; moe_triton.py says why)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from target.kernels import gdn_torch, pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


@dataclass(frozen=True)
class SlotsLaunch:
    """The recurrence's launch shape: `block_v` value columns per program (a [Dk, block_v]
    fp32 state tile in registers), `warps` per program."""

    block_v: int = 32
    warps: int = 4


# Dk = Dv = 128 on the real model: a [128, 32] fp32 tile is 32 registers per thread at 4 warps,
# and S·Hv·4 = 128·S programs (decode at batch 1 about fills an H200's 132 SMs). Other tile
# widths change the bits and won only at some sizes (docs/BENCHMARKS.md).
LAUNCH = SlotsLaunch()
# commit_conv's channels per program (8192 channels on the real model: 8 programs a sequence).
CONV_BLOCK = 1024


def recurrent_slots_available(x: torch.Tensor) -> bool:
    """Triton is importable and x is on CUDA."""
    return triton is not None and x.is_cuda


def recurrent_slots(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor, state_cache: torch.Tensor, slots: torch.Tensor, *,
                    num_kept: torch.Tensor | None = None, write_state: bool = False,
                    need_output: bool = True, taps: Taps | None = None,
                    launch: SlotsLaunch | None = None) -> torch.Tensor | None:
    """q, k [S, L, Hk, Dk] (L2-normalised, q scaled; any float dtype); v [S, L, Hv, Dv];
    g [S, L, Hv] fp32; beta [S, L, Hv]; state_cache [N, Hv, Dk, Dv] fp32; slots [S] integer,
    distinct (not checked: that would read them back); num_kept [S] integer or None (all L).
    Sequence s starts from state_cache[slots[s]]; tokens t ≥ num_kept[s] leave its state as
    it is. write_state: the final states go back to their slots in place. Returns o
    [S, L, Hv, Dv] in v's dtype, or None when not need_output. Any strides. `taps` (with
    write_state): also each sequence's state at the last page boundary its kept tokens reach
    (Taps). `launch` (benchmarks, tests) replaces LAUNCH."""
    if triton is None:
        raise RuntimeError("recurrent_slots needs triton")
    n_seqs, length, k_heads, dk = q.shape
    v_heads, dv = v.shape[2:]
    assert k.shape == q.shape and v.shape[:2] == (n_seqs, length), (q.shape, k.shape, v.shape)
    assert g.shape == beta.shape == (n_seqs, length, v_heads), (g.shape, beta.shape)
    assert state_cache.shape[1:] == (v_heads, dk, dv), state_cache.shape
    assert state_cache.dtype == torch.float32, state_cache.dtype
    assert slots.shape == (n_seqs,), slots.shape
    assert num_kept is None or num_kept.shape == (n_seqs,), num_kept.shape
    assert v_heads % k_heads == 0, (k_heads, v_heads)
    assert dk & (dk - 1) == 0, f"Dk = {dk} must be a power of two (one tile of the state rows)"
    o = (torch.empty(n_seqs, length, v_heads, dv, dtype=v.dtype, device=v.device)
         if need_output else None)
    if n_seqs == 0 or length == 0:
        return o
    if not v.is_cuda and not _interpreted():
        raise RuntimeError("recurrent_slots on CPU tensors runs in Triton's interpreter only: "
                           "set TRITON_INTERPRET=1 before anything imports triton")
    launch = launch or LAUNCH
    block_v = min(launch.block_v, triton.next_power_of_2(dv))  # of the model alone
    slots = slots.contiguous()  # read as slots_ptr + s
    kept = slots if num_kept is None else num_kept.contiguous()  # (unread without num_kept)
    out, out_strides = (o, o.stride()) if need_output else (v, (0, 0, 0, 0))  # (unwritten)
    tap_slots, tap_starts, tap_ends, page = _tap_args(taps, slots, n_seqs)
    _recurrent_slots_kernel[(n_seqs * v_heads, triton.cdiv(dv, block_v))](
        q, k, v, g, beta, state_cache, slots, kept, out, tap_slots, tap_starts, tap_ends,
        length, v_heads, v_heads // k_heads, dv, page, tap_starts.stride(0),
        *q.stride(), *k.stride(), *v.stride(), *g.stride(), *beta.stride(),
        *state_cache.stride(), *out_strides,
        DK=dk, BLOCK_V=block_v, HAS_KEPT=num_kept is not None, WRITE_STATE=write_state,
        NEED_OUTPUT=need_output, TAP=taps is not None, num_warps=launch.warps,
        **pdl.options(q))
    return o


@dataclass(frozen=True)
class Taps:
    """Where a commit also leaves each sequence's state at a page boundary: sequence s
    started its block at position starts[s] (any stride) and keeps n tokens; its state after
    the last multiple of `page` at or below min(starts[s] + n, ends[s]) is written to
    slots[s] (its boundary slot), when that boundary lies past starts[s]. Nothing is written
    for a sequence with slots[s] < 0 or no such boundary, so the slot keeps the boundary an
    earlier round left there. ends[s]: the position its tokens end at for good (its prompt
    and max_tokens), so that kept tokens past its last output token are not tapped. All
    device tensors: the tap is decided on the device from the kept counts, without a host
    sync."""

    slots: torch.Tensor  # [S] integer, −1 for none
    starts: torch.Tensor  # [S] integer
    ends: torch.Tensor  # [S] integer
    page: int

    def kept(self, num_kept: torch.Tensor) -> torch.Tensor:
        """[S] the kept tokens up to each sequence's tapped boundary (≤ 0: no tap)."""
        starts = self.starts.long()
        reach = torch.minimum(starts + num_kept.long(), self.ends.long())
        n = reach // self.page * self.page - starts
        return torch.where(self.slots >= 0, n, torch.zeros_like(n))


def _tap_args(taps: Taps | None, slots: torch.Tensor, n_seqs: int
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    if taps is None:
        return slots, slots, slots, 1  # (unread)
    assert taps.slots.shape == taps.starts.shape == taps.ends.shape == (n_seqs,), (
        taps.slots.shape, taps.starts.shape, taps.ends.shape)
    return taps.slots.contiguous(), taps.starts, taps.ends.contiguous(), taps.page


def recurrent_slots_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                              g: torch.Tensor, beta: torch.Tensor, state_cache: torch.Tensor,
                              slots: torch.Tensor, *, num_kept: torch.Tensor | None = None,
                              write_state: bool = False, need_output: bool = True,
                              taps: Taps | None = None) -> torch.Tensor | None:
    """recurrent_slots in plain torch (gdn_torch's recurrence on gathered states): the tests'
    reference and CPU callers' path. Past num_kept g = β = 0, which leaves a state unchanged
    (a state element of −0.0 may come back +0.0; the kernel leaves it as it is). Taps replay
    the tapped tokens a second time (no host sync: a sequence without a tap writes its own
    slot, which the commit then overwrites)."""
    length = q.shape[1]
    group = v.shape[2] // q.shape[2]
    q, k = q.repeat_interleave(group, dim=2), k.repeat_interleave(group, dim=2)  # [S, L, Hv, Dk]
    if write_state and taps is not None:
        n = torch.full_like(slots, length) if num_kept is None else num_kept
        tap = taps.kept(n)
        _, state = gdn_torch.recurrent_gated_delta_rule(q, *kept_only(k, v, g, beta, tap),
                                                        state_cache[slots])
        state_cache[torch.where(tap > 0, taps.slots, slots)] = state.to(state_cache.dtype)
    if num_kept is not None:
        g, beta = kept_only(k, v, g, beta, num_kept)[2:]
    o, final = gdn_torch.recurrent_gated_delta_rule(q, k, v, g, beta, state_cache[slots])
    if write_state:
        state_cache[slots] = final.to(state_cache.dtype)
    return o.to(v.dtype) if need_output else None


def kept_only(k, v, g, beta, num_kept: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """k, v, and g, β zero past each sequence's first num_kept tokens (the state stands
    still there): a replay over the first num_kept[s] tokens of S uniform blocks."""
    keep = torch.arange(g.shape[1], device=g.device)[None, :] < num_kept[:, None]  # [S, L]
    return (k, v, g.masked_fill(~keep[..., None], 0.0),
            beta.masked_fill(~keep[..., None], 0.0))


def commit_conv(conv_seq: torch.Tensor, conv_cache: torch.Tensor, slots: torch.Tensor,
                kept: torch.Tensor | int, taps: Taps | None = None) -> None:
    """conv_cache[slots[s]] = conv_seq[s, :, n_s : n_s + K−1] in the cache's dtype, one launch:
    each sequence's conv state after its first n_s block tokens (conv_seq [S, C, K−1+L]: the
    committed state, then the block's inputs; conv_cache [N, C, K−1]; slots [S] integer;
    kept: [S] integer, or one n for every sequence (a decode: 1)). Any strides. `taps` (with
    per-sequence kept counts): also the conv state at each tapped boundary (Taps)."""
    if triton is None:
        raise RuntimeError("commit_conv needs triton")
    n_seqs, channels = conv_seq.shape[:2]
    k_1 = conv_cache.shape[-1]
    assert conv_cache.shape[1] == channels and slots.shape == (n_seqs,), (
        conv_seq.shape, conv_cache.shape, slots.shape)
    if n_seqs == 0:
        return
    if not conv_seq.is_cuda and not _interpreted():
        raise RuntimeError("commit_conv on CPU tensors runs in Triton's interpreter only: "
                           "set TRITON_INTERPRET=1 before anything imports triton")
    slots = slots.contiguous()
    per_seq = isinstance(kept, torch.Tensor)
    kept_t = kept.contiguous() if per_seq else slots  # (unread with one n)
    assert per_seq or taps is None, "taps need per-sequence kept counts"
    tap_slots, tap_starts, tap_ends, page = _tap_args(taps, slots, n_seqs)
    _commit_conv_kernel[(n_seqs, triton.cdiv(channels, CONV_BLOCK))](
        conv_seq, conv_cache, slots, kept_t, tap_slots, tap_starts, tap_ends,
        0 if per_seq else int(kept),
        channels, page, tap_starts.stride(0), *conv_seq.stride(), *conv_cache.stride(),
        K_1=k_1, BLOCK_C=CONV_BLOCK, PER_SEQ=per_seq, TAP=taps is not None, num_warps=4,
        **pdl.options(conv_seq))


def commit_conv_reference(conv_seq: torch.Tensor, conv_cache: torch.Tensor,
                          slots: torch.Tensor, kept: torch.Tensor | int,
                          taps: Taps | None = None) -> None:
    """commit_conv in torch (a gather and an indexed store): the tests' reference and CPU
    callers' path. A sequence without a tap writes its own slot first, which the commit then
    overwrites (no host sync)."""
    n_seqs, channels = conv_seq.shape[:2]
    k_1 = conv_cache.shape[-1]
    if not isinstance(kept, torch.Tensor):
        assert taps is None, "taps need per-sequence kept counts"
        conv_cache[slots] = conv_seq[:, :, kept : kept + k_1].to(conv_cache.dtype)
        return

    def window(n: torch.Tensor) -> torch.Tensor:  # [S, C, K−1] the state after n tokens
        cols = n[:, None] + torch.arange(k_1, device=n.device)[None, :]  # [S, K-1]
        return conv_seq.gather(2, cols[:, None, :].expand(n_seqs, channels, k_1))

    if taps is not None:
        tap = taps.kept(kept)
        conv_cache[torch.where(tap > 0, taps.slots, slots)] = window(
            tap.clamp(min=0)).to(conv_cache.dtype)
    conv_cache[slots] = window(kept.long()).to(conv_cache.dtype)


def _interpreted() -> bool:
    return triton is not None and not isinstance(_recurrent_slots_kernel,
                                                 triton.runtime.JITFunction)


if triton is not None:
    from target.kernels.pdl import await_prior

    @triton.jit
    def _emit(s, q, o_at, col_ok):
        # o = Sᵀq for one token: s [DK, BLOCK_V]; q [DK] fp32; o_at [BLOCK_V] pointers.
        o = tl.sum(s * q[:, None], axis=0)  # [BLOCK_V]
        tl.store(o_at, o.to(o_at.dtype.element_ty), mask=col_ok)

    @triton.jit
    def _token_inputs(k_row, v_row, g_at, b_at, t, col_ok, stride_kt, stride_vt, stride_gt,
                      stride_bt):
        """Token t's k [DK], v [BLOCK_V] (masked columns 0), g and β, fp32."""
        kt = tl.load(k_row + t * stride_kt).to(tl.float32)
        vt = tl.load(v_row + t * stride_vt, mask=col_ok, other=0.0).to(tl.float32)
        gt = tl.load(g_at + t * stride_gt).to(tl.float32)
        bt = tl.load(b_at + t * stride_bt).to(tl.float32)
        return kt, vt, gt, bt

    @triton.jit
    def _step(s, kt, vt, gt, bt):
        """One token of the rule, in gdn_torch's order: S = e^g·S; δ = (v − Sᵀk)·β;
        S = S + k ⊗ δ."""
        s = s * tl.exp(gt)
        kv = tl.sum(s * kt[:, None], axis=0)  # [BLOCK_V] Sᵀk
        delta = (vt - kv) * bt
        return s + kt[:, None] * delta[None, :]

    @triton.jit
    def _advance(s, t, q_row, k_row, v_row, g_at, b_at, o_row, col_ok, stride_qt, stride_kt,
                 stride_vt, stride_gt, stride_bt, stride_ot, NEED_OUTPUT: tl.constexpr):
        """Token t: the state advanced over it (and, NEED_OUTPUT, its output emitted)."""
        kt, vt, gt, bt = _token_inputs(k_row, v_row, g_at, b_at, t, col_ok, stride_kt,
                                       stride_vt, stride_gt, stride_bt)
        s = _step(s, kt, vt, gt, bt)
        if NEED_OUTPUT:
            qt = tl.load(q_row + t * stride_qt).to(tl.float32)
            _emit(s, qt, o_row + t * stride_ot, col_ok)
        return s

    @triton.jit
    def _recurrent_slots_kernel(
            q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, state_ptr, slots_ptr, kept_ptr, o_ptr,
            tap_slots_ptr, tap_starts_ptr, tap_ends_ptr, length, v_heads, group, dv, page,
            stride_tap,
            stride_qs, stride_qt, stride_qh, stride_qd,
            stride_ks, stride_kt, stride_kh, stride_kd,
            stride_vs, stride_vt, stride_vh, stride_vd,
            stride_gs, stride_gt, stride_gh,
            stride_bs, stride_bt, stride_bh,
            stride_cn, stride_ch, stride_ck, stride_cv,
            stride_os, stride_ot, stride_oh, stride_od,
            DK: tl.constexpr, BLOCK_V: tl.constexpr, HAS_KEPT: tl.constexpr,
            WRITE_STATE: tl.constexpr, NEED_OUTPUT: tl.constexpr, TAP: tl.constexpr,
            PDL: tl.constexpr):
        await_prior(PDL)
        pid = tl.program_id(0)
        seq = (pid // v_heads).to(tl.int64)
        head = pid % v_heads
        k_head = head // group
        rows = tl.arange(0, DK)  # [DK] key dims: Dk is a power of two, no mask
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)  # [BLOCK_V] value dims
        col_ok = cols < dv
        # int64: slot · stride_cn passes 2^31 elements past 1024 slots on the real model.
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        tile = (state_ptr + slot * stride_cn + head * stride_ch + rows[:, None] * stride_ck
                + cols[None, :] * stride_cv)  # [DK, BLOCK_V]
        s = tl.load(tile, mask=col_ok[None, :], other=0.0)  # fp32; masked columns stay 0
        n = length
        if HAS_KEPT:  # the kept tokens come first; clamp to [0, L]
            n = tl.minimum(tl.maximum(tl.load(kept_ptr + seq).to(tl.int32), 0), length)
        q_row = q_ptr + seq * stride_qs + k_head * stride_qh + rows * stride_qd
        k_row = k_ptr + seq * stride_ks + k_head * stride_kh + rows * stride_kd
        v_row = v_ptr + seq * stride_vs + head * stride_vh + cols * stride_vd
        g_at = g_ptr + seq * stride_gs + head * stride_gh
        b_at = beta_ptr + seq * stride_bs + head * stride_bh
        o_row = o_ptr + seq * stride_os + head * stride_oh + cols * stride_od
        # Taps: the tokens up to the boundary, the state stored there, then the rest (two
        # loops, no branch inside one: the commit keeps its registers)
        first = n
        if TAP:
            tap_slot = tl.load(tap_slots_ptr + seq).to(tl.int64)
            start = tl.load(tap_starts_ptr + seq * stride_tap).to(tl.int64)
            reach = tl.minimum(start + n, tl.load(tap_ends_ptr + seq).to(tl.int64))
            first = tl.where(tap_slot >= 0, reach // page * page - start, 0).to(tl.int32)
            first = tl.minimum(tl.maximum(first, 0), n)
        for t in range(0, first):  # (q loaded after the step: fewer registers live across it)
            s = _advance(s, t, q_row, k_row, v_row, g_at, b_at, o_row, col_ok, stride_qt,
                         stride_kt, stride_vt, stride_gt, stride_bt, stride_ot, NEED_OUTPUT)
        if TAP:
            if first > 0:
                tl.store(tile + (tap_slot - slot) * stride_cn, s, mask=col_ok[None, :])
            for t in range(first, n):
                s = _advance(s, t, q_row, k_row, v_row, g_at, b_at, o_row, col_ok, stride_qt,
                             stride_kt, stride_vt, stride_gt, stride_bt, stride_ot,
                             NEED_OUTPUT)
        if NEED_OUTPUT:
            if HAS_KEPT:  # past the kept tokens the state stands still: o = Sᵀq only
                for t in range(n, length):
                    qt = tl.load(q_row + t * stride_qt).to(tl.float32)
                    _emit(s, qt, o_row + t * stride_ot, col_ok)
        if WRITE_STATE:
            tl.store(tile, s, mask=col_ok[None, :])

    @triton.jit
    def _commit_conv_kernel(Seq, Cache, Slots, Kept, TapSlots, TapStarts, TapEnds, n_fixed,
                            channels,
                            page, stride_tap, stride_qs, stride_qc, stride_ql, stride_cn,
                            stride_cc, stride_ck, K_1: tl.constexpr, BLOCK_C: tl.constexpr,
                            PER_SEQ: tl.constexpr, TAP: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        s = tl.program_id(0)
        c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ok = c < channels
        slot = tl.load(Slots + s).to(tl.int64)
        n = n_fixed
        if PER_SEQ:
            n = tl.load(Kept + s).to(tl.int32)
        src = Seq + s.to(tl.int64) * stride_qs + c * stride_qc
        dst = Cache + slot * stride_cn + c * stride_cc
        for j in tl.static_range(K_1):
            x = tl.load(src + (n + j) * stride_ql, mask=ok)
            tl.store(dst + j * stride_ck, x.to(Cache.dtype.element_ty), mask=ok)
        if TAP:  # the conv state at the tapped boundary (Taps), where there is one
            tap_slot = tl.load(TapSlots + s).to(tl.int64)
            start = tl.load(TapStarts + s * stride_tap).to(tl.int64)
            reach = tl.minimum(start + n, tl.load(TapEnds + s).to(tl.int64))
            tap_n = reach // page * page - start
            if (tap_slot >= 0) & (tap_n > 0):
                tap_dst = Cache + tap_slot * stride_cn + c * stride_cc
                for j in tl.static_range(K_1):
                    x = tl.load(src + (tap_n + j) * stride_ql, mask=ok)
                    tl.store(tap_dst + j * stride_ck, x.to(Cache.dtype.element_ty), mask=ok)
