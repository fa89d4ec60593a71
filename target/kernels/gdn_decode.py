"""A Gated DeltaNet decode (one token per sequence) in two launches instead of three: the
prologue (gdn_prologue.conv_split_gates) folded into the in-place recurrence
(gdn_slots.recurrent_slots), and the conv state's shift moved into the gated output norm
that follows (KernelConfig gdn_prologue "fused").

Why: at decode the prologue (4.1 µs on an H100) and the recurrence (3.6 µs) are both fixed
cost, 30 layers a step (docs/BENCHMARKS.md, fifteenth session's profile).

`decode_recurrence`: grid (S·Hv, cdiv(Dv, BLOCK_V)) as the recurrence's. Program (s·Hv + h,
c) computes what it reads of the prologue's outputs itself: the conv (over the committed
conv state, read by slot, and the token's input), SiLU and L2 norm of key head h // (Hv/Hk)'s
q and k channels (every program of that key head computes them: 2·Dk channels of K taps),
the conv and SiLU of its own BLOCK_V value channels, and value head h's gates g and β; then
the recurrence's step and output for its [Dk, BLOCK_V] state tile, the state written back in
place. Every value is computed with the prologue's and the recurrence's own code (the same
Triton functions: gdn_prologue._conv_silu, gdn_slots._step, _emit) and rounded where they
round it (q, k and β to the recurrence's dtype, v to x's), so a decode gets the bits the two
launches give, and the bits of the same token inside a verify block.

The conv state cannot be shifted here: the programs of a key head all read its q and k
channels' state, and none may overwrite it before the others have read. The gated output
norm after the recurrence writes it (`shift_conv_state`, in the same launch: the norm's
program (t, h) shifts channels h·⌈C/Hv⌉ … of sequence t's state by one and appends the
token's input), once every program of the recurrence has finished.

Triton is optional, as in gdn_slots.py; on CPU tensors the kernels run only in Triton's
interpreter (TRITON_INTERPRET=1 set before triton is first imported)."""

from __future__ import annotations

import torch

from target.kernels import gdn_slots

try:
    import triton
    import triton.language as tl

    from target.kernels.gdn_prologue import _conv_silu
    from target.kernels.gdn_slots import _emit, _step
except ImportError:  # CPU-only installs
    triton = None

_TL_DTYPES = {} if triton is None else {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16,
                                         torch.float16: tl.float16}


def decode_recurrence(x: torch.Tensor, conv_cache: torch.Tensor, slots: torch.Tensor,
                      weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                      a_log: torch.Tensor, dt_bias: torch.Tensor, state_cache: torch.Tensor,
                      num_k_heads: int, head_k_dim: int, num_v_heads: int, head_v_dim: int,
                      qk_dtype: torch.dtype,
                      launch: gdn_slots.SlotsLaunch | None = None) -> torch.Tensor:
    """x [S, C] one token's conv inputs per sequence (C = 2·Hk·Dk + Hv·Dv, channels
    contiguous); conv_cache [N, C, K−1] read (not written) at slots [S]; weight [C, K]; a, b
    [S, Hv]; a_log, dt_bias [Hv]; state_cache [N, Hv, Dk, Dv] fp32, read and written at
    slots. Returns o [S, Hv, Dv] in x's dtype: what conv_split_gates (q, k and β in
    qk_dtype) then recurrent_slots(write_state=True) return for these tokens; the conv state
    is left for shift_conv_state."""
    if triton is None:
        raise RuntimeError("decode_recurrence needs triton")
    n_seqs, channels = x.shape
    taps = weight.shape[1]
    key_dim, ratio = num_k_heads * head_k_dim, num_v_heads // num_k_heads
    assert channels == 2 * key_dim + num_v_heads * head_v_dim, (x.shape, key_dim)
    assert conv_cache.shape[1:] == (channels, taps - 1) and slots.shape == (n_seqs,)
    assert a.shape == b.shape == (n_seqs, num_v_heads), (a.shape, b.shape)
    assert x.stride(1) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    assert state_cache.shape[1:] == (num_v_heads, head_k_dim, head_v_dim), state_cache.shape
    assert state_cache.dtype == torch.float32, state_cache.dtype
    assert head_k_dim & (head_k_dim - 1) == 0, f"Dk = {head_k_dim} must be a power of two"
    o = torch.empty(n_seqs, num_v_heads, head_v_dim, dtype=x.dtype, device=x.device)
    if n_seqs == 0:
        return o
    if not x.is_cuda and not _interpreted():
        raise RuntimeError("decode_recurrence on CPU tensors runs in Triton's interpreter "
                           "only: set TRITON_INTERPRET=1 before anything imports triton")
    launch = launch or gdn_slots.LAUNCH
    block_v = min(launch.block_v, triton.next_power_of_2(head_v_dim))
    _decode_kernel[(n_seqs * num_v_heads, triton.cdiv(head_v_dim, block_v))](
        x, conv_cache, slots.contiguous(), weight, a, b, a_log, dt_bias, state_cache, o,
        num_v_heads, key_dim, head_v_dim, head_k_dim ** -0.5, x.stride(0),
        *conv_cache.stride(), *weight.stride(), a.stride(0), b.stride(0),
        *state_cache.stride(), K=taps, DK=head_k_dim, RATIO=ratio, BLOCK_V=block_v,
        QK_DTYPE=_TL_DTYPES[qk_dtype], num_warps=launch.warps)
    return o


