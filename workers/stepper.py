"""Where step messages (workers/messages.py) become runner calls: the same code on every TP
rank and in the draft actor (fed by the control channel) and in process (fed by the engine
directly, cluster/executor.py). Each side keeps a `SeqTable` of the sequences it has been
sent; a step names them by id.

`TargetRunner` and `Drafter` are what the steppers drive: `ModelRunner` and `DraftRunner`
(workers/model_runner.py, draft/proposer.py) implement them, in process and inside the
actors alike."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import torch

from workers.controls import ControlsEnv, ControlsTable
from workers.messages import ContextWrite, NewSeq, ProposeRequest, StepKind, StepMsg
from workers.model_runner import SeqInput, StepOutput

if TYPE_CHECKING:
    from draft.replay import AcceptanceReplay


@runtime_checkable
class TargetRunner(Protocol):
    def prefill(self, seqs: list[SeqInput]) -> StepOutput: ...

    def verify(self, seqs: list[SeqInput]) -> StepOutput: ...

    def release(self, seq_id: int) -> None: ...

    def copy_states(self, pairs: list[tuple[int, int]]) -> None: ...


@runtime_checkable
class Drafter(Protocol):
    def propose(self, req: ProposeRequest, top_k: int = 0,
                block_size: int | None = None) -> torch.Tensor:
        """[S, B − 1] proposed tokens (argmax at every temperature), on any device; with
        top_k, [S, B − 1, top_k]: each position's top_k tokens, best first. `block_size`: a
        block of that B instead of the drafter's own (at most its own)."""
        ...

    def write_context(self, write: ContextWrite) -> None: ...


class SeqTable:
    """The sequences one process has been sent, by id, and each one's block table as an int32
    tensor (made once: a sequence's table is fixed at admission)."""

    def __init__(self):
        self.seqs: dict[int, NewSeq] = {}
        self.table_t: dict[int, torch.Tensor] = {}

    def apply(self, msg: StepMsg) -> None:
        for seq in msg.new_seqs:
            self.seqs[seq.seq_id] = seq
            self.table_t[seq.seq_id] = torch.tensor(seq.block_table, dtype=torch.int32)
        for seq_id in msg.released:
            self.seqs.pop(seq_id, None)
            self.table_t.pop(seq_id, None)

    def tables(self, msg: StepMsg) -> list[torch.Tensor]:
        return [self.table_t[i] for i in msg.seq_ids]


class TargetStepper:
    """`controls`: what the sampling controls need in this process (workers/controls.py);
    None refuses them (each controlled sequence then fails alone)."""

    def __init__(self, runner: TargetRunner, controls: ControlsEnv | None = None):
        self.runner = runner
        self.table = SeqTable()
        self.controls = ControlsTable(controls)

    def apply(self, msg: StepMsg) -> None:
        """Every message's sequence changes, whatever its kind."""
        self.table.apply(msg)
        self.controls.apply(msg)
        for seq_id in msg.released:
            self.runner.release(seq_id)

    def run(self, msg: StepMsg, drafts: list[list[int]] | None) -> tuple[StepOutput, float]:
        """A PREFILL or ROUND step, after `apply` (drafts: [S, K], None for none); also its
        wall time."""
        t = time.perf_counter()
        seqs = [self.table.seqs[i] for i in msg.seq_ids]
        tables = self.table.tables(msg)
        if msg.kind is StepKind.PREFILL:
            self.runner.copy_states(msg.restores)
            snapshots = {seq_id: (slot, at) for seq_id, slot, at in msg.snapshots}
            out = self.runner.prefill([
                SeqInput(s.seq_id, s.prompt_ids[start : start + n], start, s.block_table,
                         s.state_slot, s.params, sample=sample,
                         prompt_targets=None if s.params.prompt_logprobs is None
                         else s.prompt_ids[start + 1 : start + n + 1], block_table_t=t,
                         controls=self.controls.get(s.seq_id),
                         snapshot=snapshots.get(s.seq_id))
                for s, start, n, sample, t in zip(seqs, msg.starts, msg.chunk_lens,
                                                  msg.samples, tables, strict=True)])
        elif msg.kind is StepKind.ROUND:
            drafts = drafts if drafts is not None else [[]] * len(seqs)
            taps = msg.taps if msg.taps is not None else [(-1, 0)] * len(seqs)
            out = self.runner.verify([
                SeqInput(s.seq_id, [anchor, *d], start, s.block_table, s.state_slot, s.params,
                         block_table_t=t, controls=self.controls.get(s.seq_id),
                         tap_slot=tap[0], tap_end=tap[1])
                for s, start, anchor, d, t, tap in zip(seqs, msg.starts, msg.anchors, drafts,
                                                       tables, taps, strict=True)])
        else:
            raise ValueError(f"the target runs PREFILL and ROUND steps, not {msg.kind.name}")
        for i, why in self.controls.commit(msg.seq_ids, out.new_tokens).items():
            out.errors[i], out.new_tokens[i] = why, []
        return out, time.perf_counter() - t


