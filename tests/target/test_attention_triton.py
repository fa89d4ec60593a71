"""The Triton paged split-keys attention (target/kernels/attention_triton.py) against a
per-query fp64 reference: decode, verify blocks, several splits, the draft's non-causal
windowed blocks with their log-sum-exp, head dims that are not powers of two; pages out of
order, stale NaN past each sequence's keys. Also: a query's result is the same bits alone
(decode) as inside a block and whatever the other sequences are (what keeps speculative
decoding equal to target-only decoding). On CUDA also inside a CUDA graph.

Without CUDA the cases run in Triton's interpreter in one child process, this file run as a
script (tests/target/triton_child.py says why)."""

import json
from functools import partial

import pytest
import torch
import triton_child

triton = pytest.importorskip("triton")

from target.kernels import attention_triton  # noqa: E402
from target.kernels.attention_triton import SPLIT_KEYS, Launch, paged_attention  # noqa: E402

# "half": bf16 on CUDA; fp16 in the interpreter, whose tl.dot misreads bf16 operands (numpy has
# no bf16) while fp16 is numpy's own. The kernel code is the same for both.
DTYPES = {"fp32": torch.float32, "half": torch.bfloat16}
TOL = {"fp32": 1e-5, "half": 2e-2}


def dtype_on(name: str, device: str) -> torch.dtype:
    return torch.float16 if name == "half" and device == "cpu" else DTYPES[name]
# the models' adaptive splits at a small bound, so that short sequences take several splits
# and lengths double it: at most 4 splits of 64·2^j keys
ADAPTIVE = Launch(max_splits=4)
# the square-root growth at a small ratio: at most min(8, split / 16) splits, so 64 keys a
# split up to 256 keys, 128 up to 1024, then 8 splits at most
RATIO = Launch(max_splits=8, split_ratio=16)
# 16-row tiles where a sequence's rows (queries × query heads per kv head) fit: a decode's
# rows here, not a block's
SMALL = Launch(max_splits=4, small_rows=16)
# 64-row tiles in 8 warps for the launches whose rows do not fit 16 (a verify block's): on
# sm90 Triton compiles them to wgmma (tools/triton_aot.py), the 16- and 32-row ones to
# mma.sync; a decode and its verify block then run different MMA instructions
WIDE = Launch(block_m=64, warps=8, max_splits=4, small_rows=16)
# name: (context lengths before the queries, W, Hq, Hkv, D, page_size, causal, window[, launch])
CASES = {
    "decode": ([5, 17, 64], 1, 8, 2, 16, 4, True, None),
    "verify": ([0, 9, 130], 6, 4, 2, 16, 16, True, None),
    "splits": ([SPLIT_KEYS + 300, 7], 3, 4, 1, 16, 16, True, None),  # 2 splits, and 1
    # 40 splits (more than one merge chunk), a window that skips the first 35 of them
    "many_splits": ([40 * SPLIT_KEYS - 9], 2, 2, 1, 16, 64, False, 5 * SPLIT_KEYS + 7),
    "draft_window": ([0, 3, 40], 4, 4, 2, 16, 4, False, 7),  # non-causal block, window 7
    "head_dim_24": ([11, 30], 2, 2, 2, 24, 8, True, None),
    # adaptive: 6 keys in 1 split, 18 in 1, 301 in 3 of 128
    "adaptive_decode": ([5, 17, 300], 1, 8, 2, 16, 4, True, None, ADAPTIVE),
    # 6 keys in 1 split, 136 in 3 of 64, 1006 in 4 of 256
    "adaptive_verify": ([0, 130, 1000], 6, 4, 2, 16, 16, True, None, ADAPTIVE),
    # 902 keys in 4 splits of 256, the window skipping the first two
    "adaptive_window": ([900], 2, 2, 1, 16, 64, False, 300, ADAPTIVE),
    # 200 keys in 4 splits of 64, 700 in 6 of 128, 1500 in 6 of 256 (the bound of 8)
    "ratio_verify": ([194, 694, 1494], 6, 4, 2, 16, 16, True, None, RATIO),
    # 4 rows a sequence in 16-row tiles; a block of 6 × 2 rows in them too, 6 × 4 in 32-row
    "small_rows_decode": ([5, 17, 300], 1, 8, 2, 16, 4, True, None, SMALL),
    "small_rows_verify": ([0, 130, 1000], 6, 2, 1, 16, 16, True, None, SMALL),
    "small_rows_block": ([3, 70], 6, 8, 2, 16, 16, True, None, SMALL),
    # 6 × 4 rows a sequence in one 64-row tile, a decode's 4 in a 16-row one
    "wide_rows_verify": ([0, 130, 1000], 6, 8, 2, 16, 16, True, None, WIDE),
}


