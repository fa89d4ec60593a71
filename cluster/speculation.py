"""Adaptive speculation: each round's draft length, chosen for the whole batch from the
sequences' recent acceptance and the round's measured cost.

A round of S sequences with K drafts each costs t(S, K) seconds (K = 0: a plain decode step,
no proposal); it commits, per sequence, 1 + a + a² + … + a^K tokens in expectation, where a is
the sequence's chance that a draft is accepted given the drafts before it were (the acceptance
model of a constant per-position rate). The rule takes the K among the candidates — B − 1, 7,
3 and 0, as far as the block allows — with the most expected tokens per second over the
batch. A large batch, where a verify's many tokens reach most experts and cost far more than a
decode, or sequences the draft guesses badly, fall back to plain decoding; the rule drafts
again when the batch shrinks or the estimates recover.

The costs are measured when the engine warms up (`measure_round_costs`): rounds at a few batch
sizes for each K, interpolated between them. The estimates: per sequence, accepted and
rejected drafts counted with a decay (recent rounds weigh more), started from the engine-wide
rate, itself decayed the same way. A sequence in rounds without drafts learns nothing, so once
a sequence of the batch has gone PROBE_AFTER rounds without drafts, one round drafts the
smallest candidate.

Outputs do not depend on the choice: the target verifies whatever the draft proposes."""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.sequence import Sequence

CANDIDATE_DRAFTS = (15, 7, 3, 0)
# Each observation's weight against the ones before it (a half-life of ~7 rounds).
DECAY = 0.9
# What a sequence starts from, in drafts: the engine-wide rate counted as this many.
PRIOR_WEIGHT = 4.0
PROBE_AFTER = 64  # each probe costs one round of 3 drafts instead of a decode step


def candidates(block_size: int) -> tuple[int, ...]:
    """The draft lengths a round may take, longest first."""
    return tuple(sorted({min(k, block_size - 1) for k in CANDIDATE_DRAFTS}, reverse=True))


def expected_tokens(rate: float, drafts: int) -> float:
    """Tokens a round commits with `drafts` drafts at a per-position acceptance `rate`."""
    return sum(rate**i for i in range(drafts + 1))


@dataclass(frozen=True)
class RoundCosts:
    """Measured seconds of a round by batch size, for each draft length."""

    batch_sizes: tuple[int, ...]  # ascending
    seconds: dict[int, tuple[float, ...]]  # drafts → a time per batch size

    def __post_init__(self) -> None:
        if not self.batch_sizes or list(self.batch_sizes) != sorted(set(self.batch_sizes)):
            raise ValueError(f"batch sizes must be ascending and distinct, got "
                             f"{self.batch_sizes}")
        for k, times in self.seconds.items():
            if len(times) != len(self.batch_sizes) or min(times) <= 0:
                raise ValueError(f"drafts {k}: one positive time per batch size, got {times}")

    def round_seconds(self, batch: int, drafts: int) -> float:
        """Linear between the measured sizes; past the largest, in proportion to it."""
        sizes, times = self.batch_sizes, self.seconds[drafts]
        if batch <= sizes[0]:
            return times[0]
        if batch >= sizes[-1]:
            return times[-1] * batch / sizes[-1]
        i = bisect.bisect_left(sizes, batch)
        lo, hi = sizes[i - 1], sizes[i]
        return times[i - 1] + (times[i] - times[i - 1]) * (batch - lo) / (hi - lo)


@dataclass
class SeqAcceptance:
    """A sequence's decayed counts of accepted and rejected drafts, and its rounds without."""

    accepted: float = 0.0
    rejected: float = 0.0
    rounds_without: int = 0


@dataclass
class AdaptiveDraftLength:
    """LLMEngine.draft_length: `__call__` picks a round's drafts, `observe` learns from it."""

    costs: RoundCosts
    block_size: int
    engine_rate: SeqAcceptance = field(default_factory=lambda: SeqAcceptance(2.0, 2.0))
    by_seq: dict[int, SeqAcceptance] = field(default_factory=dict)
    chosen: dict[int, int] = field(default_factory=dict)  # drafts → rounds that took it

    def rate(self, seq_id: int) -> float:
        e = self.engine_rate
        prior = e.accepted / (e.accepted + e.rejected) if e.accepted + e.rejected else 0.5
        s = self.by_seq.get(seq_id) or SeqAcceptance()
        return (s.accepted + PRIOR_WEIGHT * prior) / (s.accepted + s.rejected + PRIOR_WEIGHT)

    def choose(self, rates: list[float]) -> int:
        """The candidate with the most expected tokens per second for sequences of these
        rates."""
        n = len(rates)
        best, best_k = -1.0, 0
        for k in candidates(self.block_size):
            speed = sum(expected_tokens(r, k) for r in rates) / self.costs.round_seconds(n, k)
            if speed > best:
                best, best_k = speed, k
        return best_k

    def __call__(self, seqs: list[Sequence]) -> int:
        k = self.choose([self.rate(s.seq_id) for s in seqs])
        # a probe once any sequence has gone PROBE_AFTER rounds without drafts (any, not all:
        # under steady arrivals young sequences are always there); it resets every one's count
        if k == 0 and any(self.by_seq.get(s.seq_id, SeqAcceptance()).rounds_without
                          >= PROBE_AFTER for s in seqs):
            k = min(c for c in candidates(self.block_size) if c > 0)
        self.chosen[k] = self.chosen.get(k, 0) + 1
        return k

    def observe(self, seq_id: int, num_accepted: int, num_drafts: int) -> None:
        """One round of one sequence: `num_accepted` of its `num_drafts` drafts."""
        s = self.by_seq.setdefault(seq_id, SeqAcceptance())
        if num_drafts == 0:
            s.rounds_without += 1
            return
        s.rounds_without = 0
        rejected = float(num_accepted < num_drafts)
        for counts in (s, self.engine_rate):
            counts.accepted = DECAY * counts.accepted + num_accepted
            counts.rejected = DECAY * counts.rejected + rejected

    def forget(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)


def measure_round_costs(run_rounds: Callable[[int, int], list[float]], batch_sizes: list[int],
                        block_size: int) -> RoundCosts:
    """`run_rounds(batch, drafts)`: wall seconds of a few rounds of that shape; their median
    for every candidate length at every batch size."""
    sizes = tuple(sorted(set(batch_sizes)))
    return RoundCosts(sizes, {k: tuple(statistics.median(run_rounds(b, k)) for b in sizes)
                              for k in candidates(block_size)})
