"""KV pages and GDN state slots. A sequence reserves, when admitted, every page it can reach
(prompt + max_tokens + one verify block), so a running sequence never waits for memory. With
a prefix cache (cluster/prefix_cache.py) its block table starts with the cached pages of its
hit, shared, and the pages it fills may enter the cache; cached pages no sequence holds count
as free and are given out again, least recently released first, once no other page is."""

from __future__ import annotations

from collections import deque

from cluster.prefix_cache import Hit, PrefixCache
from cluster.sequence import Sequence


class BlockManager:
    def __init__(self, num_pages: int, page_size: int, num_slots: int,
                 prefix: PrefixCache | None = None):
        self.page_size = page_size
        self.free_blocks = deque(range(num_pages))
        self.free_slots = deque(range(num_slots))
        self.num_pages = num_pages
        self.num_slots = num_slots
        self.prefix = prefix

    def pages_needed(self, num_positions: int) -> int:
        return -(-num_positions // self.page_size)

    @property
    def num_free_pages(self) -> int:
        """Pages a sequence may take: free ones and cached ones no sequence holds."""
        return len(self.free_blocks) + (len(self.prefix.evictable) if self.prefix else 0)

    def can_admit(self, num_positions: int, hit: Hit | None = None) -> bool:
        shared = hit.pages if hit else []
        # a hit's pages that no one holds now are counted free: they are not for the others
        held_back = sum(p in self.prefix.evictable for p in shared) if self.prefix else 0
        return bool(self.free_slots) and (self.num_free_pages - held_back
                                          >= self.pages_needed(num_positions) - len(shared))

    def admit(self, seq: Sequence, num_positions: int, hit: Hit | None = None) -> None:
        shared = hit.pages if hit else []
        if shared:
            self.prefix.hold(shared)
        fresh = []
        for _ in range(self.pages_needed(num_positions) - len(shared)):
            fresh.append(self.free_blocks.popleft() if self.free_blocks
                         else self.prefix.evict_page())
        seq.block_table = list(shared) + fresh
        seq.state_slot = self.free_slots.popleft()

    def free(self, seq: Sequence) -> None:
        if self.prefix is not None:
            self.free_blocks.extend(self.prefix.release(seq.block_table))
        else:
            self.free_blocks.extend(seq.block_table)
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
        seq.block_table = []
        seq.state_slot = -1

    @property
    def usage(self) -> float:
        """The share of pages running sequences hold."""
        return 1.0 - self.num_free_pages / self.num_pages
