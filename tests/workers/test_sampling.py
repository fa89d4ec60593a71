from __future__ import annotations

import pytest
import torch

from configs.engine import SamplingParams
from workers.sampling import accept_greedy, accept_sampling, probs_from_logits


def test_accept_greedy_longest_matching_prefix_plus_bonus():
    v = 10
    pred = torch.tensor([3, 5, 7, 1])  # target argmax after anchor, d1, d2, d3
    logits = torch.nn.functional.one_hot(pred, v).float()
    assert accept_greedy(torch.tensor([3, 5, 7]), logits) == (3, 1)
    assert accept_greedy(torch.tensor([3, 4, 7]), logits) == (1, 5)  # stops at first mismatch
    assert accept_greedy(torch.tensor([9, 5, 7]), logits) == (0, 3)
    assert accept_greedy(torch.tensor([], dtype=torch.long), logits[:1]) == (0, 3)


def test_top_k_and_top_p_truncate_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_k=2))[0]
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))[0]
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    p = probs_from_logits(logits, SamplingParams(temperature=1.0, top_p=0.5))[0]
    torch.testing.assert_close(p, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_sure_drafts_are_accepted_and_impossible_ones_rejected():
    v, params = 6, SamplingParams(temperature=1.0)
    g = torch.Generator().manual_seed(0)
    draft = torch.tensor([2, 4])
    sure = torch.full((3, v), -1e9)
    sure[0, 2] = sure[1, 4] = sure[2, 0] = 0.0
    assert accept_sampling(draft, sure, params, g) == (2, 0)
    never = torch.zeros(3, v)
    never[0, 2] = -1e9
    for _ in range(50):
        n, bonus = accept_sampling(draft, never, params, g)
        assert n == 0 and bonus != 2


def _tv(counts: torch.Tensor, probs: torch.Tensor) -> float:
    return 0.5 * (counts / counts.sum() - probs).abs().sum().item()


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=1.0, top_k=4, top_p=0.9)])
def test_rejection_sampling_emits_tokens_with_target_distribution(params):
    # The first token a round emits is d1 when accepted, else a residual sample: its law must
    # be exactly p_0, whatever the draft. With 8k draws an exact sampler's TV distance is about
    # 0.01; the negative control (resampling from p instead of the residual) is off by > 0.15.
    g = torch.Generator().manual_seed(1)
    v = 8
    logits = torch.randn(3, v, generator=g) * 1.5
    p0 = probs_from_logits(logits, params)[0]
    draft = torch.tensor([int(p0.argmax()), 1])
    counts, control = torch.zeros(v), torch.zeros(v)
    for _ in range(8_000):
        n, bonus = accept_sampling(draft, logits, params, g)
        counts[int(draft[0]) if n >= 1 else bonus] += 1
        wrong = int(torch.multinomial(p0, 1, generator=g))  # no residual: d1 over-represented
        control[int(draft[0]) if n >= 1 else wrong] += 1
    assert _tv(counts, p0) < 0.04
    assert _tv(control, p0) > 0.1


def test_batched_greedy_acceptance_equals_one_block_at_a_time():
    from workers.sampling import accept_greedy, accept_greedy_batch

    g = torch.Generator().manual_seed(3)
    S, K, V = 12, 7, 11
    logits = torch.randn(S, K + 1, V, generator=g)
    pred = logits.argmax(-1)
    drafts = torch.randint(0, V, (S, K), generator=g)
    for s in range(S):  # plant prefixes of every length that match the target's argmax
        j = s % (K + 1)
        drafts[s, :j] = pred[s, :j]
    n, bonus = accept_greedy_batch(drafts, logits)
    want = [accept_greedy(drafts[s], logits[s]) for s in range(S)]
    assert list(zip(n.tolist(), bonus.tolist(), strict=True)) == want
    assert sorted(set(n.tolist())) == list(range(K + 1))  # every acceptance length occurred
    # a decode step (no drafts): nothing accepted, the bonus is the row's argmax; bf16 logits
    # pick what their fp32 conversion picks
    one = logits[:, :1].bfloat16()
    n, bonus = accept_greedy_batch(drafts[:, :0], one)
    assert n.tolist() == [0] * S
    assert bonus.tolist() == [accept_greedy(drafts[s, :0], one[s].float())[1] for s in range(S)]


def test_inverse_cdf_sampling_follows_the_distribution_and_skips_zeros():
    from workers.sampling import sample_from

    g = torch.Generator().manual_seed(2)
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    u = torch.rand(20_000, generator=g)
    tokens = sample_from(probs.expand(20_000, -1), u)
    counts = torch.bincount(tokens, minlength=6).float()
    assert counts[0] == counts[2] == counts[5] == 0
    assert _tv(counts, probs) < 0.02
    edge = sample_from(probs[None], torch.tensor([1.0 - 2**-24]))  # rounding onto the total
    assert int(edge) == 4


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.8),
                                    SamplingParams(temperature=1.0, top_k=4, top_p=0.9)])
def test_batched_rejection_sampling_has_the_exact_joint_law(params):
    """The batched (device) acceptance against the exact law of (accepted count, emitted
    token) for one block: P(n = j, token = t) from p and the draft in closed form."""
    from workers.sampling import accept_sampling_batch

    g = torch.Generator().manual_seed(3)
    v, k, draws = 6, 2, 30_000
    logits = torch.randn(k + 1, v, generator=g) * 1.5
    p = probs_from_logits(logits, params)  # [K+1, V]
    draft = torch.tensor([int(p[0].argmax()), int(p[1].argsort()[-2])])
    exact = torch.zeros(k + 1, v)  # [n, token]
    reach = 1.0
    for j in range(k + 1):
        if j < k:
            res = p[j].clone()
            res[draft[j]] = 0
            exact[j] = reach * (res / res.sum()) * (1 - p[j, draft[j]]) if res.sum() > 0 else 0
            reach *= float(p[j, draft[j]])
        else:
            exact[j] = reach * p[j]
    n, tok = accept_sampling_batch(draft.expand(draws, -1), p.expand(draws, -1, -1),
                                   torch.rand(draws, k + 1, generator=g))
    counts = torch.zeros(k + 1, v)
    counts.index_put_((n, tok), torch.ones(draws), accumulate=True)
    assert 0.5 * (counts / draws - exact).abs().sum() < 0.02
