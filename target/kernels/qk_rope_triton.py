"""Full attention's prologue as one Triton launch per layer: the per-head q and k norms
(Qwen3.5's zero-centred RMSNorm), NeoX RoPE on the first rotary_dim dims of q and k, and the
new keys and values written into their KV-cache pages by slot. In torch the same work is the
compiled fused.qk_norm_rope (six kernels for q and k on the H200: a reduction and two
pointwise kernels each) and attention.store_kv's two index_copy_ launches.

Grid (T, Hq + Hkv): program (t, h) normalises and rotates token t's head h, a q head
(h < Hq, written to the returned q) or a kv head (its k row, and the matching v row, written
to the caches at slot_mapping[t]).

Roundings are the eager reference's (fused.rms_norm then fused.rope in the model dtype): the
norm in fp32, rounded to the dtype; each RoPE product rounded, then their sum, as separate
tensor ops in that dtype round (a product of two half values is exact in fp32, so computing
it there and rounding once is that op). Only the mean of squares sums in another order. The
kernel compiles with enable_fp_fusion off: with it, the sum of two rounded products became
one fused multiply-add on the GPU (the first product's rounding gone), and 4–15 % of the
rotated bf16 elements of the tests' shapes came out one or more spacings from the eager ops'
(and from the compiled torch chain, which matches them bit for bit); on an H100 (sm90) both
were measured, and without fusion the tests pass bit for bit (docs/BENCHMARKS.md).

Triton is optional: without it this module imports and defines no kernel (KernelConfig
refuses the choice). On CPU tensors the kernel runs only in Triton's interpreter
(TRITON_INTERPRET=1 set before triton is first imported; tests/target/test_qk_rope_triton.py runs it
in a child)."""

from __future__ import annotations

import torch

from target.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                       cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
                       k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor) -> torch.Tensor:
    """q [T, Hq, D], k and v [T, Hkv, D] (any strides, last dim contiguous); the norms'
    weights [D]; cos, sin [T, 1, rotary_dim] fp32; the caches [num_pages, page_size, Hkv, D],
    written at the flat slot slot_mapping[t] (page · page_size + offset, as store_kv). Returns q
    normed and rotated, [T, Hq, D] in q's dtype."""
    tokens, num_q_heads, dim = q.shape
    num_kv_heads = k.shape[1]
    assert k.shape == v.shape == (tokens, num_kv_heads, dim), (k.shape, v.shape)
    assert k_cache.shape[2:] == v_cache.shape[2:] == (num_kv_heads, dim), k_cache.shape
    assert q.stride(2) == k.stride(2) == v.stride(2) == 1, "head dims must be contiguous"
    assert rotary_dim % 2 == 0 and rotary_dim <= dim, rotary_dim
    out = torch.empty(tokens, num_q_heads, dim, dtype=q.dtype, device=q.device)
    if tokens == 0:
        return out
    if not q.is_cuda and not _interpreted():
        raise RuntimeError("qk_norm_rope_store on CPU tensors runs in Triton's interpreter "
                           "only: set TRITON_INTERPRET=1 before anything imports triton")
    k_rows = k_cache.view(-1, num_kv_heads, dim)  # [slots, Hkv, D]
    v_rows = v_cache.view(-1, num_kv_heads, dim)
    _qk_norm_rope_kernel[(tokens, num_q_heads + num_kv_heads)](
        q, k, v, q_weight, k_weight, cos, sin, slot_mapping, out, k_rows, v_rows,
        num_q_heads, eps, q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), cos.stride(0), sin.stride(0), out.stride(0),
        out.stride(1), k_rows.stride(0), k_rows.stride(1), v_rows.stride(0),
        v_rows.stride(1),
        DIM=dim, BLOCK_D=triton.next_power_of_2(dim), ROTARY=rotary_dim, num_warps=1,
        enable_fp_fusion=False, **pdl.options(q))
    return out


def _interpreted() -> bool:
    return triton is not None and not isinstance(_qk_norm_rope_kernel, triton.runtime.JITFunction)


if triton is not None:
    from target.kernels.pdl import await_prior

    @triton.jit
    def _qk_norm_rope_kernel(q_ptr, k_ptr, v_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, slot_ptr,
                             out_ptr, kc_ptr, vc_ptr, num_q_heads, eps,
                             stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                             stride_cos, stride_sin, stride_ot, stride_oh,
                             stride_kcs, stride_kch, stride_vcs, stride_vch,
                             DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROTARY: tl.constexpr,
                             PDL: tl.constexpr):
        await_prior(PDL)
        t = tl.program_id(0).to(tl.int64)
        h = tl.program_id(1)
        is_q = h < num_q_heads
        kv_head = h - num_q_heads
        if is_q:
            src = q_ptr + t * stride_qt + h * stride_qh
            w_ptr = qw_ptr
        else:
            src = k_ptr + t * stride_kt + kv_head * stride_kh
            w_ptr = kw_ptr
        d = tl.arange(0, BLOCK_D)
        d_ok = d < DIM
        x = tl.load(src + d, mask=d_ok, other=0.0)
        dtype = x.dtype
        xf = x.to(tl.float32)
        inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / DIM + eps)
        y = xf * inv * (1.0 + tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32))
        y = y.to(dtype).to(tl.float32)  # rms_norm's output, in the model dtype
        # RoPE's partner element (rotate_half): the other half of the rotary dims, negated
        # for the first half; the norm recomputed there from its own load.
        half: tl.constexpr = ROTARY // 2
        rot = d < ROTARY
        partner = tl.where(d < half, d + half, d - half)
        xp = tl.load(src + partner, mask=rot, other=0.0).to(tl.float32)
        yp = xp * inv * (1.0 + tl.load(w_ptr + partner, mask=rot, other=0.0).to(tl.float32))
        yp = yp.to(dtype).to(tl.float32)
        yp = tl.where(d < half, -yp, yp)
        c = tl.load(cos_ptr + t * stride_cos + d, mask=rot, other=0.0).to(dtype).to(tl.float32)
        s = tl.load(sin_ptr + t * stride_sin + d, mask=rot, other=0.0).to(dtype).to(tl.float32)
        a = (y * c).to(dtype).to(tl.float32)
        b = (yp * s).to(dtype).to(tl.float32)
        out = tl.where(rot, (a + b).to(dtype), y.to(dtype))
        if is_q:
            tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out, mask=d_ok)
        else:
            slot = tl.load(slot_ptr + t).to(tl.int64)
            tl.store(kc_ptr + slot * stride_kcs + kv_head * stride_kch + d,
                     out.to(kc_ptr.dtype.element_ty), mask=d_ok)
            v = tl.load(v_ptr + t * stride_vt + kv_head * stride_vh + d, mask=d_ok, other=0.0)
            tl.store(vc_ptr + slot * stride_vcs + kv_head * stride_vch + d,
                     v.to(vc_ptr.dtype.element_ty), mask=d_ok)
