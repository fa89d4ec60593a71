"""A uniform round (every sequence verifies L tokens) runs the Gated DeltaNet batched: one
conv and one recurrence for all sequences, and a masked batched replay at commit. It must give
the per-sequence path's logits and leave the same conv/recurrent states, for every kept count
(0 accepted drafts … all), with sequences at different context lengths. One-token rounds
(plain decode) commit their states in the forward itself."""

from __future__ import annotations

import pytest
import torch
from target_harness import TargetHarness

from configs.kernels import KernelConfig
from target.layers.gdn import GatedDeltaNet


def run(harness: TargetHarness, kernels: KernelConfig, kept: list[int], L: int):
    """Three sequences prefilled, then two rounds of L tokens keeping `kept`: the rounds'
    logits and the final conv / recurrent states, with the model's kernels set to `kernels`
    (tests/target/test_gdn_slots.py runs it with the slots recurrence too)."""
    harness.model.set_kernels(kernels, graphs=False)
    assert {m.batched_rounds for m in harness.model.modules()
            if isinstance(m, GatedDeltaNet)} == {kernels.gdn_rounds == "batched"}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 11, 7)]
    tables = [harness.pages(64) for _ in prompts]
    slots = [5, 1, 3]
    harness.logits([harness.seq(i, p, 0, tables[i], slots[i]) for i, p in enumerate(prompts)],
                   verify=False)
    blocks = [torch.randint(0, 300, (L,), generator=g).tolist() for _ in prompts]
    first = harness.logits([harness.seq(i, b, len(prompts[i]), tables[i], slots[i])
                            for i, b in enumerate(blocks)], verify=True)
    harness.commit(kept)
    after = [torch.randint(0, 300, (L,), generator=g).tolist() for _ in prompts]
    second = harness.logits([harness.seq(i, a, len(prompts[i]) + kept[i], tables[i], slots[i])
                             for i, a in enumerate(after)], verify=True)
    harness.commit(kept)
    layers = harness.model.config.linear_attention_layers
    states = [(harness.caches.conv[i][slots].clone(), harness.caches.ssm[i][slots].clone())
              for i in layers]
    return first, second, states


@pytest.mark.parametrize("L", [1, 5])
def test_batched_round_equals_per_sequence(tiny_models, L):
    for kept in ([1, 3, 5], [5, 1, 2], [2, 2, 2]) if L > 1 else ([1, 1, 1],):
        got = run(TargetHarness(tiny_models / "target"), KernelConfig(), kept, L)
        want = run(TargetHarness(tiny_models / "target"), KernelConfig(gdn_rounds="per-seq"),
                   kept, L)
        assert_runs_close(got, want)


def test_taps_are_the_same_through_the_per_sequence_and_the_batched_commit(tiny_models):
    """A round's commit with taps (gdn_slots.Taps, pages of 4): sequences starting at 3, 11
    and 7 keep 5, 5 and 3 tokens; the second may not pass position 13. Their boundary slots
    get the states after 5 tokens (position 8), 1 (12: not 16, past its end) and 1 (8), the
    same through both commits; no other slot changes."""
    states = []
    for rounds in ("batched", "per-seq"):
        harness = TargetHarness(tiny_models / "target")
        harness.model.set_kernels(KernelConfig(gdn_rounds=rounds), graphs=False)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (3, 11, 7)]
        tables, slots = [harness.pages(64) for _ in prompts], [5, 1, 3]
        harness.logits([harness.seq(i, p, 0, tables[i], slots[i])
                        for i, p in enumerate(prompts)], verify=False)
        blocks = [torch.randint(0, 300, (5,), generator=g).tolist() for _ in prompts]
        harness.logits([harness.seq(i, b, len(prompts[i]), tables[i], slots[i])
                        for i, b in enumerate(blocks)], verify=True)
        before = [(harness.caches.conv[i].clone(), harness.caches.ssm[i].clone())
                  for i in harness.model.config.linear_attention_layers]
        harness.commit([5, 5, 3], tap_slots=[6, 7, 4], tap_ends=[100, 13, 100])
        after = [(harness.caches.conv[i], harness.caches.ssm[i])
                 for i in harness.model.config.linear_attention_layers]
        for (conv0, ssm0), (conv1, ssm1) in zip(before, after, strict=True):
            assert torch.equal(conv0[[0, 2]], conv1[[0, 2]]) and torch.equal(ssm0[[0, 2]],
                                                                              ssm1[[0, 2]])
        states.append([(c[[6, 7, 4]].clone(), s[[6, 7, 4]].clone()) for c, s in after])
    # (the batched commit's taps are the kernel's reference: tests/target/test_gdn_slots.py)
    for (conv_a, ssm_a), (conv_b, ssm_b) in zip(*states, strict=True):
        torch.testing.assert_close(conv_a, conv_b, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ssm_a, ssm_b, atol=1e-5, rtol=1e-5)


