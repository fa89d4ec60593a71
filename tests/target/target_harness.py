"""Small drivers for the target model in tests: caches + a runner, and a transformers oracle."""

from __future__ import annotations

import torch

from configs.engine import SamplingParams
from target.loader import load_target
from workers.cache import allocate_target_caches
from workers.model_runner import ModelRunner, SeqInput

PAGE = 4


class TargetHarness:
    def __init__(self, model_dir, aux_layer_ids=(), num_blocks=256, num_slots=8,
                 dtype=torch.float32):
        self.model = load_target(model_dir, dtype=dtype)
        self.caches = allocate_target_caches(self.model, num_blocks, PAGE, num_slots, "cpu")
        self.runner = ModelRunner(self.model, self.caches, tuple(aux_layer_ids), "cpu")
        self.next_block = 0

    def pages(self, n_positions: int) -> list[int]:
        # Interleaved, non-contiguous page ids so paging bugs cannot hide.
        n = -(-n_positions // PAGE)
        table = [(self.next_block + 7 * i) % 256 for i in range(n)]
        self.next_block += 1
        return table

    def seq(self, seq_id, tokens, start, table, slot) -> SeqInput:
        return SeqInput(seq_id, list(tokens), start, table, slot, SamplingParams())

    @torch.inference_mode()
    def logits(self, seqs: list[SeqInput], verify: bool) -> list[torch.Tensor]:
        batch = self.runner._batch(seqs, is_verify=verify)
        hidden, _ = self.model(batch, self.caches)
        logits = self.model.compute_logits(hidden)
        cu = batch.cu_seqlens
        self.last_batch = batch
        return [logits[cu[i] : cu[i + 1]] for i in range(len(seqs))]

    def commit(self, kept: list[int]) -> None:
        self.model.commit_verify(self.last_batch, self.caches, kept)


@torch.inference_mode()
def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0].float()
