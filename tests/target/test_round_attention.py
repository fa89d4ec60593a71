"""The gathered round attention (the torch backend's batched form: explicit matmuls or SDPA) =
the per-sequence reference: pages interleaved and shuffled, junk in unused table entries,
sequences at different lengths (partial last pages), GQA, B = 1 (decode) and B > 1 (verify);
inside the model, verify logits are unchanged by switching it on. (The Triton kernel's tests:
test_attention_triton.py.)"""

from __future__ import annotations

import pytest
import torch
from target_harness import TargetHarness

from target.kernels import attention
from target.kernels.attention import paged_attention, paged_attention_gathered
from target.layers.attention import set_round_attention


def case(block: int, device: str, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    num_pages, page_size, kv_heads, dim, heads = 64, 4, 2, 16, 4
    k_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_pages, page_size, kv_heads, dim, generator=g)
    lens = [block + 4, block + 13, block]  # context incl. the block; partial last pages
    tables = torch.zeros(len(lens), 8, dtype=torch.int32)
    perm, used = torch.randperm(num_pages, generator=g), 0
    for s, n in enumerate(lens):
        pages = -(-n // page_size)
        tables[s, :pages] = perm[used : used + pages]
        tables[s, pages:] = perm[-1]  # junk in unused entries must not leak in
        used += pages
    q = torch.randn(len(lens) * block, heads, dim, generator=g)
    to = [t.to(device, dtype) for t in (q, k_cache, v_cache)]
    return *to, lens, tables.to(device)


@pytest.fixture(params=["explicit", "sdpa"])
def gqa_path(request, monkeypatch):
    """Both forms of gqa_attention: two matmuls around a softmax (small calls), SDPA (large)."""
    if request.param == "sdpa":
        monkeypatch.setattr(attention, "EXPLICIT_MAX_SCORES", 0)
    return request.param


@pytest.mark.parametrize("block", [1, 5, 16])
def test_gathered_round_equals_the_reference(block, gqa_path):
    q, k_cache, v_cache, lens, tables = case(block, "cpu")
    want = paged_attention(q, k_cache, v_cache, [block] * len(lens), lens, tables, 0.25)
    got = paged_attention_gathered(q, k_cache, v_cache, torch.tensor(lens), tables, 0.25)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [1, 16])
def test_gathered_round_on_cuda_equals_the_reference(block, gqa_path):
    q, k_cache, v_cache, lens, tables = case(block, "cuda", torch.bfloat16)
    want = paged_attention(q.float(), k_cache.float(), v_cache.float(), [block] * len(lens),
                           lens, tables, 0.25)
    got = paged_attention_gathered(q, k_cache, v_cache, torch.tensor(lens, device="cuda"),
                                   tables, 0.25)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_model_verify_logits_unchanged_with_batched_rounds(tiny_models):
    def verify_logits(gathered: bool):
        h = TargetHarness(tiny_models / "target")
        set_round_attention(h.model, "gathered" if gathered else "reference")
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (6, 13, 9)]
        tables = [h.pages(64) for _ in prompts]
        h.logits([h.seq(i, p, 0, tables[i], i) for i, p in enumerate(prompts)], verify=False)
        blocks = [torch.randint(0, 300, (6,), generator=g).tolist() for _ in prompts]
        return h.logits([h.seq(i, b, len(prompts[i]), tables[i], i)
                         for i, b in enumerate(blocks)], verify=True)

    for a, b in zip(verify_logits(True), verify_logits(False), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
