"""What the engine keeps of finished and running sequences for later prompts that start the
same way: full KV pages named by their content, and Gated DeltaNet state snapshots at page
boundaries. The driver's bookkeeping only; the pages and the state slots live on the workers.

A full page is named by a hash chain: page i's key digests page i−1's key and the page's
tokens, so equal keys mean equal token prefixes up to the page's end. A page's KV and the
draft's context K/V in the same page depend only on the tokens up to it (the target's hidden
states there), so a page is as good for any sequence whose prefix has its key.

The hybrid target also needs the recurrent state at the point where a sequence takes over: a
snapshot is a copy of every linear-attention layer's conv and recurrent state after a
page-aligned position, in a slot of its own, named by the key of the page it ends. A prompt
hits at the deepest snapshot whose chain of pages is still cached and which leaves at least
one prompt token to prefill (the first output token needs the last prompt token's logits): its
pages up to there are shared, the snapshot is copied into its state slot, and it prefills the
rest. Pages past the snapshot are not shared even where cached: the sequence must run the
recurrence through those tokens anyway, and that forward writes their KV, which a
differently chunked computation may round differently from the cached page's.

Sharing: a page held by running sequences has a reference count; at zero it stays cached,
evictable, least recently released first, and a sequence releases its pages deepest first so
that a chain is evicted from its end. A page is given out again only when no free page is
left. Snapshots have a fixed pool of slots; when it is full, the least recently used snapshot
that has one deeper one after it on the same chain goes first (that one serves every prompt
that goes on along the chain), then the least recently used one (a leaf, or a branch point:
the prefix several chains share). A snapshot whose page is evicted is dropped with it.

A sequence that ends after decoding leaves a snapshot too, at its last full page: while it
decodes it holds a slot of the pool (a boundary slot, up to half the pool among the running
sequences), which each round's commit overwrites with its state at the last page boundary
the round's kept tokens reach (target/kernels/gdn_slots.py Taps), and when it ends (a stop or
its length) that slot becomes the snapshot of that page: the next turn of a conversation
resumes after the answer, not after the previous prompt.

Nothing is entered before the step that computed it has completed: a page when every
position in it is committed, a snapshot when the prefill step that ends at its position
returns. A sequence aborted or failed mid-way leaves only what completed steps wrote."""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

import numpy as np


