"""Our Qwen3.5-MoE target against transformers' Qwen3_5MoeForCausalLM (fp32, CPU)."""

from __future__ import annotations

import pytest
import torch
from target_harness import TargetHarness, hf_logits
from transformers import Qwen3_5MoeForCausalLM

ATOL = 1e-4  # fp32; logits reach ~20, and batch-size-dependent BLAS rounding is ~1e-5


@pytest.fixture(scope="module")
def hf(tiny_models):
    return Qwen3_5MoeForCausalLM.from_pretrained(tiny_models / "target", dtype=torch.float32).eval()


@pytest.mark.parametrize("layout", ["target", "target-published"])
def test_prefill_and_cached_steps_match_transformers(tiny_models, hf, layout):
    h = TargetHarness(tiny_models / layout)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (13, 1, 29)]
    tables = [h.pages(64) for _ in prompts]
    seqs = [h.seq(i, p, 0, tables[i], i) for i, p in enumerate(prompts)]
    for mine, p in zip(h.logits(seqs, verify=False), prompts, strict=True):
        torch.testing.assert_close(mine, hf_logits(hf, p), atol=ATOL, rtol=0)

    # Then one step of 1 token for some sequences and of B=5 tokens for others, in one batch,
    # as prefill-style extensions (state advanced in place).
    exts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (1, 5, 5)]
    seqs = [h.seq(i, e, len(prompts[i]), tables[i], i) for i, e in enumerate(exts)]
    for mine, p, e in zip(h.logits(seqs, verify=False), prompts, exts, strict=True):
        torch.testing.assert_close(mine, hf_logits(hf, p + e)[len(p) :], atol=ATOL, rtol=0)


def test_verify_block_matches_transformers_and_leaves_state(tiny_models, hf):
    h = TargetHarness(tiny_models / "target")
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 300, (11,), generator=g).tolist()
    table = h.pages(64)
    h.logits([h.seq(0, prompt, 0, table, 0)], verify=False)
    block = torch.randint(0, 300, (8,), generator=g).tolist()
    # Verifying twice gives identical logits: the first verify did not touch committed state.
    first = h.logits([h.seq(0, block, len(prompt), table, 0)], verify=True)[0]
    second = h.logits([h.seq(0, block, len(prompt), table, 0)], verify=True)[0]
    torch.testing.assert_close(first, hf_logits(hf, prompt + block)[len(prompt) :], atol=ATOL,
                               rtol=0)
    assert torch.equal(first, second)


def test_mixed_prefill_and_verify_batch(tiny_models, hf):
    h = TargetHarness(tiny_models / "target")
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randint(0, 300, (n,), generator=g).tolist() for n in (9, 17))
    ta, tb = h.pages(64), h.pages(64)
    h.logits([h.seq(0, a, 0, ta, 0)], verify=False)
    block = torch.randint(0, 300, (4,), generator=g).tolist()
    batch = [h.seq(0, block, len(a), ta, 0), h.seq(1, b, 0, tb, 1)]
    runner_batch = h.runner._batch(batch, is_verify=False)
    runner_batch.is_verify = [True, False]
    with torch.inference_mode():
        hidden, _ = h.model(runner_batch, h.caches)
        logits = h.model.compute_logits(hidden)
    torch.testing.assert_close(logits[:4], hf_logits(hf, a + block)[len(a) :], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[4:], hf_logits(hf, b), atol=ATOL, rtol=0)


def test_aux_hidden_states_are_residual_stream_after_layer(tiny_models, hf):
    # Layer k's aux feature is the residual stream after layer k, before the final norm
    # (transformers' hidden_states[k+1] for k < L-1; its last entry is post-norm).
    h = TargetHarness(tiny_models / "target", aux_layer_ids=(0, 3, 7))
    prompt = list(range(40, 60))
    seq = h.seq(0, prompt, 0, h.pages(32), 0)
    batch = h.runner._batch([seq], is_verify=False)
    captured = {}
    def keep(i):
        return lambda mod, inp, out: captured.__setitem__(i, out[0] if isinstance(out, tuple)
                                                          else out)

    hooks = [hf.model.layers[i].register_forward_hook(keep(i)) for i in (0, 3, 7)]
    try:
        with torch.inference_mode():
            hf(torch.tensor([prompt]))
            _, aux = h.model(batch, h.caches)
    finally:
        for hook in hooks:
            hook.remove()
    hidden = h.model.config.hidden_size
    for j, layer in enumerate((0, 3, 7)):
        torch.testing.assert_close(aux[:, j * hidden : (j + 1) * hidden], captured[layer][0],
                                   atol=ATOL, rtol=0)


def test_bf16_checkpoint_loads_and_runs(tiny_models):
    h = TargetHarness(tiny_models / "target-bf16", dtype=torch.bfloat16)
    assert h.model.model.layers[0].linear_attn.A_log.dtype == torch.float32
    out = h.logits([h.seq(0, [1, 2, 3, 4, 5], 0, h.pages(16), 0)], verify=False)[0]
    assert out.shape == (5, h.model.config.vocab_size) and torch.isfinite(out).all()


def test_rope_tables_are_made_once_per_forward(tiny_models, monkeypatch):
    """Every attention layer rotates the same positions: the first makes cos/sin, the others
    read them from the forward's ForwardBatch.attn_meta."""
    from target.kernels import fused

    h = TargetHarness(tiny_models / "target")
    calls = []
    real = fused.rope_cos_sin
    monkeypatch.setattr(fused, "rope_cos_sin", lambda *a: calls.append(1) or real(*a))
    assert len(h.model.config.full_attention_layers) > 1
    h.logits([h.seq(0, [3, 1, 4, 1, 5], 0, h.pages(16), 0)], verify=False)
    assert len(calls) == 1