def assert_runs_close(got, want) -> None:
    for a, b in zip(got[0] + got[1], want[0] + want[1], strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for (conv_a, ssm_a), (conv_b, ssm_b) in zip(got[2], want[2], strict=True):
        torch.testing.assert_close(conv_a, conv_b, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(ssm_a, ssm_b, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_fla_batched_recurrence_and_masked_replay_match_the_reference():
    """The CUDA path of a round: one fla call over S sequences, and the replay with g = β = 0
    past each kept count, against the torch reference run on exactly the kept tokens."""
    from target.kernels import gdn, gdn_torch

    g = torch.Generator().manual_seed(0)
    S, T, H, D = 3, 16, 4, 64
    q = torch.nn.functional.normalize(torch.randn(S, T, H, D, generator=g), dim=-1) * D**-0.5
    k = torch.nn.functional.normalize(torch.randn(S, T, H, D, generator=g), dim=-1)
    v = torch.randn(S, T, H, D, generator=g)
    decay = -torch.rand(S, T, H, generator=g)
    beta = torch.rand(S, T, H, generator=g)
    state = torch.randn(S, H, D, D, generator=g) * 0.1
    cuda = [t.cuda() for t in (q, k, v, decay, beta, state)]
    o, final = gdn.gated_delta_rule_batched(*cuda)
    o_ref, final_ref = gdn_torch.recurrent_gated_delta_rule(q, k, v, decay, beta, state)
    torch.testing.assert_close(o.float().cpu(), o_ref, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(final.float().cpu(), final_ref, atol=2e-4, rtol=2e-4)
    kept = torch.tensor([1, 9, 16])
    mask = (torch.arange(T)[None, :] < kept[:, None])[..., None]
    _, replay = gdn.gated_delta_rule_batched(
        cuda[1], cuda[1], cuda[2], cuda[3] * mask.cuda(), cuda[4] * mask.cuda(), cuda[5])
    for i, n in enumerate(kept.tolist()):
        _, want = gdn_torch.recurrent_gated_delta_rule(
            k[i, :n], k[i, :n], v[i, :n], decay[i, :n], beta[i, :n], state[i])
        torch.testing.assert_close(replay[i].float().cpu(), want, atol=2e-4, rtol=2e-4)


def test_prompts_of_one_length_run_the_recurrence_together_bit_for_bit():
    """A prefill of many short prompts (off fla) runs one recurrence per length: its outputs
    and states are the one-prompt-at-a-time recurrence's, bit for bit, in order."""
    from target.kernels import gdn, gdn_torch

    g = torch.Generator().manual_seed(3)

    def seq(n: int) -> tuple[torch.Tensor, ...]:
        qk = torch.nn.functional.normalize(torch.randn(2, n, 4, 16, generator=g), dim=-1)
        return (qk[0], qk[1], torch.randn(n, 4, 16, generator=g),
                -torch.rand(n, 4, generator=g), torch.rand(n, 4, generator=g),
                torch.randn(4, 16, 16, generator=g))

    lengths = [5, 9, 5, 5, 9, 1, gdn_torch.CHUNK + 3, 5]  # groups, a single, a chunked one
    inputs = [seq(n) for n in lengths]
    got = gdn.gated_delta_rule_many(inputs)
    for x, (o, state) in zip(inputs, got, strict=True):
        want_o, want_state = gdn.gated_delta_rule(*x)
        assert torch.equal(o, want_o) and torch.equal(state, want_state)
