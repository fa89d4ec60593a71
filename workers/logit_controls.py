"""A step's sampling controls applied to its logits, for all controlled rows at once, in
vLLM's order: the masks (grammar, allowed_token_ids, bad_words, min_tokens) as one token
bitmask built on the host into one pinned buffer while the device runs the forward, copied
once and applied by one pass; then the bias; then the penalties, a few device ops. The state
each row needs is its sequence's SeqControls (workers/controls.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.controls import SeqControls, device_tensor
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
    row_idx, tok_idx, values = [], [], []
    for r in rows:
        for t, b in r.controls.params.logit_bias:
            row_idx.extend(range(r.first, r.first + r.num_rows))
            tok_idx.extend([t] * r.num_rows)
            values.extend([b] * r.num_rows)
    dev = logits.device
    logits.index_put_((device_tensor(row_idx, torch.long, dev),
                       device_tensor(tok_idx, torch.long, dev)),
                      device_tensor(values, logits.dtype, dev), accumulate=True)


def _apply_penalties(logits: torch.Tensor, rows: list[ControlRows]) -> None:
    """vLLM's formula per row: a token seen in the prompt or generated has its logit divided
    by repetition_penalty if positive, multiplied if not; then frequency_penalty × its
    generated count and presence_penalty × (count > 0) are subtracted. Row j's counts include
    the drafts before it."""
    dev, v = logits.device, logits.shape[-1]
    row_of, seq_of, extra_r, extra_t = [], [], [], []
    at = 0
    for s, r in enumerate(rows):
        row_of.extend(range(r.first, r.first + r.num_rows))
        seq_of.extend([s] * r.num_rows)
        for j in range(1, len(r.block)):  # row j counts the drafts d1..dj
            extra_r.extend([at + j] * j)
            extra_t.extend(r.block[1 : j + 1])
        at += r.num_rows
    seq_t = device_tensor(seq_of, torch.long, dev)
    counts = torch.stack([r.controls.counts for r in rows])[seq_t]  # [R, V]
    if extra_r:
        counts.index_put_((device_tensor(extra_r, torch.long, dev),
                           device_tensor(extra_t, torch.long, dev)),
                          torch.ones(len(extra_r), dtype=counts.dtype, device=dev),
                          accumulate=True)
    params = [r.controls.params for r in rows]
    per_row = device_tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                              for p in params], torch.float32, dev)[seq_t]  # [R, 3]
    rep, freq, pres = per_row.unbind(1)
    seen = counts > 0
    prompt = [r.controls.in_prompt if r.controls.in_prompt is not None
              else torch.zeros(v, dtype=torch.bool, device=dev) for r in rows]
    in_prompt_or_seen = torch.stack(prompt)[seq_t] | seen
    row_t = device_tensor(row_of, torch.long, dev)
    x = logits[row_t].float()
    rep = torch.where(in_prompt_or_seen, rep[:, None], 1.0)
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - freq[:, None] * counts - pres[:, None] * seen
    logits[row_t] = x.to(logits.dtype)
