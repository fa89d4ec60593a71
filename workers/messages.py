"""What crosses between the processes of one engine each step (workers/channel.py carries it):

  driver → every TP rank and the draft   StepMsg
  draft  → every TP rank                 Drafts   (a round's proposals, straight to the target)
  rank 0 → driver and the draft          StepResult (tokens for the driver; the committed
                                                     counts and the aux ref for the draft)

Every StepMsg gets exactly one StepResult, in order. A sequence crosses in full once, as a
`NewSeq` in the first step that schedules it (prompt, block table, state slot, sampling
parameters); later steps name it by id with the little that changes (where its tokens start,
its anchor), and `released` drops it from the workers' tables.

In process the same messages go straight from the engine to the steppers
(workers/stepper.py), so both paths run the same code."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import numpy as np
import torch

from configs.engine import SamplingParams
from workers.aux_transport import AuxRef
from workers.logprobs import TokenLogprob


class StepKind(enum.IntEnum):
    PREFILL = 0  # prompt chunks: fill the caches, sample after a prompt's last chunk
    ROUND = 1  # verify [anchor, drafts…] per sequence, accept, commit
    PROPOSE = 2  # the draft's proposal alone, returned to the driver (benchmarks)
    CALL = 3  # a method of every TP worker, run in step with the others; rank 0's value back
    RELEASE = 4  # only the sequence changes (sent when the engine goes idle with some pending)
    STOP = 5  # the loops return


@dataclass(frozen=True)
class NewSeq:
    """A sequence as the workers keep it, sent once."""

    seq_id: int
    prompt_ids: list[int]
    block_table: list[int]  # every page it may reach (reserved whole at admission)
    state_slot: int
    params: SamplingParams
    # the engine's end-of-sequence ids: what min_tokens holds back and a grammar's end emits
    # (workers/controls.py)
    eos_ids: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepMsg:
    step_id: int
    kind: StepKind
    seq_ids: list[int] = field(default_factory=list)  # the step's sequences, in order
    starts: list[int] = field(default_factory=list)  # [S] position of each one's first token
    chunk_lens: list[int] = field(default_factory=list)  # PREFILL: [S] prompt tokens fed
    samples: list[bool] = field(default_factory=list)  # PREFILL: [S] the prompt's last chunk
    anchors: list[int] = field(default_factory=list)  # ROUND, PROPOSE: [S] newest tokens
    # ROUND: [S, K] drafts given by the driver (benchmarks timing the target alone): the draft
    # sits the step out, proposing nothing and writing no context (its context then misses
    # these tokens). None: the draft proposes (no draft model: plain decoding, K = 0).
    drafts: list[list[int]] | None = None
    # ROUND: the drafts each sequence gets this round, K ≤ B − 1 (the draft proposes a block of
    # K + 1); 0: none (the draft sits out the proposal, a plain decode step, and still writes
    # the committed token into its context); None: B − 1
    num_drafts: int | None = None
    new_seqs: list[NewSeq] = field(default_factory=list)
    released: list[int] = field(default_factory=list)  # seq ids finished since the last step
    call: tuple[str, tuple] | None = None  # CALL: (method, args)
    # PREFILL, the prefix cache's state copies (cluster/prefix_cache.py) over every
    # linear-attention layer's conv and recurrent state: restores (from slot, to slot), before
    # the forward, a hit's snapshot into its sequence's slot; snapshots (seq id, snapshot
    # slot, position), the sequence's state after that position of its chunk (its end or
    # inside it) into a snapshot slot
    restores: list[tuple[int, int]] = field(default_factory=list)
    snapshots: list[tuple[int, int, int]] = field(default_factory=list)
    # ROUND, the prefix cache's boundary slots: [S] (slot, end) for each sequence, the slot
    # its commit leaves its state in at the last page boundary it reaches below position end
    # (its prompt and max_tokens); slot −1: none; None: no sequence has one
    taps: list[tuple[int, int]] | None = None


@dataclass(frozen=True)
class Drafts:
    step_id: int
    tokens: list[list[int]]  # [S, B − 1]
    propose_s: float  # the draft's wall time for them


@dataclass
class StepResult:
    step_id: int
    new_tokens: list[list[int]] = field(default_factory=list)  # [S] accepted drafts + bonus
    num_accepted: list[int] = field(default_factory=list)  # [S]; 0 for prefill
    # The committed tokens' aux features for the draft's context: a ref into the ring rank 0
    # shares with the draft, or (in process) the tensor [sum committed, n_aux·H] itself.
    aux: AuxRef | torch.Tensor | None = None
    drafts: list[list[int]] | None = None  # PROPOSE: the proposal
    value: object = None  # CALL: rank 0's return value
    propose_s: float | None = None  # wall time of the draft's proposal (ROUND, PROPOSE)
    verify_s: float | None = None  # wall time of the target's forward + accept + commit
    # index in seq_ids → why that sequence failed in this step (its sampling): the engine
    # fails that request alone
    errors: dict[int, str] = field(default_factory=dict)
    # index in seq_ids → log-probabilities of its new tokens / of the prompt tokens its chunk
    # predicts (the sequences that asked for them; workers/logprobs.py)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)


@dataclass(frozen=True)
class ProposeRequest:
    """A proposal: for each sequence, its anchor at position context_len, over its pages."""

    anchors: list[int]  # [S]
    context_lens: list[int]  # [S] committed tokens (the anchor's position)
    # [S][pages]: lists, or int32 tensors (the stepper's per-sequence copies)
    block_tables: list[list[int]] | list[torch.Tensor]


def host_tables(tables: list[list[int]] | list[torch.Tensor], width: int) -> np.ndarray:
    """[S, width] int32 array of the tables' first `width` pages, zero past each table's end.
    Tables given as tensors (the stepper keeps one per sequence) are read in place, not
    converted: a long context's thousands of page ids are not turned into an array again at
    every step."""
    out = np.zeros((len(tables), width), np.int32)
    for i, t in enumerate(tables):
        row = t.numpy()[:width] if isinstance(t, torch.Tensor) else np.asarray(t[:width])
        out[i, : len(row)] = row
    return out


@dataclass(frozen=True)
class ContextWrite:
    """Committed tokens' aux features into the draft's context KV: counts[i] rows for sequence
    i, in order, at `positions`."""

    aux: torch.Tensor  # [N, n_aux·H]
    positions: torch.Tensor  # [N] int64
    block_tables: list[list[int]] | list[torch.Tensor]  # [S][pages], as ProposeRequest's
    counts: list[int]  # [S], sum N
