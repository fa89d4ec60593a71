"""The draft side of a round: keep the draft's context KV in step with committed tokens and
propose a block per sequence. Shares page ids (block tables) with the target: the draft's
context KV for position p lives in the same page/offset of its own pool."""

from __future__ import annotations

from collections.abc import Callable

import torch

from draft.model import DFlashDraftModel


class DraftRunner:
    def __init__(self, model: DFlashDraftModel, num_blocks: int, page_size: int, block_size: int,
                 embed: Callable[[torch.Tensor], torch.Tensor],
                 lm_head: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str):
        self.model = model
        self.page_size = page_size
        self.block_size = block_size  # B: anchor + B−1 proposed tokens
        self.embed = embed
        self.lm_head = lm_head
        self.device = torch.device(device)
        self.kv_cache = model.allocate_kv_cache(num_blocks, page_size)

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    @torch.inference_mode()
    def write_context(self, aux: torch.Tensor, positions: torch.Tensor,
                      block_tables: list[list[int]], counts: list[int]) -> None:
        """aux [N, n_aux·H] of committed tokens, `counts[i]` of them for sequence i, in order."""
        # Tensor ops on the host copy of the positions, not per-token Python (prefill chunks).
        pos = positions.cpu().long()  # [N]
        width = max(len(t) for t in block_tables)
        tables = torch.zeros(len(block_tables), width, dtype=torch.long)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        seq_of = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        page = self.page_size
        slots = tables[seq_of, pos // page] * page + pos % page
        slot_mapping = slots.to(self.device)
        self.model.write_context(aux.to(self.device), positions.to(self.device), slot_mapping,
                                 self.kv_cache)

    @torch.inference_mode()
    def propose(self, anchors: list[int], context_lens: list[int],
                block_tables: list[list[int]]) -> torch.Tensor:
        """Returns [S, B−1] proposed tokens (argmax at every temperature)."""
        # Only the pages holding context and the block: their count bounds the attention's
        # gather width (and holds the block's slots where the flex path writes its K/V).
        width = -(-(max(context_lens) + self.block_size) // self.page_size)
        tables = torch.zeros(len(anchors), width, dtype=torch.int32)
        for i, t in enumerate(block_tables):
            t = t[:width]
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
        return self.model.propose(
            torch.tensor(anchors, dtype=torch.long, device=self.device),
            torch.tensor(context_lens, dtype=torch.long, device=self.device),
            tables.to(self.device), self.kv_cache, self.embed, self.lm_head, self.block_size,
        )
