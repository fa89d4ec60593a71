"""GDN rollback: after verifying a block and keeping only its first j+1 tokens, the target is
in exactly the state of a run that never saw the rejected tokens."""

from __future__ import annotations

import pytest
import torch
from target_harness import TargetHarness

B = 8


@pytest.fixture(scope="module")
def harnesses(tiny_models):
    return TargetHarness(tiny_models / "target"), TargetHarness(tiny_models / "target")


@pytest.mark.parametrize("kept", range(1, B + 1))  # anchor + j accepted drafts, j = 0 … B-1
def test_rollback_equals_never_seen(harnesses, kept):
    spec, clean = harnesses
    g = torch.Generator().manual_seed(kept)
    prompt = torch.randint(0, 300, (10,), generator=g).tolist()
    block = torch.randint(0, 300, (B,), generator=g).tolist()
    after = torch.randint(0, 300, (B,), generator=g).tolist()
    slot = kept % 4
    t_spec, t_clean = spec.pages(64), clean.pages(64)

    spec.logits([spec.seq(0, prompt, 0, t_spec, slot)], verify=False)
    spec.logits([spec.seq(0, block, len(prompt), t_spec, slot)], verify=True)
    spec.commit([kept])
    start = len(prompt) + kept
    got = spec.logits([spec.seq(0, after, start, t_spec, slot)], verify=True)[0]

    clean.logits([clean.seq(0, prompt + block[:kept], 0, t_clean, slot)], verify=False)
    want = clean.logits([clean.seq(0, after, start, t_clean, slot)], verify=True)[0]

    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    for layer in spec.model.config.linear_attention_layers:
        torch.testing.assert_close(spec.caches.conv[layer][slot], clean.caches.conv[layer][slot],
                                   atol=1e-5, rtol=0)
        torch.testing.assert_close(spec.caches.ssm[layer][slot], clean.caches.ssm[layer][slot],
                                   atol=1e-5, rtol=0)


def test_fresh_prefill_resets_a_reused_state_slot(tiny_models):
    h = TargetHarness(tiny_models / "target")
    prompt = list(range(30, 42))
    first = h.runner.prefill([h.seq(0, prompt, 0, h.pages(32), 3)])
    h.runner.prefill([h.seq(1, list(range(100, 120)), 0, h.pages(32), 3)])  # dirties slot 3
    again = h.runner.prefill([h.seq(2, prompt, 0, h.pages(32), 3)])
    assert first.new_tokens == again.new_tokens
