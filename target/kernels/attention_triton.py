"""Paged attention for few queries per sequence (decode, verify rounds, the draft's blocks) as
a Triton split-keys kernel that reads the KV pages in place: no gathered copy of the context,
no queries × keys tensor, no host values (it captures in CUDA graphs).

Each sequence s has W queries at positions q_first[s] + w (w < W) and sees keys
0 … kv_lens[s] − 1 of its pages (block_tables[s]), filtered per query by causality and a
window. A query head's rows are stacked per kv head: row r = w·G + g is query w of head
kv·G + g (G query heads per kv head), so each kv head's keys are read once for all its query
heads.

  1. split, grid (row tiles, key splits, S·Hkv): a program takes BLOCK_M rows of one kv head
     and the keys of one split (SPLIT_KEYS consecutive positions; or, with Launch.max_splits,
     the fewest BLOCK_N·2^j that make at most max_splits splits of the sequence's keys),
     walks them BLOCK_N at a time (page ids looked up per key), and keeps the online softmax
     (running max m, sum l, unnormalised output acc, fp32). It writes m, l and acc for its
     rows.
  2. merge, grid (T·Hq,): per row, out = Σ acc_i·e^(m_i−M) / Σ l_i·e^(m_i−M) with M the
     largest m_i, and the log-sum-exp M + log Σ l_i·e^(m_i−M). M comes from one load of
     every split's m (up to MERGE_ALL splits); the sums take the splits merge_chunk at a time
     (a fixed-shape sum within a chunk, chunks in order). Where a launch's split slots
     (split_bound) pass one chunk, two chunks' loads are in flight before either is summed:
     the merge's time at long context is its waits on memory, one per load it cannot issue
     before the last one returns. Where they fit one chunk (short context), one chunk a step
     keeps the program's registers (48 a thread against 128 on sm90), and so the programs an
     SM holds when a launch has many rows. The two forms give the same bits: the chunks are
     summed in the same order either way.

A row's result does not depend on the batch around it, bit for bit: the launch shape (Launch)
is one per model, never chosen per call; tiles, splits and merge chunks start at fixed
positions; a key a row may not see adds exactly nothing (weight 0, and its value loaded as 0
past kv_lens), and so does a split it has no key in. So a decode step and the same query
inside a verify block of any size give the same bits (speculative decoding = target-only
decoding in bf16 too), and a sequence's result does not depend on the other sequences. With
max_splits a sequence's split length depends on its own key count: still independent of the
batch, and the same for a decode and its verify block unless the block's keys cross a
key count where the split length doubles.

Row tiles vary fastest in the grid: the programs reading one split's keys run side by side
and share them through L2, so K/V come from memory about once per kv head.

Triton is optional: without it this module imports and `available()` is False. On CPU
tensors the kernels run only in Triton's interpreter (TRITON_INTERPRET=1 set before triton is
first imported; tests/target/test_attention_triton.py runs its cases in a child process)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from target.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None



@dataclass(frozen=True)
class Launch:
    """The launch shape: `split` keys per split program, `block_m` rows and `block_n` keys per
    step, `warps` and `stages` of the split kernel; `merge_chunk` splits per merge step;
    `small_rows` a smaller tile for few rows."""

    split: int = 1024
    block_m: int = 32
    block_n: int = 64
    warps: int = 4
    stages: int = 2
    merge_chunk: int = 32
    # 0: every split holds `split` keys. Else each sequence's splits hold the fewest
    # block_n·2^j keys that make at most max_splits of them: at a short context many small
    # splits (programs enough to fill the GPU), at a long one at most max_splits partial
    # results per row to write and merge.
    max_splits: int = 0
    # With max_splits, 0 or at most split_len / split_ratio splits too: the split count then
    # grows as the square root of the key count (split_len² ≥ split_ratio · keys), so a wide
    # batch at mid context is not cut into max_splits partial results of a few keys each.
    split_ratio: int = 0
    # 0, or the tile height of a launch whose rows (a sequence's queries × the query heads of
    # a kv head) fit in it: a decode's 8 rows on Qwen3.5-35B-A3B in a 16-row tile rather than
    # a quarter of a 32-row one. Per launch, so a decode and the verify block it matches run
    # different tiles. Each row's arithmetic is its own in either tile, so their bits agree:
    # the invariance test checks it on CUDA, and bench/round_attention.py's row_invariant at
    # the model's shapes.
    small_rows: int = 0

    def rows_tile(self, rows: int) -> int:
        """The tile height of a launch of `rows` rows a sequence."""
        return self.small_rows if 0 < rows <= self.small_rows else self.block_m

    @classmethod
    def parse(cls, text: str) -> Launch:
        """A launch from the benches' and tools' --launch text: the fields in order, comma
        separated, split to stages required, the rest optional (at most 9)."""
        values = [int(x) for x in text.split(",")]
        if len(values) > 9:
            raise ValueError(f"a launch takes at most 9 fields, {len(values)} given: {text!r}")
        return cls(*values)


# The tiles both launches below use, from the sweep of bench/round_attention.py --launch on the
# H200 (docs/BENCHMARKS.md): against 16-row tiles (8 warps), 32-row ones take 23-25 % less
# time for a block of 16 queries at 128k keys (1 and 8 sequences) and up to 18 % more for one
# query (8 sequences; 0.17 against 0.11 ms at 8k). Verify blocks are what a DFlash round runs.
# LAUNCH splits every sequence's keys 1024 at a time: paged_attention's default where no launch
# is given (the tests' and benches' fixed-split form; the models take ADAPTIVE_LAUNCH).
LAUNCH = Launch()
SPLIT_KEYS = LAUNCH.split
# selection.ATTENTION_LAUNCH, the models' launch: the same tiles, splits per
# sequence by its length, split_len² ≥ 4 · keys and at most 256 splits: 64 keys a split up to
# 1k keys (a decode at batch 1 over 2 kv heads runs 16 one-tile programs at 512 keys, where
# the fixed split has 2 programs walking all 512), 128 up to 4k, 256 up to 16k, 512 up to 64k,
# 1024 up to 256k (the fixed launch's programs and bits), then at most 256 splits. In the H200
# sweep of bench/round_attention.py (docs/BENCHMARKS.md) those lengths were at or near the
# fastest of the caps 32, 64 and 128 at every key count; a cap of 128 splits alone cut 8k
# keys into 128 one-tile splits, whose partial results cost a batch of 8 verify blocks twice
# the fixed split's time, and took 2048-key splits just past 128k, where a batch-1 decode's
# attention took 0.134 against 0.110 ms with 1024.
ADAPTIVE_SPLITS = 256
ADAPTIVE_RATIO = 4
# A decode's rows (8 a kv head on the 35B-A3B) in 16-row tiles: 0.092 against 0.101 ms at
# 128k keys on the H200, and 8-9 % less at 8 sequences; a verify block's 128 rows keep 32.
ADAPTIVE_SMALL_ROWS = 16
ADAPTIVE_LAUNCH = Launch(max_splits=ADAPTIVE_SPLITS, split_ratio=ADAPTIVE_RATIO,
                         small_rows=ADAPTIVE_SMALL_ROWS)


def available(device: torch.device | str) -> bool:
    """The kernels can run on this device: Triton imports, and the device is CUDA (or the
    interpreter is on, for tests)."""
    if triton is None:
        return False
    if torch.device(device).type == "cuda":
        return True
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    from target.kernels.pdl import await_prior

    @triton.jit
    def _adaptive_split(kv_len, BLOCK_N: tl.constexpr, MAX_SPLITS: tl.constexpr,
                        RATIO: tl.constexpr):
        """The fewest BLOCK_N·2^j keys per split that make at most MAX_SPLITS splits of kv_len
        keys, and with RATIO at most split / RATIO of them (doubled at most 24 times)."""
        split = kv_len * 0 + BLOCK_N
        for _ in tl.static_range(24):
            if RATIO > 0:
                most = tl.minimum(split // RATIO, MAX_SPLITS)
            else:
                most = split * 0 + MAX_SPLITS
            split = tl.where(split * most < kv_len, split * 2, split)
        return split

    @triton.jit
    def _pages(Tables, s, k0, hi, stride_tb, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
        """The page of each key k0 … k0 + BLOCK_N of sequence s (0, unread, at and past hi)."""
        keys = k0 + tl.arange(0, BLOCK_N)
        # int64: page · stride_kb passes 2^31 elements in a large pool (the scratch pages
        # of captured graphs sit at its top)
        return tl.load(Tables + s * stride_tb + keys // PAGE, mask=keys < hi,
                       other=0).to(tl.int64)

    @triton.jit
    def _kv_tile(K, V, page, k0, hi, kvh, d, d_ok, stride_kb, stride_kp, stride_kh,
                 stride_vb, stride_vp, stride_vh, PAGE: tl.constexpr, BLOCK_N: tl.constexpr):
        """Keys k0 … k0 + BLOCK_N of kv head kvh in their pages (_pages): K and V
        [BLOCK_N, BLOCK_D], zero (and nothing read) at and past `hi`."""
        keys = k0 + tl.arange(0, BLOCK_N)
        k_ok = keys < hi
        off = keys % PAGE
        kv_ok = k_ok[:, None] & d_ok[None, :]
        k = tl.load(K + page[:, None] * stride_kb + off[:, None] * stride_kp
                    + kvh * stride_kh + d[None, :], mask=kv_ok, other=0.0)
        v = tl.load(V + page[:, None] * stride_vb + off[:, None] * stride_vp
                    + kvh * stride_vh + d[None, :], mask=kv_ok, other=0.0)
        return k, v

    @triton.jit
    def _attend(q, k, v, k0, hi, q_pos, row_ok, m_i, l_i, acc, scale, window,
                BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                IEEE: tl.constexpr):
        """One step of the online softmax over keys k0 … k0 + BLOCK_N (K and V tiles k, v):
        the rows' running max m_i, sum l_i and output acc, updated."""
        keys = k0 + tl.arange(0, BLOCK_N)
        k_ok = keys < hi
        if IEEE:
            qk = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            qk = tl.dot(q, tl.trans(k))
        seen = k_ok[None, :] & row_ok[:, None]
        if CAUSAL:
            seen = seen & (keys[None, :] <= q_pos[:, None])
        if WINDOWED:
            seen = seen & (q_pos[:, None] - keys[None, :] < window)
            if not CAUSAL:
                seen = seen & (keys[None, :] - q_pos[:, None] < window)
        qk = tl.where(seen, qk * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw nothing yet
        alpha = tl.exp(m_i - shift)
        p = tl.exp(qk - shift[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        return m_new, l_i, acc

    @triton.jit
    def _split_kernel(Q, K, V, Tables, QFirst, KvLens, Acc, Stat,
                      stride_qt, stride_qh, stride_kb, stride_kp, stride_kh,
                      stride_vb, stride_vp, stride_vh, stride_tb,
                      scale, width, group, rows, n_heads, n_tokens, window,
                      PAGE: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                      MAX_SPLITS: tl.constexpr, RATIO: tl.constexpr, CAUSAL: tl.constexpr,
                      WINDOWED: tl.constexpr, IEEE: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        tile, split, sk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        n_kv = n_heads // group
        s, kvh = sk // n_kv, sk % n_kv
        kv_len = tl.load(KvLens + s)
        q_first = tl.load(QFirst + s)
        if MAX_SPLITS > 0:
            split_len = _adaptive_split(kv_len, BLOCK_N, MAX_SPLITS, RATIO)
        else:
            split_len = SPLIT
        lo = split * split_len
        hi = tl.minimum(lo + split_len, kv_len)
        first = 0
        if WINDOWED:  # keys below the earliest query's window are never seen
            first = tl.maximum(q_first - window + 1, 0)
        if (lo >= kv_len) | (lo + split_len <= first):
            return  # the merge does not read this split
        start = lo
        if first > lo:
            start = lo + (first - lo) // BLOCK_N * BLOCK_N  # tiles stay at fixed positions

        r = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = r < rows
        w, g = r // group, r % group
        token = s * width + w
        head = kvh * group + g
        q_pos = q_first + w
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        q = tl.load(Q + token[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        for k0 in range(start, hi, BLOCK_N):
            page = _pages(Tables, s, k0, hi, stride_tb, PAGE, BLOCK_N)
            k, v = _kv_tile(K, V, page, k0, hi, kvh, d, d_ok, stride_kb, stride_kp,
                            stride_kh, stride_vb, stride_vp, stride_vh, PAGE, BLOCK_N)
            m_i, l_i, acc = _attend(q, k, v, k0, hi, q_pos, row_ok, m_i, l_i, acc, scale,
                                    window, BLOCK_N, CAUSAL, WINDOWED, IEEE)

        # Acc [n_splits, T, Hq, D], Stat [n_splits, 2, T, Hq] (m, l), fp32
        at = (split * n_tokens + token) * n_heads + head
        tl.store(Acc + at[:, None] * D + d[None, :], acc, mask=row_ok[:, None] & d_ok[None, :])
        st = (split * 2 * n_tokens + token) * n_heads + head
        tl.store(Stat + st, m_i, mask=row_ok)
        tl.store(Stat + st + n_tokens * n_heads, l_i, mask=row_ok)

    @triton.jit
    def _merge_chunk(Acc, m_at, i, first, last, row, d, d_ok, n_tokens, n_heads,
                     D: tl.constexpr):
        """Splits i's m, l and partial outputs for one row (−inf, 0, 0 outside
        [first, last))."""
        ok = (i >= first) & (i < last)
        m = tl.load(m_at + i * 2 * n_tokens * n_heads, mask=ok, other=float("-inf"))
        total = tl.load(m_at + (2 * i + 1) * n_tokens * n_heads, mask=ok, other=0.0)
        part = tl.load(Acc + (i[:, None] * n_tokens * n_heads + row) * D + d[None, :],
                       mask=ok[:, None] & d_ok[None, :], other=0.0)
        return m, total, part

    @triton.jit
    def _merge_kernel(Acc, Stat, QFirst, KvLens, Out, Lse, stride_ot, stride_oh,
                      width, n_heads, n_tokens, window,
                      D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
                      SPLIT: tl.constexpr, MAX_SPLITS: tl.constexpr, RATIO: tl.constexpr,
                      CHUNK: tl.constexpr, ALL: tl.constexpr, PAIR: tl.constexpr,
                      WINDOWED: tl.constexpr, WITH_LSE: tl.constexpr, PDL: tl.constexpr):
        await_prior(PDL)
        row = tl.program_id(0)  # token · Hq + head
        token, head = row // n_heads, row % n_heads
        s = token // width
        kv_len = tl.load(KvLens + s)
        if MAX_SPLITS > 0:
            split_len = _adaptive_split(kv_len, BLOCK_N, MAX_SPLITS, RATIO)
        else:
            split_len = SPLIT
        first = 0
        if WINDOWED:  # the split kernel wrote nothing below the window
            first = tl.maximum(tl.load(QFirst + s) - window + 1, 0) // split_len
        last = (kv_len + split_len - 1) // split_len  # splits [first, last) may hold its keys
        start = first // CHUNK * CHUNK  # chunks at fixed positions
        d = tl.arange(0, BLOCK_D)
        d_ok = d < D
        c = tl.arange(0, CHUNK)
        m_at = Stat + row  # split i: m at i·2·T·Hq, l at (2i + 1)·T·Hq
        if ALL > 0:  # every split's m in one load
            i = tl.arange(0, ALL)
            top = tl.max(tl.load(m_at + i * 2 * n_tokens * n_heads,
                                 mask=(i >= first) & (i < last), other=float("-inf")), 0)
        else:
            big = tl.full([CHUNK], float("-inf"), tl.float32)
            for i0 in range(start, last, CHUNK):
                i = i0 + c
                big = tl.maximum(big, tl.load(m_at + i * 2 * n_tokens * n_heads,
                                              mask=(i >= first) & (i < last),
                                              other=float("-inf")))
            top = tl.max(big, 0)
        shift = tl.where(top == float("-inf"), 0.0, top)
        total = tl.zeros([CHUNK], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        # With PAIR, two chunks a step: both chunks' loads in flight before either is summed,
        # the sums in chunk order (the second only where it holds a split: adding its zeros
        # could turn a −0 into +0), so the bits are those of one chunk a step
        for i0 in range(start, last, CHUNK * (1 + PAIR)):
            m, sums, part = _merge_chunk(Acc, m_at, i0 + c, first, last, row, d, d_ok,
                                         n_tokens, n_heads, D)
            if PAIR:
                m2, sums2, part2 = _merge_chunk(Acc, m_at, i0 + CHUNK + c, first, last, row,
                                                d, d_ok, n_tokens, n_heads, D)
            w = tl.exp(m - shift)  # 0 for a split the row has no key in, and outside
            total += sums * w
            acc += tl.sum(part * w[:, None], 0)
            if PAIR:
                w2 = tl.exp(m2 - shift)
                total += sums2 * w2
                if i0 + CHUNK < last:
                    acc += tl.sum(part2 * w2[:, None], 0)
        denom = tl.sum(total, 0)
        out = tl.where(denom > 0.0, acc / denom, 0.0)
        tl.store(Out + token * stride_ot + head * stride_oh + d,
                 out.to(Out.dtype.element_ty), mask=d_ok)
        if WITH_LSE:
            tl.store(Lse + row, tl.where(denom > 0.0, shift + tl.log(denom), float("-inf")))


# The most splits whose running maxima the merge reads in one load (MERGE_ALL or fewer, a
# power of two); past it, a chunk at a time.
MERGE_ALL = 1024


def merge_all(n_splits: int) -> int:
    """The merge's ALL: the power of two that covers `n_splits` split slots, or 0 past
    MERGE_ALL."""
    size = triton.next_power_of_2(n_splits)
    return size if size <= MERGE_ALL else 0


def split_bound(launch: Launch, keys: int) -> int:
    """The most splits a sequence of at most `keys` keys takes: the partial results' rows.
    With split_ratio a sequence's split length only grows with its key count, so none takes
    more than split_len(keys) / split_ratio splits."""
    if not launch.max_splits:
        return -(-keys // launch.split)
    bound = min(launch.max_splits, -(-keys // launch.block_n))
    if launch.split_ratio:
        split = launch.block_n
        while split * min(launch.max_splits, split // launch.split_ratio) < keys:
            split *= 2
        bound = min(bound, split // launch.split_ratio)
    return max(bound, 1)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, q_first: torch.Tensor, kv_lens: torch.Tensor,
                    scale: float, *, causal: bool = True, window: int | None = None,
                    with_lse: bool = False, launch: Launch | None = None):
    """q [S·W, Hq, D]: W queries per sequence at positions q_first[s] + w; k_cache/v_cache
    [num_pages, page_size, Hkv, D]; block_tables [S, P] int32 (P·page_size ≥ kv_lens); q_first,
    kv_lens [S] int32 on q's device. Key j of sequence s is seen by the query at position p when
    j < kv_lens[s], j ≤ p (causal) and |p − j| < window (window; one-sided when causal).
    Returns out [S·W, Hq, D] in q's dtype, and with_lse also the log-sum-exp [S·W, Hq] fp32
    (−inf, out 0, for a query that sees no key). `launch`: the model's
    (selection.ATTENTION_LAUNCH), LAUNCH where none is given."""
    launch = launch or LAUNCH
    n_tokens, n_heads, dim = q.shape
    n_seqs, n_pages = block_tables.shape
    page_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    width, group = n_tokens // n_seqs, n_heads // kv_heads
    assert n_seqs * width == n_tokens and group * kv_heads == n_heads
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    keys = n_pages * page_size
    n_splits = split_bound(launch, keys)
    rows = group * width
    block_d = max(16, triton.next_power_of_2(dim))
    dev = q.device
    acc = torch.empty(n_splits, n_tokens, n_heads, dim, dtype=torch.float32, device=dev)
    stat = torch.empty(n_splits, 2, n_tokens, n_heads, dtype=torch.float32, device=dev)
    out = torch.empty_like(q)
    # without with_lse the merge writes no log-sum-exp (WITH_LSE off): any pointer will do
    lse = torch.empty(n_tokens, n_heads, dtype=torch.float32, device=dev) if with_lse else out
    q_first, kv_lens = q_first.to(torch.int32), kv_lens.to(torch.int32)
    win = window if window is not None else 0
    ieee = q.dtype == torch.float32
    block_m = launch.rows_tile(rows)
    _split_kernel[(triton.cdiv(rows, block_m), n_splits, n_seqs * kv_heads)](
        q, k_cache, v_cache, block_tables, q_first, kv_lens, acc, stat,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        scale, width, group, rows, n_heads, n_tokens, win,
        PAGE=page_size, D=dim, BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_N=launch.block_n,
        SPLIT=launch.split, MAX_SPLITS=launch.max_splits, RATIO=launch.split_ratio,
        CAUSAL=causal, WINDOWED=window is not None, IEEE=ieee,
        num_warps=launch.warps, num_stages=launch.stages, **pdl.options(q))
    _merge_kernel[(n_tokens * n_heads,)](
        acc, stat, q_first, kv_lens, out, lse, out.stride(0), out.stride(1),
        width, n_heads, n_tokens, win,
        D=dim, BLOCK_D=block_d, BLOCK_N=launch.block_n, SPLIT=launch.split,
        MAX_SPLITS=launch.max_splits, RATIO=launch.split_ratio, CHUNK=launch.merge_chunk,
        ALL=merge_all(n_splits), PAIR=n_splits > launch.merge_chunk,
        WINDOWED=window is not None, WITH_LSE=with_lse, num_warps=4, **pdl.options(acc))
    return (out, lse) if with_lse else out