def page_keys(tokens: list[int], page_size: int, parent: bytes = b"",
              first_page: int = 0) -> list[bytes]:
    """The chain keys of the full pages of `tokens` from page `first_page` on, `parent` the
    key of the page before it. (Token ids as int32 bytes, each page a slice of one buffer:
    ~2.7 ms for a 32k-token prompt on a 2-core CPU, a third less than a copy per page.)"""
    data = memoryview(np.asarray(tokens, dtype=np.int32).tobytes())
    step, blake2b, keys = 4 * page_size, hashlib.blake2b, []
    for i in range(first_page, len(tokens) // page_size):
        parent = blake2b(data[i * step : (i + 1) * step], digest_size=16, key=parent).digest()
        keys.append(parent)
    return keys


@dataclass
class Snapshot:
    slot: int
    pages: int  # the page-aligned position it holds the state after, in pages
    parent: bytes | None  # the key of the snapshot before it on its chain, if any
    children: int = 0  # snapshots after it on the same chain


@dataclass
class Hit:
    """A prompt's match: `pages` shared pages (their ids), the snapshot's slot to restore
    (None: no hit) and the hit's length in tokens."""

    pages: list[int] = field(default_factory=list)
    snapshot_slot: int | None = None
    num_tokens: int = 0
    key: bytes = b""  # the snapshot's (the last shared page's key)

    def keys(self, cache: PrefixCache) -> list[bytes]:
        """The shared pages' keys, in order."""
        return [cache.key_of[p] for p in self.pages]


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompts looked up
    query_tokens: int = 0  # their tokens
    hits: int = 0  # prompts that hit
    hit_tokens: int = 0  # prompt tokens not prefilled
    page_evictions: int = 0
    snapshot_evictions: int = 0
    snapshots_taken: int = 0


@dataclass(frozen=True)
class PrefixCacheSnapshot:
    """The prefix cache's figures since the engine started (cluster/prefix_cache.py)."""

    queries: int  # prompts looked up
    query_tokens: int  # their tokens
    hits: int  # prompts that hit
    hit_tokens: int  # prompt tokens served from the cache
    cached_pages: int  # KV pages the cache holds (in use or evictable)
    snapshots: int  # state snapshots held
    snapshot_slots: int  # the snapshot pool's size
    snapshot_bytes: int  # one snapshot's bytes per target rank (0: not known)
    page_evictions: int
    snapshot_evictions: int
    boundary_slots: int = 0  # pool slots lent to decoding sequences (their answers' snapshots)


class PrefixCache:
    def __init__(self, page_size: int, snapshot_slots: list[int]):
        self.page_size = page_size
        self.page_of: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.refs: dict[int, int] = {}  # cached page → running sequences holding it
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, unheld; LRU first
        self.snapshots: dict[bytes, Snapshot] = {}
        self._snapshot_lru: OrderedDict[bytes, None] = OrderedDict()
        self.free_snapshot_slots = list(reversed(snapshot_slots))
        self.num_snapshot_slots = len(snapshot_slots)
        self.boundary_slots: set[int] = set()  # lent to decoding sequences
        self.stats = PrefixCacheStats()

    # ---- lookup -----------------------------------------------------------------------------

    def lookup(self, prompt_len: int, keys: list[bytes]) -> Hit:
        """The deepest usable snapshot of a prompt whose full pages have these keys, and the
        pages before it (an empty Hit: none). Changes nothing: `admitted` counts it once the
        sequence is admitted."""
        usable = (prompt_len - 1) // self.page_size  # leave at least one token to prefill
        hit, pages = Hit(), []
        for i, key in enumerate(keys[:usable]):
            page = self.page_of.get(key)
            if page is None:
                break
            pages.append(page)
            snap = self.snapshots.get(key)
            if snap is not None:
                hit = Hit(list(pages), snap.slot, (i + 1) * self.page_size, key)
        return hit

    def admitted(self, prompt_len: int, hit: Hit) -> None:
        """A sequence was admitted with this hit: the query and the hit are counted, the
        snapshot is the most recently used."""
        self.stats.queries += 1
        self.stats.query_tokens += prompt_len
        if hit.snapshot_slot is not None:
            self._snapshot_lru.move_to_end(hit.key)
            self.stats.hits += 1
            self.stats.hit_tokens += hit.num_tokens

    def hold(self, pages: list[int]) -> None:
        """A sequence takes these cached pages (a hit's) for its block table."""
        for page in pages:
            self.refs[page] = self.refs.get(page, 0) + 1
            self.evictable.pop(page, None)

    # ---- entering what steps computed ------------------------------------------------------

    def enter_pages(self, keys: list[bytes], pages: list[int]) -> None:
        """A sequence's full, committed pages with their chain keys: each enters the cache
        held by it, unless its key is there already (another sequence computed the same
        content: this page stays the sequence's own)."""
        for key, page in zip(keys, pages, strict=True):
            if key in self.page_of or page in self.key_of:
                continue
            self.page_of[key] = page
            self.key_of[page] = key
            self.refs[page] = self.refs.get(page, 0) + 1

    def reserve_snapshot(self, keep: set[int] = frozenset()) -> int | None:
        """A slot for a snapshot a step will write, evicting one if none is free (not one of
        `keep`: slots the same step restores from). None: no slot (an empty pool)."""
        if self.free_snapshot_slots:
            return self.free_snapshot_slots.pop()
        victim = self._snapshot_victim(keep)
        if victim is None:
            return None
        slot = self.snapshots[victim].slot
        self._drop_snapshot(victim)
        self.stats.snapshot_evictions += 1
        self.free_snapshot_slots.remove(slot)
        return slot

    def enter_snapshot(self, key: bytes, slot: int, pages: int, parent: bytes | None) -> bool:
        """The step that copied the state after `pages` pages into `slot` completed: it
        becomes the snapshot of the page `key` ends. False (the slot is freed) where that page
        has one already."""
        if key in self.snapshots or key not in self.page_of:
            self.free_snapshot_slots.append(slot)
            return False
        if parent is not None and parent in self.snapshots:
            self.snapshots[parent].children += 1
        else:
            parent = None
        self.snapshots[key] = Snapshot(slot, pages, parent)
        self._snapshot_lru[key] = None
        self.stats.snapshots_taken += 1
        return True

    def cancel_snapshot(self, slot: int) -> None:
        """A reserved slot whose step did not complete."""
        self.free_snapshot_slots.append(slot)

    # ---- boundary slots: a decoding sequence's state at its last page boundary ----------

    def lend_boundary_slot(self) -> int | None:
        """A snapshot slot for a sequence that starts decoding: its rounds leave its state at
        each page boundary they reach there, and when it ends the slot becomes the snapshot
        of its last full page (`return_boundary_slot`). At most half the pool is lent, so
        that prompts' snapshots keep the rest; None: none to lend."""
        if len(self.boundary_slots) >= self.num_snapshot_slots // 2:
            return None
        slot = self.reserve_snapshot()
        if slot is not None:
            self.boundary_slots.add(slot)
        return slot

    def return_boundary_slot(self, slot: int, key: bytes | None, pages: int,
                             parent: bytes | None) -> bool:
        """A sequence ended: its boundary slot holds the state after `pages` pages, the last
        of which has `key` (None: it reached no boundary, or the slot is not to be kept).
        True where it became that page's snapshot; otherwise the slot is free again."""
        if slot not in self.boundary_slots:  # (the cache was reset since it was lent)
            return False
        self.boundary_slots.discard(slot)
        if key is None:
            self.free_snapshot_slots.append(slot)
            return False
        return self.enter_snapshot(key, slot, pages, parent)

    # ---- release and eviction ---------------------------------------------------------------

    def release(self, block_table: list[int]) -> list[int]:
        """A finished sequence's pages, deepest first: cached ones it held become evictable
        when no one else holds them; returns the others (free again)."""
        free = []
        for page in reversed(block_table):
            if page not in self.key_of:
                free.append(page)
                continue
            self.refs[page] -= 1
            if self.refs[page] == 0:
                del self.refs[page]
                self.evictable[page] = None
        free.reverse()
        return free

    def evict_page(self) -> int | None:
        """The least recently released cached page no one holds, out of the cache (with its
        snapshot); None if there is none."""
        if not self.evictable:
            return None
        page, _ = self.evictable.popitem(last=False)
        key = self.key_of.pop(page)
        del self.page_of[key]
        if key in self.snapshots:
            self._drop_snapshot(key)
            self.stats.snapshot_evictions += 1
        self.stats.page_evictions += 1
        return page

    def _snapshot_victim(self, keep: set[int]) -> bytes | None:
        first = None
        for key in self._snapshot_lru:
            snap = self.snapshots[key]
            if snap.slot in keep:
                continue
            if snap.children == 1:  # (a branch point serves prompts of each branch)
                return key
            if first is None:
                first = key
        return first

    def _drop_snapshot(self, key: bytes) -> None:
        snap = self.snapshots.pop(key)
        self._snapshot_lru.pop(key, None)
        if snap.parent is not None and snap.parent in self.snapshots:
            self.snapshots[snap.parent].children -= 1
        self.free_snapshot_slots.append(snap.slot)

    # ---- figures ----------------------------------------------------------------------------

    @property
    def num_cached_pages(self) -> int:
        return len(self.key_of)

    @property
    def num_snapshots(self) -> int:
        return len(self.snapshots)

    def reset(self) -> None:
        """Forget everything (the workers' caches were lost: an engine restart)."""
        slots = ([s.slot for s in self.snapshots.values()] + self.free_snapshot_slots
                 + list(self.boundary_slots))
        self.__init__(self.page_size, sorted(slots))
