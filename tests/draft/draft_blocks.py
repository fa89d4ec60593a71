"""A draft proposal through whatever block attention the model has (test_attention_triton.py
compares the Triton path, block K/V written into the block's own cache slots, with the
gathering path): 4 sequences of random context features on scattered pages."""

from __future__ import annotations

import torch

PAGE_SIZE, NUM_PAGES = 4, 64
CONTEXT_LENS = [3, 9, 14, 6]


def layout(block: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_PAGES, generator=g)
    width = -(-(max(CONTEXT_LENS) + block) // PAGE_SIZE)
    tables = torch.zeros(len(CONTEXT_LENS), width, dtype=torch.int32)
    used = 0
    for s, n in enumerate(CONTEXT_LENS):
        pages = -(-(n + block) // PAGE_SIZE)  # context + block, as a sequence reserves
        tables[s, :pages] = perm[used : used + pages].to(torch.int32)
        used += pages
    return tables


@torch.inference_mode()
def proposal_logits(model, block, with_cache=False):
    """The proposal logits of 4 sequences (CONTEXT_LENS of random context features, scattered
    pages) through the model's current block attention. with_cache: also the cache, the
    context slots and their K/V as written before the proposal."""
    g = torch.Generator().manual_seed(block)
    vocab, hidden = 400, model.cfg.hidden_size
    embed_w = torch.randn(vocab, hidden, generator=g)
    head_w = torch.randn(vocab, hidden, generator=g) * 0.2
    def embed(ids):
        return torch.nn.functional.embedding(ids, embed_w)

    def head(h):
        return h @ head_w.T

    tables = layout(block, seed=block)
    pos = torch.cat([torch.arange(n) for n in CONTEXT_LENS])
    slots = torch.cat([tables[s].long()[torch.arange(n) // PAGE_SIZE] * PAGE_SIZE
                       + torch.arange(n) % PAGE_SIZE for s, n in enumerate(CONTEXT_LENS)])
    features = torch.randn(len(pos), model.cfg.aux_hidden_size, generator=g)
    cache = model.allocate_kv_cache(NUM_PAGES, PAGE_SIZE)
    model.write_context(features, pos, slots, cache)
    context = [(k.view(-1, *k.shape[2:])[slots].clone(), v.view(-1, *v.shape[2:])[slots].clone())
               for k, v in cache]
    lens, anchors = torch.tensor(CONTEXT_LENS), torch.tensor([5, 17, 200, 383])
    logits = model.propose_logits(anchors, lens, tables, cache, embed, head, block)
    return (cache, slots, context, logits) if with_cache else logits
