"""Small drivers for the target model in tests: caches + a runner, and a transformers oracle."""

from __future__ import annotations

import torch

from configs.engine import SamplingParams
from target.loader import load_target
from workers.cache import allocate_target_caches
from workers.model_runner import ModelRunner, SeqInput

PAGE_SIZE = 4


class TargetHarness:
    def __init__(self, model_dir, aux_layer_ids=(), num_pages=256, num_slots=8,
                 dtype=torch.float32):
        self.model = load_target(model_dir, dtype=dtype)
        self.caches = allocate_target_caches(self.model, num_pages, PAGE_SIZE, num_slots, "cpu")
        self.runner = ModelRunner(self.model, self.caches, tuple(aux_layer_ids), "cpu")
        self.next_block = 0

    def pages(self, n_positions: int) -> list[int]:
        # Interleaved, non-contiguous page ids so paging bugs cannot hide.
        n = -(-n_positions // PAGE_SIZE)
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

    def commit(self, kept: list[int], tap_slots: list[int] | None = None,
               tap_ends: list[int] | None = None) -> None:
        taps = (None, None) if tap_slots is None else (torch.tensor(tap_slots),
                                                      torch.tensor(tap_ends))
        self.model.commit_verify(self.last_batch, self.caches, kept, *taps)


@torch.inference_mode()
def kernel_rounds(model_dir, kernels: dict, module, fn: str):
    """The tiny target in fp16 (a Triton kernel test's interpreter child): a prefill of 30
    tokens, then a verify block of 6 and a one-token decode, under each of `kernels`
    (name: KernelConfig; each from a fresh state slot). Returns each name's logits (the
    prefill's last row, the block's, the decode's; fp32), the row counts of the calls to
    `module.fn` meanwhile (the kernel under test, counted where the layers look it up), and
    the model (its layers as the last config set them)."""
    h = TargetHarness(model_dir, dtype=torch.float16)
    prompt, block = list(range(3, 93, 3)), [5, 9, 11, 2, 7, 30]
    out, rows = {}, []
    real = getattr(module, fn)

    def counted(x, *args, **kwargs):
        rows.append(x.shape[0])
        return real(x, *args, **kwargs)

    setattr(module, fn, counted)
    try:
        for slot, (name, config) in enumerate(kernels.items()):
            h.model.set_kernels(config, graphs=False)
            table = h.pages(64)
            prefill = h.logits([h.seq(0, prompt, 0, table, slot)], verify=False)[0]
            verify = h.logits([h.seq(0, block, len(prompt), table, slot)], verify=True)[0]
            decode = h.logits([h.seq(0, block[:1], len(prompt), table, slot)], verify=False)[0]
            out[name] = torch.cat([prefill[-1:], verify, decode]).float()
    finally:
        setattr(module, fn, real)
    return out, rows, h.model


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    return hf_model(torch.tensor([tokens])).logits[0].float()
