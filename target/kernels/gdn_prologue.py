"""The Gated DeltaNet's elementwise work around the in-place recurrence
(gdn_slots.recurrent_slots) in a uniform round, in Triton (KernelConfig gdn_prologue "triton"):
before it one launch per layer, `conv_split_gates`; after it the gated output norm,
`gated_rms_norm`.

conv_split_gates, between the input projection and the recurrence: the causal
conv over each sequence's committed conv state (read by slot) and the round's inputs, its
SiLU, the split into q, k and v, q and k L2-normalised (q scaled by Dk^−½), and the gates
g = −e^A·softplus(a + dt_bias) and β = sigmoid(b). A decode (L = 1) also writes the new conv
state in place; a verify writes [state | inputs] for its commit instead. In torch the same
work is fused.gdn_gates and fused.conv_split_heads (five kernels on the H200, compiled) and,
for a decode, gdn_slots.commit_conv.

  Grid (S·L, Hk): program (s·L + l, h) computes token l of sequence s for key head h: its q
  and k channels and the channels of the Hv/Hk value heads that read that key head (value
  head j reads key head j // (Hv/Hk), as in gdn_slots), each from its own K-wide window.
  Tokens never depend on each other, so a token's bits are the same in a decode and inside a
  verify block, alone or in a batch.

Roundings are the eager reference's (gdn_torch.causal_conv_batched, fused.gdn_split_heads,
fused.gdn_gates): the conv's K products summed in fp32 in tap order, rounded to the model
dtype; SiLU in fp32, rounded; the norms in fp32, rounded once to the recurrence's dtype.

gated_rms_norm, between the recurrence and the output projection: per token and value head,
rms-normalise o in fp32, times the norm's weight, times silu(z), with fused.gated_rms_norm's
roundings, one program per (token, head) row. Compiled, that chain is one kernel too, whose
launch shape Inductor autotunes at its first call (in the engine a prefill's size) and keeps
for every size after it; in the H200's decode profile (docs/BENCHMARKS.md) it took 4.9 µs a
layer for a decode's 32 rows against 2.2 µs for a 16-token verify's 512 (that shape is the
likely cause, not a measured one). Here a decode's rows are 32 programs, a verify's 512, and
both rows compute alike (the same bits in a decode and inside a verify).

Triton is optional: without it this module imports and defines no kernel (KernelConfig
refuses the choice). On CPU tensors the kernel runs only in Triton's interpreter
(TRITON_INTERPRET=1 set before triton is first imported; tests/target/test_gdn_prologue.py runs it
in a child)."""

from __future__ import annotations

import torch

