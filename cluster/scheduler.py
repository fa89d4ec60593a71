"""Which sequences run this step. FCFS admission while a state slot and the pages a
sequence can reach are free; a step either prefills newly admitted sequences or runs one
propose/verify round for every running sequence."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cluster.block_manager import BlockManager
from cluster.sequence import SeqStatus, Sequence


@dataclass
class ScheduledStep:
    prefill: list[Sequence]
    decode: list[Sequence]


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_model_len: int,
                 lookahead: int, max_prefill_tokens: int = 8192):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.lookahead = lookahead  # positions a verify block may write past the committed ones
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def reach(self, seq: Sequence) -> int:
        return min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len) + self.lookahead

    def add(self, seq: Sequence) -> None:
        if self.blocks.pages_needed(self.reach(seq)) > self.blocks.num_blocks:
            raise ValueError(
                f"request needs {self.reach(seq)} KV positions but the cache holds only "
                f"{self.blocks.num_blocks * self.blocks.page_size}; lower max_tokens"
            )
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        admitted: list[Sequence] = []
        budget = self.max_prefill_tokens
        while self.waiting and len(self.running) + len(admitted) < self.max_num_seqs:
            seq = self.waiting[0]
            if admitted and len(seq.prompt_ids) > budget:
                break
            if not self.blocks.can_admit(self.reach(seq)):
                break
            self.waiting.popleft()
            self.blocks.admit(seq, self.reach(seq))
            seq.status = SeqStatus.RUNNING
            budget -= len(seq.prompt_ids)
            admitted.append(seq)
        if admitted:
            self.running.extend(admitted)
            return ScheduledStep(prefill=admitted, decode=[])
        return ScheduledStep(prefill=[], decode=list(self.running))

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.free(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