def draft_proposes(msg: StepMsg) -> bool:
    """The step needs the draft's proposal (not a round whose drafts the driver gave)."""
    return msg.kind is StepKind.PROPOSE or (msg.kind is StepKind.ROUND and msg.drafts is None
                                             and msg.num_drafts != 0)


def draft_writes_context(msg: StepMsg) -> bool:
    """The step's committed tokens go into the draft's context (a round whose drafts the driver
    gave leaves the draft out: see StepMsg.drafts)."""
    return msg.kind is StepKind.PREFILL or (msg.kind is StepKind.ROUND and msg.drafts is None)


def committed_counts(msg: StepMsg, num_accepted: list[int]) -> list[int]:
    """Tokens the step entered into the target's cache per sequence: its prompt chunk, or the
    anchor and the accepted drafts."""
    if msg.kind is StepKind.PREFILL:
        return list(msg.chunk_lens)
    return [n + 1 for n in num_accepted]


# Candidates per position a grammar-constrained proposal picks from (workers/controls.py
# SeqControls.constrain_proposal): the best the grammar allows among the draft's top ones.
PROPOSAL_CANDIDATES = 8


class DraftStepper:
    """`controls`: as TargetStepper's; the draft constrains its proposals by grammars.
    `replay`: benchmarks' acceptance replay (draft/replay.py), which rewrites the proposals."""

    def __init__(self, drafter: Drafter, controls: ControlsEnv | None = None,
                 replay: AcceptanceReplay | None = None):
        self.drafter = drafter
        self.table = SeqTable()
        self.controls = ControlsTable(controls, draft=True)
        self.replay = replay

    def apply(self, msg: StepMsg) -> None:
        self.table.apply(msg)
        self.controls.apply(msg)
        if self.replay is not None:
            self.replay.apply(msg)

    def propose(self, msg: StepMsg) -> tuple[list[list[int]], float]:
        """The step's proposals [S, B − 1] (host lists) and their wall time."""
        t = time.perf_counter()
        req = ProposeRequest(list(msg.anchors), list(msg.starts), self.table.tables(msg))
        block = None if msg.num_drafts is None else msg.num_drafts + 1
        constrained = [self.controls.get(i) for i in msg.seq_ids]
        if not any(constrained):
            drafts = self.drafter.propose(req, block_size=block).tolist()
        else:  # [S, B − 1, k]
            candidates = self.drafter.propose(req, PROPOSAL_CANDIDATES, block).tolist()
            drafts = [[c[0] for c in cands] if ctl is None else ctl.constrain_proposal(cands)
                      for ctl, cands in zip(constrained, candidates, strict=True)]
        if self.replay is not None:
            drafts = self.replay.rewrite(msg, drafts)
        return drafts, time.perf_counter() - t

    def commit(self, msg: StepMsg, new_tokens: list[list[int]]) -> None:
        """The step's committed tokens (rank 0's result) advance the grammars."""
        if self.replay is not None:
            self.replay.commit(msg, new_tokens)
        if self.controls.by_seq and msg.kind in (StepKind.PREFILL, StepKind.ROUND):
            self.controls.commit(msg.seq_ids, new_tokens)

    def write_context(self, msg: StepMsg, aux: torch.Tensor, counts: list[int]) -> None:
        """The step's committed tokens' aux rows [sum counts, n_aux·H], in sequence order."""
        counts_np = np.asarray(counts, np.int64)
        first = np.cumsum(counts_np) - counts_np  # each sequence's first row
        positions = torch.from_numpy(np.repeat(np.asarray(msg.starts, np.int64) - first, counts_np)
                                     + np.arange(int(counts_np.sum())))
        self.drafter.write_context(ContextWrite(aux, positions, self.table.tables(msg),
                                                list(counts)))