from target.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def conv_split_gates(x: torch.Tensor, conv_cache: torch.Tensor, slots: torch.Tensor,
                     weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     a_log: torch.Tensor, dt_bias: torch.Tensor, num_k_heads: int,
                     head_k_dim: int, num_v_heads: int, head_v_dim: int,
                     qk_dtype: torch.dtype, beta_dtype: torch.dtype
                     ) -> tuple[torch.Tensor, ...]:
    """x [S, L, C] the conv's inputs (C = 2·Hk·Dk + Hv·Dv, channels contiguous); conv_cache
    [N, C, K−1] read at slots [S]; weight [C, K]; a, b [S·L, Hv]; a_log, dt_bias [Hv].
    Returns q, k [S, L, Hk, Dk] in qk_dtype, v [S, L, Hv, Dv] in x's dtype, g [S, L, Hv]
    fp32, β [S, L, Hv] in beta_dtype, and (L > 1) conv_seq [S, C, K−1+L]: the committed state
    then the inputs, in x's dtype, for gdn_slots.commit_conv; with L = 1 (a decode, its token
    always kept) the new conv state is written to the cache instead and conv_seq is None."""
    n_seqs, width, channels = x.shape
    taps = weight.shape[1]
    key_dim, ratio = num_k_heads * head_k_dim, num_v_heads // num_k_heads
    assert channels == 2 * key_dim + num_v_heads * head_v_dim, (x.shape, key_dim)
    assert conv_cache.shape[1:] == (channels, taps - 1) and slots.shape == (n_seqs,)
    assert a.shape == b.shape == (n_seqs * width, num_v_heads), (a.shape, b.shape)
    assert x.stride(2) == 1 and a.stride(1) == 1 and b.stride(1) == 1
    dev = x.device
    q = torch.empty(n_seqs, width, num_k_heads, head_k_dim, dtype=qk_dtype, device=dev)
    k = torch.empty_like(q)
    v = torch.empty(n_seqs, width, num_v_heads, head_v_dim, dtype=x.dtype, device=dev)
    g = torch.empty(n_seqs, width, num_v_heads, dtype=torch.float32, device=dev)
    beta = torch.empty(n_seqs, width, num_v_heads, dtype=beta_dtype, device=dev)
    decode = width == 1
    conv_seq = None if decode else torch.empty(n_seqs, channels, taps - 1 + width,
                                               dtype=x.dtype, device=dev)
    if n_seqs * width == 0:
        return q, k, v, g, beta, conv_seq
    if not x.is_cuda and not _interpreted():
        raise RuntimeError("conv_split_gates on CPU tensors runs in Triton's interpreter "
                           "only: set TRITON_INTERPRET=1 before anything imports triton")
    seq = conv_seq if conv_seq is not None else x  # (unwritten in a decode)
    _prologue_kernel[(n_seqs * width, num_k_heads)](
        x, conv_cache, slots.contiguous(), weight, a, b, a_log, dt_bias,
        q, k, v, g, beta, seq, width, key_dim, head_k_dim ** -0.5,
        x.stride(0), x.stride(1), *conv_cache.stride(), *weight.stride(),
        a.stride(0), b.stride(0), *seq.stride(),
        K=taps, DK=head_k_dim, DV_GROUP=ratio * head_v_dim, RATIO=ratio,
        BLOCK_K=triton.next_power_of_2(head_k_dim),
        BLOCK_V=triton.next_power_of_2(ratio * head_v_dim),
        BLOCK_R=triton.next_power_of_2(ratio), WRITE_STATE=decode, num_warps=4, **pdl.options(x))
    return q, k, v, g, beta, conv_seq


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, weight: torch.Tensor,
                   eps: float) -> torch.Tensor:
    """o [T, H, D] (the recurrence's output, any strides); z [T, H, D] (any strides, its last
    dim contiguous: a view of the input projection); weight [D]. Returns [T, H·D] in o's
    dtype: fused.gated_rms_norm(o, z, weight, eps), flattened over the heads."""
    tokens, heads, dim = o.shape
    assert z.shape == o.shape and weight.shape == (dim,), (o.shape, z.shape, weight.shape)
    assert o.stride(2) == 1 and z.stride(2) == 1, (o.stride(), z.stride())
    out = torch.empty(tokens, heads * dim, dtype=o.dtype, device=o.device)
    if tokens * heads == 0:
        return out
    if not o.is_cuda and not _interpreted():
        raise RuntimeError("gated_rms_norm on CPU tensors runs in Triton's interpreter only: "
                           "set TRITON_INTERPRET=1 before anything imports triton")
    block = triton.next_power_of_2(dim)
    _gated_norm_kernel[(tokens * heads,)](
        o, z, weight, out, heads, dim, eps, o.stride(0), o.stride(1), z.stride(0), z.stride(1),
        BLOCK_D=block, num_warps=max(1, min(4, block // 128)), **pdl.options(o))
    return out


def _interpreted() -> bool:
    return triton is not None and not isinstance(_prologue_kernel, triton.runtime.JITFunction)


if triton is not None:
    from target.kernels.pdl import await_prior

    @triton.jit
    def _conv_silu(x_row, cache_row, w_ptr, seq_row, ch, ch_ok, tok, stride_xl, stride_cc,
                   stride_ck, stride_wc, stride_wk, stride_qc, stride_qk,
                   K: tl.constexpr, WRITE_STATE: tl.constexpr):
        """silu(conv) of token `tok` on channels `ch`, in x's dtype. The window's tap j is
        position tok + j of [state (K−1) | inputs]. A decode writes the state's shift in place
        (tap j's value to state position j − 1, after tap j is read); otherwise the window's
        values go to seq (a token its own input; token 0 the state's too)."""
        acc = tl.zeros(ch.shape, dtype=tl.float32)
        for j in tl.static_range(K):
            pos = tok + j
            in_state = pos < K - 1
            from_state = tl.load(cache_row + ch * stride_cc + pos * stride_ck,
                                 mask=ch_ok & in_state, other=0.0)
            from_x = tl.load(x_row + (pos - (K - 1)) * stride_xl + ch,
                             mask=ch_ok & (pos >= K - 1), other=0.0)
            val = tl.where(in_state, from_state.to(from_x.dtype), from_x)
            acc += val.to(tl.float32) * tl.load(w_ptr + ch * stride_wc + j * stride_wk,
                                                mask=ch_ok, other=0.0).to(tl.float32)
            if WRITE_STATE:
                if j >= 1:
                    tl.store(cache_row + ch * stride_cc + (j - 1) * stride_ck,
                             val.to(cache_row.dtype.element_ty), mask=ch_ok)
            else:
                tl.store(seq_row + ch * stride_qc + pos * stride_qk, val,
                         mask=ch_ok & ((tok == 0) | (j == K - 1)))
        out = acc.to(x_row.dtype.element_ty).to(tl.float32)
        return (out / (1.0 + tl.exp(-out))).to(x_row.dtype.element_ty)

    @triton.jit
    def _prologue_kernel(x_ptr, cache_ptr, slots_ptr, w_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr,
                         q_ptr, k_ptr, v_ptr, g_ptr, beta_ptr, seq_ptr,
                         width, key_dim, q_scale,
                         stride_xs, stride_xl, stride_cn, stride_cc, stride_ck,
                         stride_wc, stride_wk, stride_at, stride_bt,
                         stride_qs, stride_qc, stride_qk,
                         K: tl.constexpr, DK: tl.constexpr, DV_GROUP: tl.constexpr,
                         RATIO: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
                         BLOCK_R: tl.constexpr, WRITE_STATE: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        t = tl.program_id(0).to(tl.int64)  # the token: s·L + tok
        head = tl.program_id(1)
        s, tok = t // width, t % width
        slot = tl.load(slots_ptr + s).to(tl.int64)
        x_row = x_ptr + s * stride_xs  # the sequence's first input: window position K−1
        cache_row = cache_ptr + slot * stride_cn
        seq_row = seq_ptr + s * stride_qs
        num_k_heads = tl.num_programs(1)
        d = tl.arange(0, BLOCK_K)
        d_ok = d < DK
        q = _conv_silu(x_row, cache_row, w_ptr, seq_row, head * DK + d, d_ok, tok, stride_xl,
                       stride_cc, stride_ck, stride_wc, stride_wk, stride_qc, stride_qk,
                       K, WRITE_STATE).to(tl.float32)
        k = _conv_silu(x_row, cache_row, w_ptr, seq_row, key_dim + head * DK + d, d_ok, tok,
                       stride_xl, stride_cc, stride_ck, stride_wc, stride_wk, stride_qc,
                       stride_qk, K, WRITE_STATE).to(tl.float32)
        dv = tl.arange(0, BLOCK_V)
        dv_ok = dv < DV_GROUP
        v = _conv_silu(x_row, cache_row, w_ptr, seq_row, 2 * key_dim + head * DV_GROUP + dv,
                       dv_ok, tok, stride_xl, stride_cc, stride_ck, stride_wc, stride_wk,
                       stride_qc, stride_qk, K, WRITE_STATE)
        q = q * tl.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * q_scale
        k = k * tl.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
        qk_at = (t * num_k_heads + head) * DK + d  # [S, L, Hk, Dk] contiguous
        tl.store(q_ptr + qk_at, q.to(q_ptr.dtype.element_ty), mask=d_ok)
        tl.store(k_ptr + qk_at, k.to(k_ptr.dtype.element_ty), mask=d_ok)
        tl.store(v_ptr + (t * num_k_heads + head) * DV_GROUP + dv, v, mask=dv_ok)
        # the gates of this key head's value heads
        hv = head * RATIO + tl.arange(0, BLOCK_R)
        hv_ok = tl.arange(0, BLOCK_R) < RATIO
        a = tl.load(a_ptr + t * stride_at + hv, mask=hv_ok, other=0.0).to(tl.float32)
        a = a + tl.load(dtb_ptr + hv, mask=hv_ok, other=0.0).to(tl.float32)
        # softplus as torch's: a past 20, else log1p(e^a) (log(u)·e/(u − 1), u = 1 + e: a few
        # ulps where log(1 + e) alone would lose e's digits)
        e = tl.exp(a)
        u = 1.0 + e
        softplus = tl.where(a > 20.0, a, tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0))))
        g = -tl.exp(tl.load(alog_ptr + hv, mask=hv_ok, other=0.0).to(tl.float32)) * softplus
        b = tl.load(b_ptr + t * stride_bt + hv, mask=hv_ok, other=0.0).to(tl.float32)
        at = t * num_k_heads * RATIO + hv  # [S, L, Hv] contiguous
        tl.store(g_ptr + at, g, mask=hv_ok)
        tl.store(beta_ptr + at, (1.0 / (1.0 + tl.exp(-b))).to(beta_ptr.dtype.element_ty),
                 mask=hv_ok)

    @triton.jit
    def _gated_norm_kernel(o_ptr, z_ptr, w_ptr, out_ptr, heads, dim, eps, stride_ot, stride_oh,
                           stride_zt, stride_zh, BLOCK_D: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        row = tl.program_id(0)  # token · H + head
        t, h = (row // heads).to(tl.int64), row % heads
        d = tl.arange(0, BLOCK_D)
        ok = d < dim
        x = tl.load(o_ptr + t * stride_ot + h * stride_oh + d, mask=ok, other=0.0)
        dtype = x.dtype
        xf = x.to(tl.float32)
        # as fused.gated_rms_norm: the norm in fp32, rounded; times the weight, rounded; times
        # silu(z) in fp32, rounded once
        hn = (xf * tl.rsqrt(tl.sum(xf * xf, axis=0) / dim + eps)).to(dtype).to(tl.float32)
        w = tl.load(w_ptr + d, mask=ok, other=0.0).to(tl.float32)
        hw = (w * hn).to(dtype).to(tl.float32)
        zf = tl.load(z_ptr + t * stride_zt + h * stride_zh + d, mask=ok, other=0.0).to(tl.float32)
        y = hw * (zf / (1.0 + tl.exp(-zf)))
        tl.store(out_ptr + row.to(tl.int64) * dim + d, y.to(dtype), mask=ok)
