"""The DFlash draft as its own Ray actor, colocated with TP rank 0 (a fractional GPU of the
same bundle). It loads the target's embedding and lm_head itself: the draft embeds its block
and reads its logits through them."""

from __future__ import annotations

import torch

from configs.engine import EngineConfig
from draft.model import DFlashDraftModel
from draft.proposer import DraftRunner
from target.loader import load_embedding_and_head


class DraftWorker:
    def __init__(self, cfg: EngineConfig, num_kv_blocks: int, block_size: int):
        device = torch.device("cuda", 0) if cfg.device.startswith("cuda") else torch.device("cpu")
        model = DFlashDraftModel.from_pretrained(cfg.draft_model, dtype=cfg.torch_dtype,
                                                 device=device, block_size=block_size)
        embed, head = load_embedding_and_head(cfg.model, cfg.torch_dtype, device)
        self.runner = DraftRunner(model, num_kv_blocks, cfg.kv_block_size, block_size, embed,
                                  lambda h: head(h).float(), device)

    def propose(self, anchors: list[int], context_lens: list[int],
                block_tables: list[list[int]]) -> torch.Tensor:
        return self.runner.propose(anchors, context_lens, block_tables).cpu()

    def write_context(self, aux: torch.Tensor, positions: torch.Tensor,
                      block_tables: list[list[int]], counts: list[int]) -> None:
        self.runner.write_context(aux, positions, block_tables, counts)

    def ping(self) -> bool:
        return True
