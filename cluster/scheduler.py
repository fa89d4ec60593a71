"""Which sequences run this step.

Admission is FCFS while a state slot and every page a sequence can reach are free; a request
that does not fit blocks those behind it, so a long one cannot starve. A step is either a
prefill step (prompt chunks within `max_num_batched_tokens`: first the prompt left unfinished
by the previous prefill step, then newly admitted ones) or one propose/verify round for every
sequence whose prompt is fully cached. When both kinds of work exist the steps alternate, so a
long prompt delays running streams by at most one chunk per round, and running streams cannot
starve admission.

With a prefix cache (cluster/prefix_cache.py) an admitted prompt starts after its hit, and a
chunk the budget cuts short ends at a page boundary, where its state is snapshotted (the
prompt's last page boundary before its last token is snapshotted inside the chunk that passes
it)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from cluster.block_manager import BlockManager
from cluster.prefix_cache import Hit, PrefixCache, page_keys
from cluster.sequence import SeqStatus, Sequence


@dataclass
class ScheduledStep:
    prefill: list[Sequence]  # each feeds prompt_ids[num_cached : num_cached + its chunk_len]
    chunk_lens: list[int]  # [len(prefill)] prompt tokens each prefill sequence feeds
    decode: list[Sequence]  # one round each (uniform B tokens); empty on a prefill step


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_model_len: int,
                 lookahead: int, max_num_batched_tokens: int = 8192):
        self.blocks = blocks
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.lookahead = lookahead  # positions a verify block may write past the committed ones
        self.max_num_batched_tokens = max_num_batched_tokens  # prompt tokens per prefill step
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admitted, in admission order; some may be prefilling
        self._prefill_turn = True  # whose turn it is when both kinds of work exist

    def reach(self, seq: Sequence) -> int:
        return min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len) + self.lookahead

    def add(self, seq: Sequence) -> None:
        if self.blocks.pages_needed(self.reach(seq)) > self.blocks.num_pages:
            raise ValueError(
                f"request needs {self.reach(seq)} KV positions but the cache holds only "
                f"{self.blocks.num_pages * self.blocks.page_size}; lower max_tokens"
            )
        self.waiting.append(seq)

    def schedule(self) -> ScheduledStep:
        # The engine advances num_cached after each prefill step; the plan is computed from it.
        decode = [s for s in self.running if s.prefilled]
        if self._prefill_turn or not decode:
            prefill, chunk_lens = self._schedule_prefill()
            if prefill:
                self._prefill_turn = False
                return ScheduledStep(prefill, chunk_lens, decode=[])
        self._prefill_turn = True
        return ScheduledStep([], [], decode)

    def _schedule_prefill(self) -> tuple[list[Sequence], list[int]]:
        budget = self.max_num_batched_tokens
        seqs, chunk_lens = [], []
        for seq in self.running:  # unfinished prompts first, oldest first
            if budget == 0:
                break
            if not seq.prefilled:
                n = self._chunk(seq, budget)
                seqs.append(seq)
                chunk_lens.append(n)
                budget -= n
        while budget > 0 and self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            hit = self._lookup(seq)
            if not self.blocks.can_admit(self.reach(seq), hit):
                break  # no overtaking: later requests wait behind the one waiting for memory
            self.waiting.popleft()
            self.blocks.admit(seq, self.reach(seq), hit)
            if hit is not None:
                self.prefix.admitted(len(seq.prompt_ids), hit)
                seq.num_cached = seq.num_cached_tokens = hit.num_tokens
                seq.restore_slot = hit.snapshot_slot
                seq.page_keys = hit.keys(self.prefix)
                seq.last_snapshot = hit.key or None
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)
            n = self._chunk(seq, budget)
            seqs.append(seq)
            chunk_lens.append(n)
            budget -= n
        return seqs, chunk_lens

    @property
    def prefix(self) -> PrefixCache | None:
        return self.blocks.prefix

    def _lookup(self, seq: Sequence) -> Hit | None:
        """The prompt's prefix-cache hit; None without a cache or where every prompt token's
        log-probabilities are asked for (they are computed by prefilling the prompt)."""
        if self.prefix is None or seq.params.prompt_logprobs is not None:
            return None
        if seq.prompt_keys is None:
            seq.prompt_keys = page_keys(seq.prompt_ids, self.blocks.page_size)
        return self.prefix.lookup(len(seq.prompt_ids), seq.prompt_keys)

    def snapshot_at(self, seq: Sequence) -> int:
        """The last page boundary before the prompt's last token: where the prefix cache
        snapshots the prompt's state (0: none, the prompt is shorter than a page and one)."""
        page = self.blocks.page_size
        return (len(seq.prompt_ids) - 1) // page * page

    def _chunk(self, seq: Sequence, budget: int) -> int:
        """The prompt tokens seq feeds this step: what is left, within the budget; with a
        prefix cache, a chunk the budget cuts short before the prompt's snapshot point ends at
        a page boundary (a snapshot point too)."""
        n = min(seq.num_prompt_left, budget)
        if self.prefix is None or seq.params.prompt_logprobs is not None:
            return n
        start, end = seq.num_cached, seq.num_cached + n
        if end < self.snapshot_at(seq):
            aligned = end // self.blocks.page_size * self.blocks.page_size
            if aligned > start:
                return aligned - start
        return n

    def snapshot_in(self, seq: Sequence, n: int) -> int | None:
        """Where a chunk of n prompt tokens from seq.num_cached on leaves the prefix cache a
        snapshot of the sequence's state: the prompt's snapshot point if the chunk passes it
        (the forward takes the state there), else the chunk's end if that is a page boundary
        before it; None for neither."""
        start, end, at = seq.num_cached, seq.num_cached + n, self.snapshot_at(seq)
        if start < at < end:
            return at
        if 0 < end <= at and end % self.blocks.page_size == 0:
            return end
        return None

    def finish(self, seq: Sequence, reason: str) -> None:
        # Also the abort path of a sequence still waiting or still prefilling.
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if seq.boundary_slot is not None:
            self._return_boundary_slot(seq)
        self.blocks.free(seq)

    def lend_boundary_slot(self, seq: Sequence) -> None:
        """The sequence starts decoding: with a prefix cache, it gets a boundary slot where
        its output can reach a page boundary it has not committed yet."""
        if self.prefix is None or seq.finished:
            return
        page = self.blocks.page_size
        if self.tap_end(seq) < (seq.num_cached // page + 1) * page:
            return
        seq.boundary_slot = self.prefix.lend_boundary_slot()
        seq.boundary_from = seq.num_cached

    def tap_end(self, seq: Sequence) -> int:
        """Where the sequence's tokens end at the latest (its prompt and max_tokens): its
        boundary slot takes no boundary past it (a round's kept tokens may run on past the
        last token it outputs)."""
        return min(len(seq.prompt_ids) + seq.params.max_tokens, self.max_model_len)

    def _return_boundary_slot(self, seq: Sequence) -> None:
        """A sequence that ended with a stop or its length leaves the state its boundary slot
        holds as the snapshot of that page, where its rounds reached one within its tokens
        (after a stop, the last round's kept tokens may have passed the stop token: its
        boundary may then lie past the tokens the sequence keeps)."""
        page = self.blocks.page_size
        pages = min(seq.num_cached, self.tap_end(seq)) // page
        keep = (seq.finish_reason in ("stop", "length") and len(seq.page_keys) >= pages
                and seq.boundary_from < pages * page <= seq.num_tokens)
        key = seq.page_keys[pages - 1] if keep else None
        if self.prefix.return_boundary_slot(seq.boundary_slot, key, pages, seq.last_snapshot):
            seq.last_snapshot = key
        seq.boundary_slot = None

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