def problem(lens, width, heads, kv_heads, dim, page_size, dtype, device="cpu", seed=0):
    """Caches with each sequence's pages scattered (reversed, interleaved), every slot past a
    sequence's keys NaN; q [S·W, Hq, D]."""
    g = torch.Generator(device).manual_seed(seed)
    kv_lens = [n + width for n in lens]
    pages_each = max(-(-n // page_size) for n in kv_lens) + 1
    n_pages = pages_each * len(lens) + 3
    order = torch.randperm(n_pages, generator=g, device=device)
    tables = order[: pages_each * len(lens)].view(len(lens), pages_each).int()
    k_cache = torch.full((n_pages, page_size, kv_heads, dim), float("nan"), device=device)
    v_cache = torch.full_like(k_cache, float("nan"))
    for s, n in enumerate(kv_lens):
        keys = torch.arange(n, device=device)
        slots = tables[s].long()[keys // page_size] * page_size + keys % page_size
        for cache in (k_cache, v_cache):
            cache.view(-1, kv_heads, dim)[slots] = torch.randn(n, kv_heads, dim, generator=g,
                                                               device=device)
    q = torch.randn(len(lens) * width, heads, dim, generator=g, device=device)
    as_int = dict(dtype=torch.int32, device=device)
    return (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), tables,
            torch.tensor(lens, **as_int), torch.tensor(kv_lens, **as_int))


def reference(q, k_cache, v_cache, tables, q_first, kv_lens, scale, causal, window):
    """Each query on its own, fp64: out [S·W, Hq, D], lse [S·W, Hq]."""
    n_seqs = tables.shape[0]
    width, (_, page_size, kv_heads, dim) = q.shape[0] // n_seqs, k_cache.shape
    group = q.shape[1] // kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full(q.shape[:2], float("-inf"), dtype=torch.float64)
    for s in range(n_seqs):
        n = int(kv_lens[s])
        slots = [int(tables[s, j // page_size]) * page_size + j % page_size for j in range(n)]
        k = k_cache.reshape(-1, kv_heads, dim)[slots].double().cpu()
        v = v_cache.reshape(-1, kv_heads, dim)[slots].double().cpu()
        keys = torch.arange(n)
        for w in range(width):
            p = int(q_first[s]) + w
            seen = torch.ones(n, dtype=torch.bool)
            if causal:
                seen &= keys <= p
            if window is not None:
                seen &= (p - keys) < window
                if not causal:
                    seen &= (keys - p) < window
            if not seen.any():
                continue
            t = s * width + w
            for h in range(q.shape[1]):
                scores = (k[seen, h // group] @ q[t, h].double().cpu()) * scale
                lse[t, h] = torch.logsumexp(scores, 0)
                out[t, h] = scores.softmax(0) @ v[seen, h // group]
    return out, lse


def case_error(name: str, dtype: str, device: str) -> float:
    """The largest difference from the reference, output and log-sum-exp (finite ones; an
    infinite one must match exactly)."""
    lens, width, heads, kv_heads, dim, page_size, causal, window, *launch = CASES[name]
    q, kc, vc, tables, q_first, kv_lens = problem(lens, width, heads, kv_heads, dim, page_size,
                                                  dtype_on(dtype, device), device)
    scale = dim**-0.5
    out, lse = paged_attention(q, kc, vc, tables, q_first, kv_lens, scale, causal=causal,
                               window=window, with_lse=True, launch=launch[0] if launch else None)
    assert out.dtype == q.dtype and out.shape == q.shape and lse.dtype == torch.float32
    want, want_lse = reference(q, kc, vc, tables, q_first, kv_lens, scale, causal, window)
    finite = torch.isfinite(want_lse)
    if not torch.equal(torch.isfinite(lse.cpu()), finite):
        return "log-sum-exp infinite where the reference's is not (or the reverse)"
    return max((out.cpu().double() - want).abs().max().item(),
               (lse.cpu().double() - want_lse)[finite].abs().max().item())


def invariance(device: str, launch: Launch | None = None) -> dict[str, int]:
    """Bits that differ between a query decoded alone and the same query inside a verify
    block (several block sizes), and between a sequence alone and in a batch. bf16 on CUDA,
    fp16 in the interpreter (numpy's own half type). With ADAPTIVE or RATIO, lengths whose
    blocks keep their split length (300–308 keys: 128; 41–48: 64)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float16
    # fixed: the block crosses a split boundary in sequence 0; adaptive: 3 splits of 128
    lens = [SPLIT_KEYS - 3, 40] if launch is None else [300, 40]
    heads, kv_heads, dim, page_size = 8, 2, 32, 16
    width = 8
    q, kc, vc, tables, q_first, kv_lens = problem(lens, width, heads, kv_heads, dim, page_size,
                                                  dtype, device, seed=1)
    attend = partial(paged_attention, launch=launch)
    block = attend(q, kc, vc, tables, q_first, kv_lens, 0.2)
    out = {"decode_vs_block": 0, "block_sizes": 0, "alone_vs_batch": 0}
    for s in range(len(lens)):
        rows = slice(s * width, (s + 1) * width)
        alone = attend(q[rows], kc, vc, tables[s : s + 1], q_first[s : s + 1],
                                kv_lens[s : s + 1], 0.2)
        out["alone_vs_batch"] += int((alone != block[rows]).sum())
        for w in range(width):
            t = s * width + w
            one = attend(q[t : t + 1], kc, vc, tables[s : s + 1],
                                  q_first[s : s + 1] + w, q_first[s : s + 1] + w + 1, 0.2)
            out["decode_vs_block"] += int((one != block[t : t + 1]).sum())
        half = attend(q[rows][: width // 2], kc, vc, tables[s : s + 1],
                               q_first[s : s + 1], q_first[s : s + 1] + width // 2, 0.2)
        out["block_sizes"] += int((half != block[rows][: width // 2]).sum())
    return out


def merge_forms(device: str) -> dict[str, int]:
    """Bits that differ between the merge's forms on the same sequences (fp32 and half): one
    chunk a step (a launch with at most a chunk of splits) against two (a block table wide
    enough for more; the sequences' keys still fit one chunk, the only case where both forms
    can meet), and the running maxima in one load against a chunk at a time (MERGE_ALL)."""
    launch = Launch(split=64, merge_chunk=4)  # 3 splits and 1 of at most 4, then 5
    out = {"one_vs_two_chunks": 0, "one_load_vs_chunked_max": 0}
    for dtype in (torch.float32, torch.float16 if device == "cpu" else torch.bfloat16):
        q, kc, vc, tables, q_first, kv_lens = problem([150, 30], 2, 4, 2, 16, 16, dtype,
                                                      device, seed=2)
        assert attention_triton.split_bound(launch, tables.shape[1] * 16) <= 4
        wide = torch.cat([tables, tables[:, :1].expand(-1, 9)], 1)  # 5 split slots
        assert attention_triton.split_bound(launch, wide.shape[1] * 16) > 4
        for window in (None, 70):
            attend = partial(paged_attention, q, kc, vc, q_first=q_first, kv_lens=kv_lens,
                             scale=0.25, window=window, with_lse=True, launch=launch)
            one = attend(block_tables=tables)
            two = attend(block_tables=wide)
            out["one_vs_two_chunks"] += sum(int((a != b).sum())
                                            for a, b in zip(one, two, strict=True))
            most = attention_triton.MERGE_ALL
            attention_triton.MERGE_ALL = 1
            try:
                chunked = attend(block_tables=tables)
            finally:
                attention_triton.MERGE_ALL = most
            out["one_load_vs_chunked_max"] += sum(int((a != b).sum())
                                                  for a, b in zip(one, chunked, strict=True))
    return out


def model_differences() -> dict[str, float]:
    """fp32 end to end: the tiny demo target's verify logits (a round after a prefill, 3
    sequences) with rounds through the Triton kernel against the per-sequence reference; the
    draft's proposal logits (both published revisions: full attention; sliding windows) with
    Triton blocks against the gathering path. The largest absolute differences."""
    import sys
    import tempfile
    from pathlib import Path

    sys.path.insert(0, str(triton_child.ROOT / "tests" / "draft"))
    import draft_blocks
    from target_harness import TargetHarness

    from draft.model import DFlashDraftModel, set_block_attention
    from target.layers.attention import set_round_attention
    from tools.tiny_models import write_all

    out = {}
    h = TargetHarness(triton_child.ROOT / "tests/assets/tiny/target")
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (6, 13, 9)]
    tables = [h.pages(64) for _ in prompts]
    h.logits([h.seq(i, p, 0, tables[i], i) for i, p in enumerate(prompts)], verify=False)
    blocks = [torch.randint(0, 300, (6,), generator=g).tolist() for _ in prompts]
    rounds = {}
    for kind in ("reference", "triton"):
        set_round_attention(h.model, kind)
        rounds[kind] = torch.cat(h.logits([h.seq(i, b, len(prompts[i]), tables[i], i)
                                           for i, b in enumerate(blocks)], verify=True))
    out["target_round"] = (rounds["triton"] - rounds["reference"]).abs().max().item()
    for m in h.model.modules():  # adaptive splits, at the small bound
        if hasattr(m, "triton_launch"):
            m.triton_launch = ADAPTIVE
    adaptive = torch.cat(h.logits([h.seq(i, b, len(prompts[i]), tables[i], i)
                                   for i, b in enumerate(blocks)], verify=True))
    out["target_round_adaptive"] = (adaptive - rounds["reference"]).abs().max().item()
    with tempfile.TemporaryDirectory() as root:
        write_all(Path(root))
        for revision in ("draft-full", "draft-swa"):
            block = 4
            model = DFlashDraftModel.from_pretrained(Path(root) / revision, dtype=torch.float32,
                                                     block_size=block)
            want = draft_blocks.proposal_logits(model, block)
            set_block_attention(model, "triton")
            cache, slots, context, got = draft_blocks.proposal_logits(model, block,
                                                                      with_cache=True)
            # the block's K/V went to its own slots: every context slot still as written
            after = [(k.view(-1, *k.shape[2:])[slots], v.view(-1, *v.shape[2:])[slots])
                     for k, v in cache]
            kept = all(torch.equal(a, b) for pair, pair0 in zip(after, context, strict=True)
                       for a, b in zip(pair, pair0, strict=True))
            out[revision] = (got - want).abs().max().item() if kept else float("inf")
            set_block_attention(model, "triton", ADAPTIVE)  # "adaptive", at the small bound
            got = draft_blocks.proposal_logits(model, block)
            out[f"{revision}-adaptive"] = (got - want).abs().max().item()
    return out


interpreted, errors = triton_child.fixtures(__file__, case_error)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_split_keys_attention_equals_the_reference(errors, name, dtype):
    err = errors(f"{name}/{dtype}")
    assert not isinstance(err, str), err
    assert err < TOL[dtype]


INVARIANCE_LAUNCHES = {"fixed": None, "adaptive": ADAPTIVE, "ratio": RATIO, "small": SMALL,
                       "wide": WIDE}


@pytest.mark.parametrize("splits", INVARIANCE_LAUNCHES)
def test_a_query_gets_the_same_bits_alone_in_a_block_and_in_a_batch(interpreted, splits):
    if interpreted:
        got = interpreted["invariance"][splits]
    else:
        got = invariance("cuda", INVARIANCE_LAUNCHES[splits])
    assert got == {"decode_vs_block": 0, "block_sizes": 0, "alone_vs_batch": 0}


def test_the_merges_forms_give_the_same_bits(interpreted):
    got = interpreted["merge_forms"] if interpreted else merge_forms("cuda")
    assert got == {"one_vs_two_chunks": 0, "one_load_vs_chunked_max": 0}


@pytest.mark.parametrize("what", ["target_round", "target_round_adaptive", "draft-full",
                                  "draft-swa", "draft-full-adaptive", "draft-swa-adaptive"])
def test_the_models_attend_alike_through_the_kernel(interpreted, what):
    if interpreted is None:
        pytest.skip("the CPU harness in the interpreter; on CUDA the engine's golden check "
                    "(tools/golden_check.py) runs both models through the kernel")
    assert interpreted["models"][what] < 1e-5


def kernel_splits(launch: Launch, kv_len: int) -> int:
    """How many splits the kernels cut kv_len keys into (_adaptive_split's rule)."""
    if not launch.max_splits:
        return -(-kv_len // launch.split)
    split = launch.block_n
    for _ in range(24):
        most = (min(split // launch.split_ratio, launch.max_splits) if launch.split_ratio
                else launch.max_splits)
        split = split * 2 if split * most < kv_len else split
    return -(-kv_len // split)


@pytest.mark.parametrize("launch", [attention_triton.LAUNCH, ADAPTIVE, RATIO,
                                    attention_triton.ADAPTIVE_LAUNCH])
def test_the_partial_results_hold_every_split_of_a_sequence(launch):
    """split_bound(keys) ≥ the splits of every sequence of at most that many keys (sampled
    every 7 keys below it, and at it)."""
    keys = [1, 63, 64, 65, 300, 1000, 1024, 1025, 4097, 8192, 70000, 131088, 262160]
    most = 0
    for n in range(1, max(keys) + 1, 7):
        most = max(most, kernel_splits(launch, n))
        for k in keys:
            if n <= k < n + 7:
                got = max(most, kernel_splits(launch, k))
                assert got <= attention_triton.split_bound(launch, k), (launch, k)


def test_a_launch_parses_from_at_most_9_fields():
    assert Launch.parse("1024,32,64,4,2") == Launch()
    assert Launch.parse("512,16,64,8,3,16,256,4") == Launch(512, 16, 64, 8, 3, 16, 256, 4)
    assert Launch.parse("1024,32,64,4,2,32,256,4,16") == Launch(max_splits=256,
                                                               split_ratio=4, small_rows=16)
    with pytest.raises(ValueError, match="10 given"):
        Launch.parse("1024,32,64,4,2,32,256,4,16,0")


def test_small_rows_tiles_only_the_launches_whose_rows_fit():
    assert [SMALL.rows_tile(r) for r in (1, 8, 16, 17, 128)] == [16, 16, 16, 32, 32]
    # the models': a decode's 8 rows a kv head in 16, a verify block's 16 × 8 in 32
    assert [attention_triton.ADAPTIVE_LAUNCH.rows_tile(r) for r in (8, 128)] == [16, 32]


def test_available_only_where_the_kernels_can_run():
    assert attention_triton.available("cuda") == (attention_triton.triton is not None)
    assert attention_triton.available("cpu") is False  # this process has no interpreter


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_replays_in_a_cuda_graph_with_new_lengths():
    q, kc, vc, tables, q_first, kv_lens = problem([100, 37], 4, 16, 2, 256, 16,
                                                  torch.bfloat16, "cuda")
    eager = paged_attention(q, kc, vc, tables, q_first, kv_lens, 0.0625)
    graph = torch.cuda.CUDAGraph()
    first, lens = q_first.clone(), kv_lens.clone()
    first.fill_(0), lens.fill_(4)
    paged_attention(q, kc, vc, tables, first, lens, 0.0625)  # warm-up (compiles)
    with torch.cuda.graph(graph):
        out = paged_attention(q, kc, vc, tables, first, lens, 0.0625)
    first.copy_(q_first), lens.copy_(kv_lens)
    graph.replay()
    assert torch.equal(out, eager)


if __name__ == "__main__":  # the interpreter child (triton_child.run)
    print(json.dumps({"errors": triton_child.case_errors(CASES, DTYPES, case_error, "cpu"),
                      "invariance": {name: invariance("cpu", launch)
                                     for name, launch in INVARIANCE_LAUNCHES.items()},
                      "merge_forms": merge_forms("cpu"),
                      "models": model_differences()}))
