"""The draft's FlexAttention path (block K/V written into the block's own cache slots, one
paged attention over context + block) proposes exactly what the gathering path proposes, for
both published revisions (full attention; sliding windows + full), and leaves every context
slot untouched."""

from __future__ import annotations

import pytest
import torch

from draft.model import DFlashDraftModel, DraftAttention

PAGE, NUM_PAGES = 4, 64
CONTEXT_LENS = [3, 9, 14, 6]


def layout(block: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_PAGES, generator=g)
    width = -(-(max(CONTEXT_LENS) + block) // PAGE)
    tables = torch.zeros(len(CONTEXT_LENS), width, dtype=torch.int32)
    used = 0
    for s, n in enumerate(CONTEXT_LENS):
        pages = -(-(n + block) // PAGE)  # context + block, as a sequence reserves
        tables[s, :pages] = perm[used : used + pages].to(torch.int32)
        used += pages
    return tables


@pytest.mark.parametrize("revision", ["draft-full", "draft-swa"])
@pytest.mark.parametrize("block", [4, 16])
@torch.inference_mode()
def test_flex_blocks_propose_what_the_gathering_path_proposes(tiny_models, revision, block):
    model = DFlashDraftModel.from_pretrained(tiny_models / revision, dtype=torch.float32,
                                             device="cpu", block_size=block)
    g = torch.Generator().manual_seed(block)
    vocab, hidden = 400, model.cfg.hidden_size
    embed_w = torch.randn(vocab, hidden, generator=g)
    head_w = torch.randn(vocab, hidden, generator=g) * 0.2
    def embed(ids):
        return torch.nn.functional.embedding(ids, embed_w)

    def head(h):
        return h @ head_w.T

    tables = layout(block, seed=block)
    cache = model.allocate_kv_cache(NUM_PAGES, PAGE)
    pos = torch.cat([torch.arange(n) for n in CONTEXT_LENS])
    slots = torch.cat([tables[s].long()[torch.arange(n) // PAGE] * PAGE + torch.arange(n) % PAGE
                       for s, n in enumerate(CONTEXT_LENS)])
    model.write_context(torch.randn(len(pos), model.cfg.aux_hidden_size, generator=g), pos,
                        slots, cache)
    context = [(k.view(-1, *k.shape[2:])[slots].clone(), v.view(-1, *v.shape[2:])[slots].clone())
               for k, v in cache]
    lens, anchors = torch.tensor(CONTEXT_LENS), torch.tensor([5, 17, 200, 383])
    args = (anchors, lens, tables, cache, embed, head, block)
    try:
        DraftAttention.flex_blocks = False
        want = model.propose_logits(*args)
        DraftAttention.flex_blocks = True
        got = model.propose_logits(*args)
    finally:
        DraftAttention.flex_blocks = False
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    for (k, v), (k0, v0) in zip(cache, context, strict=True):  # context slots as written
        assert torch.equal(k.view(-1, *k.shape[2:])[slots], k0)
        assert torch.equal(v.view(-1, *v.shape[2:])[slots], v0)
