"""Acceptance replay, for benchmarks: the speed of DFlash at a chosen acceptance length on a
model whose draft never agrees with its target (random weights).

With random weights every round commits one token (the draft's guesses are wrong), so the cost
of a round at a real acceptance length cannot be seen. Replay runs the draft's forward as
always (every cost is paid), then replaces its proposal with the target's own continuation of
that sequence, recorded from an earlier run of the same prompt, cut after a number of tokens
drawn from an acceptance curve: the target accepts exactly those, as it would a draft that
guessed them. The proposal's next token is made wrong on purpose (the recorded one minus one),
so the round stops there.

The recording is the one this process saw: each finished sequence's output, by its prompt. Any
run gives the target's output (DFlash's output is the target's), so a benchmark sends its
prompts twice: the first pass records (it runs at the draft's own acceptance), the second
replays. Greedy requests only: a sampled request's target draws its own tokens, and the
recorded ones are then accepted only by chance.

Outputs are unchanged by replay, as by any proposal: the target verifies every draft. It is an
engine setting (EngineConfig.acceptance_replay, `--acceptance-replay` on the serve CLI, off by
default), never a request's."""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from workers.messages import StepKind, StepMsg


@dataclass(frozen=True)
class AcceptanceCurve:
    """accept[i]: the probability that draft i (0-based) is accepted when every draft before
    it was; a round then commits 1 + (the drafts accepted) tokens."""

    accept: tuple[float, ...]

    @classmethod
    def from_spec(cls, spec: str, num_drafts: int) -> AcceptanceCurve:
        """`spec`: a mean acceptance length τ (committed tokens per round, 1 ≤ τ ≤ B = 1 +
        num_drafts), met by the same probability at every position; or per-position
        probabilities as `accept`, a JSON list, given as such or in a file (shorter lists end
        in zeros)."""
        if spec.lstrip().startswith("["):
            return cls.from_list(spec, num_drafts)
        try:
            tau = float(spec)
        except ValueError:
            return cls.from_file(Path(spec), num_drafts)
        if not 1.0 <= tau <= num_drafts + 1:
            raise ValueError(f"acceptance_replay: a mean acceptance length must be in [1, "
                             f"{num_drafts + 1}] (the block size), got {spec!r}")
        return cls((constant_rate(tau, num_drafts),) * num_drafts)

    @classmethod
    def from_file(cls, path: Path, num_drafts: int) -> AcceptanceCurve:
        try:
            text = path.read_text()
        except OSError as e:
            raise ValueError(f"acceptance_replay: {str(path)!r} is neither a number, a JSON "
                             f"list nor a readable file ({e})") from None
        return cls.from_list(text, num_drafts, str(path))

    @classmethod
    def from_list(cls, text: str, num_drafts: int, where: str = "the list"
                  ) -> AcceptanceCurve:
        try:
            probs = json.loads(text)
        except ValueError:
            probs = None
        if not isinstance(probs, list) or not all(
                isinstance(p, (int, float)) and not isinstance(p, bool) and 0 <= p <= 1
                for p in probs):
            raise ValueError(f"acceptance_replay: {where} must be a JSON list of "
                             f"probabilities in [0, 1]")
        probs = [float(p) for p in probs[:num_drafts]]
        return cls(tuple(probs + [0.0] * (num_drafts - len(probs))))

    def mean_length(self) -> float:
        """τ: the expected committed tokens of a round."""
        tau, reach = 1.0, 1.0
        for p in self.accept:
            reach *= p
            tau += reach
        return tau

    def draw(self, rng: random.Random) -> int:
        """A round's accepted drafts."""
        for i, p in enumerate(self.accept):
            if rng.random() >= p:
                return i
        return len(self.accept)


def constant_rate(tau: float, num_drafts: int) -> float:
    """The per-position acceptance a with 1 + a + … + a^num_drafts = τ (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(num_drafts + 1)) < tau:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def prompt_key(prompt_ids: Sequence[int]) -> bytes:
    return hashlib.blake2b(np.asarray(prompt_ids, np.int64).tobytes(), digest_size=16).digest()


class AcceptanceReplay:
    """The draft process's part: it follows the sequences through the step messages the draft
    sees (`apply`, `commit`), records each finished one's output by prompt, and `rewrite`s a
    round's proposals."""

    def __init__(self, curve: AcceptanceCurve, seed: int = 0):
        self.curve = curve
        self.rng = random.Random(seed)
        self.keys: dict[int, bytes] = {}  # seq id → its prompt's key
        self.outputs: dict[int, list[int]] = {}  # seq id → the tokens committed after its prompt
        self.recorded: dict[bytes, list[int]] = {}  # prompt key → the longest output seen

    def apply(self, msg: StepMsg) -> None:
        for seq in msg.new_seqs:
            self.keys[seq.seq_id] = prompt_key(seq.prompt_ids)
            self.outputs[seq.seq_id] = []
        for seq_id in msg.released:
            key, out = self.keys.pop(seq_id, None), self.outputs.pop(seq_id, [])
            if key is not None and len(out) > len(self.recorded.get(key, ())):
                self.recorded[key] = out

    def commit(self, msg: StepMsg, new_tokens: list[list[int]]) -> None:
        if msg.kind in (StepKind.PREFILL, StepKind.ROUND):
            for seq_id, tokens in zip(msg.seq_ids, new_tokens, strict=True):
                self.outputs[seq_id].extend(tokens)

    def rewrite(self, msg: StepMsg, drafts: list[list[int]]) -> list[list[int]]:
        """Each proposal with a recording: its first k tokens the recorded continuation after
        the sequence's anchor (k drawn from the curve), the next one wrong."""
        out = []
        for seq_id, draft in zip(msg.seq_ids, drafts, strict=True):
            recorded, output = self.recorded.get(self.keys[seq_id]), self.outputs[seq_id]
            done = len(output)  # the anchor is its last output token
            # (a recording that disagrees at the anchor is another request's: a sampled one)
            if recorded is None or not 0 < done <= len(recorded) \
                    or recorded[done - 1] != output[-1]:
                out.append(draft)
                continue
            k = min(self.curve.draw(self.rng), len(draft))
            new = list(draft)
            ahead = recorded[done: done + len(draft)]
            new[: min(k, len(ahead))] = ahead[:k]
            if k < len(ahead):
                new[k] = ahead[k] - 1 if ahead[k] > 0 else ahead[k] + 1
            out.append(new)
        return out


def replay_for(spec: str | None, block_size: int, seed: int = 0) -> AcceptanceReplay | None:
    """The engine's acceptance replay (EngineConfig.acceptance_replay), or None when off."""
    if spec is None:
        return None
    return AcceptanceReplay(AcceptanceCurve.from_spec(spec, block_size - 1), seed)
