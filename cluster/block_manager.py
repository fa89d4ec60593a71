"""KV pages and GDN state slots. A sequence reserves, when admitted, every page it can reach
(prompt + max_tokens + one verify block), so a running sequence never waits for memory."""

from __future__ import annotations

from collections import deque

from cluster.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, num_slots: int):
        self.page_size = page_size
        self.free_blocks = deque(range(num_pages))
        self.free_slots = deque(range(num_slots))
        self.num_pages = num_pages
        self.num_slots = num_slots

    def pages_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    def can_admit(self, num_positions: int) -> bool:
        return bool(self.free_slots) and len(self.free_blocks) >= self.pages_needed(num_positions)

    def admit(self, seq: Sequence, num_positions: int) -> None:
        n = self.pages_needed(num_positions)
        seq.block_table = [self.free_blocks.popleft() for _ in range(n)]
        seq.state_slot = self.free_slots.popleft()

    def free(self, seq: Sequence) -> None:
        self.free_blocks.extend(seq.block_table)
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
        seq.block_table = []
        seq.state_slot = -1

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_blocks) / self.num_pages
