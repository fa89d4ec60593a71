"""A step's sampling controls applied to its logits, for all controlled rows at once, in
vLLM's order: the masks (grammar, allowed_token_ids, bad_words, min_tokens) as one token
bitmask built on the host into one pinned buffer while the device runs the forward, copied
once and applied by one pass; then the bias; then the penalties, one kernel on CUDA. The state
each row needs is its sequence's SeqControls (workers/controls.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from target.kernels import penalties
from workers.controls import SeqControls, count_tokens, device_tensor
from workers.grammar import GrammarError
from workers.token_bitmask import bitmask_words, unpack_bits


@dataclass(frozen=True)
class ControlRows:
    """A controlled sequence's rows in a step's logits: `first` and the block's tokens
    ([anchor, d1 … dK], one row each; [] for a prefill's sampled row)."""

    index: int  # the sequence's index in the step
    controls: SeqControls
    first: int
    block: list[int]

    @property
    def num_rows(self) -> int:
        return max(len(self.block), 1)


def apply_controls(logits: torch.Tensor, rows: list[ControlRows]) -> dict[int, str]:
    """Applies each sequence's controls to its rows of logits [T, V] in place; returns {index:
    why} for the sequences whose controls failed (a grammar that did not compile), whose rows
    are left as they were."""
    errors: dict[int, str] = {}
    masked, biased, penalized = [], [], []
    for r in rows:
        p = r.controls.params
        try:
            if r.controls.masks:
                r.controls.matcher()  # a compile error surfaces here, for this sequence
                masked.append(r)
        except GrammarError as e:
            errors[r.index] = f"GrammarError: {e}"
            continue
        if p.logit_bias:
            biased.append(r)
        if p.has_penalties:
            penalized.append(r)
    if masked:
        _apply_masks(logits, masked, errors)
    if biased:
        _apply_bias(logits, biased)
    if penalized:
        _apply_penalties(logits, penalized)
    return errors


def _apply_masks(logits: torch.Tensor, rows: list[ControlRows], errors: dict[int, str]) -> None:
    words = bitmask_words(logits.shape[-1])
    total = sum(r.num_rows for r in rows)
    host = torch.full((total, words), -1, dtype=torch.int32,
                      pin_memory=logits.is_cuda)
    index, at = [], 0
    for r in rows:
        try:
            r.controls.fill_masks(r.block, host[at : at + r.num_rows])
        except Exception as e:  # noqa: BLE001 — this sequence fails alone
            errors[r.index] = f"{type(e).__name__}: {e}"
            host[at : at + r.num_rows] = -1
        index.extend(range(r.first, r.first + r.num_rows))
        at += r.num_rows
    index_t = device_tensor(index, torch.long, logits.device)
    allowed = unpack_bits(host.to(logits.device, non_blocking=True), logits.shape[-1])
    logits[index_t] = logits[index_t].masked_fill(~allowed, float("-inf"))


def _apply_bias(logits: torch.Tensor, rows: list[ControlRows]) -> None:
    """One index_add over the flattened logits; a token named twice has its biases summed
    first, so no element is added to twice and the sum is the same every run."""
    flat, values = [], []
    v = logits.shape[-1]
    for r in rows:
        bias: dict[int, float] = {}
        for t, b in r.controls.params.logit_bias:
            bias[t] = bias.get(t, 0.0) + b
        for row in range(r.first, r.first + r.num_rows):
            flat.extend(row * v + t for t in bias)
            values.extend(bias.values())
    dev = logits.device
    logits.view(-1).index_add_(0, device_tensor(flat, torch.long, dev),
                               device_tensor(values, logits.dtype, dev))


def _apply_penalties(logits: torch.Tensor, rows: list[ControlRows]) -> None:
    """vLLM's formula per row: a token seen in the prompt or generated has its logit divided
    by repetition_penalty if positive, multiplied if not; then frequency_penalty × its
    generated count and presence_penalty × (count > 0) are subtracted. Row j's counts include
    the drafts before it. By the kernel the sequences' ControlsEnv names: Triton's
    (target/kernels/penalties.py) or `_penalize_torch`, the same bits."""
    dev, v = logits.device, logits.shape[-1]
    drafts = max(r.num_rows for r in rows) - 1
    table = []  # per row: its logits row, its sequence, the drafts its counts add (-1 pads)
    for s, r in enumerate(rows):
        for j in range(r.num_rows):
            table.append([r.first + j, s, *r.block[1 : j + 1]] + [-1] * (drafts - j))
    table_t = device_tensor(table, torch.int32, dev)
    count_tokens([r.controls for r in rows])
    counts = torch.stack([r.controls.counts() for r in rows])  # [S, V] int32
    in_prompt = None
    if any(r.controls.in_prompt is not None for r in rows):
        in_prompt = torch.stack([r.controls.in_prompt if r.controls.in_prompt is not None
                                 else torch.zeros(v, dtype=torch.bool, device=dev)
                                 for r in rows])
    params = device_tensor([[r.controls.params.repetition_penalty,
                             r.controls.params.frequency_penalty,
                             r.controls.params.presence_penalty] for r in rows],
                           torch.float32, dev)
    if rows[0].controls.env.penalties == "triton":
        penalties.penalize(logits, table_t, counts, in_prompt, params)
    else:
        _penalize_torch(logits, table_t, counts, in_prompt, params)


def _penalize_torch(logits: torch.Tensor, table: torch.Tensor, counts: torch.Tensor,
                    in_prompt: torch.Tensor | None, params: torch.Tensor) -> None:
    """penalties.penalize's arguments and result, with each row's counts, prompt flags and
    factors as [rows, V] tensors: the CPU path and the reference."""
    table = table.long()
    row_t, seq_t, drafts = table[:, 0], table[:, 1], table[:, 2:]
    counts = counts[seq_t]  # [R, V]
    if drafts.shape[1]:
        counts.scatter_add_(1, drafts.clamp(min=0), (drafts >= 0).to(counts.dtype))
    rep, freq, pres = params[seq_t].unbind(1)
    seen = counts > 0
    hit = seen if in_prompt is None else in_prompt[seq_t] | seen
    x = logits[row_t].float()
    rep = torch.where(hit, rep[:, None], 1.0)
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - freq[:, None] * counts - pres[:, None] * seen
    logits[row_t] = x.to(logits.dtype)
