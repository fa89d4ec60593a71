"""The sampling penalties (repetition, frequency, presence) of a step's penalized rows in one
Triton kernel, in place on the logits.

vLLM's formula per row, in its order: a token seen in the prompt or generated has its logit
divided by the repetition penalty where positive, multiplied where not; then the frequency
penalty × the token's generated count and the presence penalty × (count > 0) are subtracted.
A verify round's row j predicts the token after the drafts d1..dj, so its counts are the
sequence's plus those drafts. The torch form (workers/logit_controls.py `_penalize_torch`, the
CPU path and the reference the GPU test compares with) materialises each row's counts, prompt
and factors as [rows, V] tensors: some twenty passes over rows × V, 6–11 % of a 35B-A3B verify
round on an H100 (docs/BENCHMARKS.md). Here one program reads a block of one row's logits with
its sequence's counts and prompt flags, adds the row's drafts to the counts by comparing the
block's token ids with them (at most the block size of compares per element), and writes the
penalized logits back: one read and one write of each penalized row.

The same bits as the torch form: the same fp32 operations in the same order, the division
correctly rounded (`div_rn`), no multiply-add contracted into one rounding
(`enable_fp_fusion=False`), the result cast back to the logits' dtype.

Triton is optional, as in moe_triton.py: on CPU tensors the kernel runs only in Triton's
interpreter (TRITON_INTERPRET=1 set before triton is first imported)."""

from __future__ import annotations

import torch

from target.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

BLOCK_V = 2048


def penalize(logits: torch.Tensor, table: torch.Tensor, counts: torch.Tensor,
             in_prompt: torch.Tensor | None, params: torch.Tensor) -> None:
    """logits [T, V] (fp32, bf16 or fp16, rows contiguous) penalized in place, the rows that
    `table` names only. table [R, 2 + K] int32: per penalized row its row in logits, its
    sequence (an index into counts, in_prompt and params) and the K drafts its counts add
    (-1 where fewer). counts [S, V] int32: each sequence's generated-token counts. in_prompt
    [S, V] bool or None (no sequence has a repetition penalty): the prompt's tokens.
    params [S, 3] fp32: repetition, frequency and presence penalties."""
    if triton is None:
        raise RuntimeError("penalize needs triton")
    rows, width = table.shape
    vocab = logits.shape[-1]
    if rows == 0:
        return
    if not logits.is_cuda and not _interpreted():
        raise RuntimeError("penalize on CPU tensors runs in Triton's interpreter only: set "
                           "TRITON_INTERPRET=1 before anything imports triton")
    if logits.stride(-1) != 1 or counts.stride(-1) != 1:
        raise ValueError("penalize needs rows of logits and counts contiguous")
    prompt = in_prompt if in_prompt is not None else counts  # not read without HAS_PROMPT
    drafts = width - 2
    _penalize_kernel[(rows, triton.cdiv(vocab, BLOCK_V))](
        logits, table, counts, prompt, params, vocab, logits.stride(0), width,
        counts.stride(0), prompt.stride(0), DRAFTS=drafts,
        HAS_PROMPT=in_prompt is not None, BLOCK=BLOCK_V, num_warps=4,
        enable_fp_fusion=False, **pdl.options(logits))


def _interpreted() -> bool:
    return triton is not None and not isinstance(_penalize_kernel, triton.runtime.JITFunction)


if triton is not None:
    from target.kernels.pdl import await_prior

    @triton.jit
    def _penalize_kernel(logits_ptr, table_ptr, counts_ptr, prompt_ptr, params_ptr, vocab,
                         stride_logits, width, stride_counts, stride_prompt,
                         DRAFTS: tl.constexpr, HAS_PROMPT: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        await_prior(PDL)
        r = tl.program_id(0)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = offs < vocab
        row = tl.load(table_ptr + r * width).to(tl.int64)
        seq = tl.load(table_ptr + r * width + 1).to(tl.int64)
        counts = tl.load(counts_ptr + seq * stride_counts + offs, mask=inside, other=0)
        for k in tl.static_range(DRAFTS):
            draft = tl.load(table_ptr + r * width + 2 + k)
            counts += (offs == draft).to(tl.int32)
        seen = counts > 0
        hit = seen
        if HAS_PROMPT:
            hit = hit | (tl.load(prompt_ptr + seq * stride_prompt + offs, mask=inside,
                                 other=0) != 0)
        repetition = tl.load(params_ptr + seq * 3)
        frequency = tl.load(params_ptr + seq * 3 + 1)
        presence = tl.load(params_ptr + seq * 3 + 2)
        at = logits_ptr + row * stride_logits + offs
        raw = tl.load(at, mask=inside, other=0.0)
        x = raw.to(tl.float32)
        factor = tl.where(hit, repetition, 1.0)
        x = tl.where(x > 0, tl.math.div_rn(x, factor), x * factor)
        x = x - frequency * counts.to(tl.float32)
        x = x - presence * seen.to(tl.float32)
        tl.store(at, x.to(raw.dtype), mask=inside)