def _interpreted() -> bool:
    return triton is not None and not isinstance(_decode_kernel, triton.runtime.JITFunction)


if triton is not None:

    @triton.jit
    def _decode_kernel(x_ptr, cache_ptr, slots_ptr, w_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr,
                       state_ptr, o_ptr, v_heads, key_dim, dv, q_scale, stride_xs,
                       stride_cn, stride_cc, stride_ck, stride_wc, stride_wk,
                       stride_at, stride_bt, stride_sn, stride_sh, stride_sk, stride_sv,
                       K: tl.constexpr, DK: tl.constexpr, RATIO: tl.constexpr,
                       BLOCK_V: tl.constexpr, QK_DTYPE: tl.constexpr):
        pid = tl.program_id(0)
        seq = (pid // v_heads).to(tl.int64)
        head = pid % v_heads
        k_head = head // RATIO
        slot = tl.load(slots_ptr + seq).to(tl.int64)
        x_row = x_ptr + seq * stride_xs  # the token's inputs: window position K−1
        cache_row = cache_ptr + slot * stride_cn
        rows = tl.arange(0, DK)
        rows_ok = rows < DK
        # the prologue's work for this program, as gdn_prologue._prologue_kernel does it for
        # token 0 of a one-token round (no conv state written: WRITE_STATE False, and the
        # window is not stored: a mask that holds nowhere)
        q = _conv_silu(x_row, cache_row, w_ptr, x_row, k_head * DK + rows, rows_ok, 0, 0,
                       stride_cc, stride_ck, stride_wc, stride_wk, 0, 0, K, False,
                       False).to(tl.float32)
        k = _conv_silu(x_row, cache_row, w_ptr, x_row, key_dim + k_head * DK + rows, rows_ok,
                       0, 0, stride_cc, stride_ck, stride_wc, stride_wk, 0, 0, K, False,
                       False).to(tl.float32)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        q = q.to(QK_DTYPE).to(tl.float32)
        k = k.to(QK_DTYPE).to(tl.float32)
        cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        col_ok = cols < dv
        v = _conv_silu(x_row, cache_row, w_ptr, x_row, 2 * key_dim + head * dv + cols, col_ok,
                       0, 0, stride_cc, stride_ck, stride_wc, stride_wk, 0, 0, K, False,
                       False)
        v = tl.where(col_ok, v.to(tl.float32), 0.0)
        a = tl.load(a_ptr + seq * stride_at + head).to(tl.float32)
        a = a + tl.load(dtb_ptr + head).to(tl.float32)
        e = tl.exp(a)
        u = 1.0 + e
        softplus = tl.where(a > 20.0, a, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))
        g = -tl.exp(tl.load(alog_ptr + head).to(tl.float32)) * softplus
        b = tl.load(b_ptr + seq * stride_bt + head).to(tl.float32)
        beta = (1.0 / (1.0 + tl.exp(-b))).to(QK_DTYPE).to(tl.float32)
        # the recurrence, as gdn_slots._recurrent_slots_kernel runs a decode
        tile = (state_ptr + slot * stride_sn + head * stride_sh + rows[:, None] * stride_sk
                + cols[None, :] * stride_sv)
        s = tl.load(tile, mask=col_ok[None, :], other=0.0)
        s = _step(s, k, v, g, beta)
        _emit(s, q, o_ptr + (seq * v_heads + head) * dv + cols, col_ok)
        tl.store(tile, s, mask=col_ok[None, :])
