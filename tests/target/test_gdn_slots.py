"""The in-place recurrence by slot (target/kernels/gdn_slots.py) equals gdn_torch's recurrence
run per sequence on its own state with the key heads expanded: decode (L = 1), a 16-token
verify, grouped value heads (2 per key head) and none, partial value tiles, strided v, fp32 and
bf16; three sequences on slots [5, 1, 3] of a cache of 8. The cache invariants are exact: a
verify leaves the whole cache bit-unchanged, write_state changes only the given slots, a kept
count of 0 leaves its slot bit-unchanged and the others equal the reference run over their
first n tokens only; need_output=False returns None and still writes. A sequence's output and
final state are the same bits alone and inside the batch, and a block's tokens the same bits
as the same tokens decoded one by one; each launch shape (SlotsLaunch) passes the cases. The
torch reference (recurrent_slots_reference) is checked the same way in plain torch. On CUDA
also at the real sizes, without a host sync, and replayed in a CUDA graph with new slots and
kept counts.

Without CUDA the kernel cases run in Triton's interpreter in one child process, this file run
as a script (tests/target/triton_child.py says why)."""

import json
from functools import partial

import pytest
import torch
import torch.nn.functional as F
import triton_child

from target.kernels import gdn_slots
from target.kernels.gdn_slots import (
    LAUNCH,
    SlotsLaunch,
    commit_conv,
    commit_conv_reference,
    recurrent_slots,
    recurrent_slots_available,
    recurrent_slots_reference,
)
from target.kernels.gdn_torch import recurrent_gated_delta_rule

needs_triton = pytest.mark.skipif(gdn_slots.triton is None, reason="needs triton")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# Outputs: relative error in norm (bf16 outputs are rounded to bf16; the interpreter's casts
# truncate). States stay fp32 whatever the inputs: tight in both.
TOL = {"fp32": 1e-5, "bf16": 1e-2}
STATE_TOL = 1e-5
SLOTS, CACHE_SLOTS = [5, 1, 3], 8
# name: (L, Hk, Hv, Dk, Dv, num_kept or None, write_state, need_output)
CASES = {
    "decode": (1, 2, 4, 16, 16, None, True, True),  # two value heads per key head
    "verify": (16, 2, 4, 16, 16, None, False, True),  # the cache is only read
    "one_value_head_per_key": (5, 3, 3, 16, 16, None, True, True),
    "partial_tiles": (4, 1, 2, 32, 48, None, True, True),  # BLOCK_V 32: tiles of 32 and 16
    "kept": (6, 2, 4, 16, 16, [0, 3, 6], True, True),  # outputs past n: the state as it is
    "commit": (6, 2, 4, 16, 16, [0, 3, 6], True, False),  # the commit's replay
}
# The launch shapes the cases run at (bench/gdn_kernel.py sweeps these and more): the default,
# and narrower tiles with fewer warps.
LAUNCHES = {"default": LAUNCH, "narrow": SlotsLaunch(16, 2), "warp": SlotsLaunch(8, 1)}


def problem(n_seqs, length, hk, hv, dk, dv, dtype, device="cpu", seed=0,
            cache_slots=CACHE_SLOTS):
    """q, k [S, L, Hk, Dk] normalised (q scaled); v [S, L, Hv, Dv] a strided view into wider
    rows, as the layer's split of its conv output gives; g [S, L, Hv] fp32 log-decays; beta
    in v's dtype; state_cache [N, Hv, Dk, Dv] fp32."""
    gen = torch.Generator(device).manual_seed(seed)
    kw = dict(generator=gen, device=device)
    q = F.normalize(torch.randn(n_seqs, length, hk, dk, **kw), dim=-1) * dk**-0.5
    k = F.normalize(torch.randn(n_seqs, length, hk, dk, **kw), dim=-1)
    wide = torch.randn(n_seqs, length, hv * dv + 8, **kw).to(dtype)
    v = wide[..., 8:].view(n_seqs, length, hv, dv)
    g = F.logsigmoid(torch.randn(n_seqs, length, hv, **kw) + 2)
    beta = torch.rand(n_seqs, length, hv, **kw)
    cache = torch.randn(cache_slots, hv, dk, dv, **kw)
    return q.to(dtype), k.to(dtype), v, g, beta.to(dtype), cache


def expected(q, k, v, g, beta, cache, slots, kept):
    """Per sequence with its key heads expanded: the outputs with g = β = 0 past its kept
    count n, and its final state from the first n tokens alone. [S, L, Hv, Dv], [S, Hv, Dk,
    Dv], fp32."""
    group = v.shape[2] // q.shape[2]
    outs, finals = [], []
    for s, slot in enumerate(slots):
        n = q.shape[1] if kept is None else kept[s]
        qs, ks = q[s].repeat_interleave(group, 1), k[s].repeat_interleave(group, 1)
        gs, bs = g[s].clone(), beta[s].clone()
        gs[n:], bs[n:] = 0, 0
        outs.append(recurrent_gated_delta_rule(qs, ks, v[s], gs, bs, cache[slot])[0])
        finals.append(recurrent_gated_delta_rule(qs[:n], ks[:n], v[s, :n], g[s, :n],
                                                 beta[s, :n], cache[slot])[1])
    return torch.stack(outs), torch.stack(finals)


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def case_error(name: str, dtype: str, device: str, fn=recurrent_slots) -> float:
    """fn's relative error against `expected` on CASES[case] (name "case@launch": the kernel
    at LAUNCHES[launch]): of the outputs, or of the states where there are none. The cache
    invariants and the states' error are asserted."""
    name, _, launch = name.partition("@")
    if launch:
        fn = partial(fn, launch=LAUNCHES[launch])
    length, hk, hv, dk, dv, kept, write, need = CASES[name]
    q, k, v, g, beta, cache = problem(len(SLOTS), length, hk, hv, dk, dv, DTYPES[dtype], device)
    want_o, want_states = expected(q, k, v, g, beta, cache, SLOTS, kept)
    before = cache.clone()
    got = fn(q, k, v, g, beta, cache, torch.tensor(SLOTS, device=device),
             num_kept=None if kept is None else torch.tensor(kept, device=device),
             write_state=write, need_output=need)
    others = [i for i in range(CACHE_SLOTS) if i not in SLOTS]
    assert torch.equal(cache[others], before[others]), "a slot outside `slots` changed"
    state_err = None
    if not write:
        assert torch.equal(cache, before), "write_state=False wrote the cache"
    else:
        for s, slot in enumerate(SLOTS):
            if kept is not None and kept[s] == 0:
                assert torch.equal(cache[slot], before[slot]), f"slot {slot} kept 0, changed"
        state_err = rel_err(cache[SLOTS], want_states)
        assert state_err < STATE_TOL, f"states off by {state_err:.2e}"
    if not need:
        assert got is None, type(got)
        return state_err
    assert got.dtype == v.dtype and got.shape == v.shape, (got.dtype, got.shape)
    return rel_err(got, want_o)


def consistency(device: str) -> dict[str, bool]:
    """Each of three bf16 sequences alone (S = 1) against the batch of three: outputs and
    written states, bit for bit; also with a kept count, as the commit runs."""
    q, k, v, g, beta, cache = problem(3, 5, 2, 4, 16, 48, torch.bfloat16, device, seed=1)
    slots = torch.tensor(SLOTS, device=device)
    kept = torch.tensor([2, 0, 5], device=device)
    batch_cache, alone_cache = cache.clone(), cache.clone()
    batch = recurrent_slots(q, k, v, g, beta, batch_cache, slots, write_state=True)
    alone = torch.cat([recurrent_slots(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1],
                                       beta[i : i + 1], alone_cache, slots[i : i + 1],
                                       write_state=True) for i in range(3)])
    recurrent_slots(q, k, v, g, beta, batch_cache, slots, num_kept=kept, write_state=True,
                    need_output=False)
    for i in range(3):
        recurrent_slots(q[i : i + 1], k[i : i + 1], v[i : i + 1], g[i : i + 1],
                        beta[i : i + 1], alone_cache, slots[i : i + 1],
                        num_kept=kept[i : i + 1], write_state=True, need_output=False)
    return {"outputs_equal": torch.equal(batch, alone),
            "states_equal": torch.equal(batch_cache, alone_cache)}


def block_vs_decode(device: str) -> dict[str, int]:
    """Per launch shape: the elements (outputs and final states) where a block — a verify's
    outputs, then the commit of all its tokens — differs from the same tokens decoded one by
    one, each decode writing its state. bf16 and the real model's Dk on CUDA (where the
    launch shape decides the reductions' order); smaller and at the default shape alone in
    the interpreter, which is slow."""
    launches = LAUNCHES
    if device == "cuda":
        dtype, length, dk, dv = torch.bfloat16, 16, 128, 48
    else:  # (the interpreter's numpy has no bf16; its bits do not depend on the tiling)
        dtype, length, dk, dv = torch.float16, 5, 32, 32
        launches = {"default": LAUNCH}
    q, k, v, g, beta, cache = problem(3, length, 2, 4, dk, dv, dtype, device, seed=2)
    slots = torch.tensor(SLOTS, device=device)
    kept = torch.full((3,), length, device=device)
    out = {}
    for name, launch in launches.items():
        block_cache, step_cache = cache.clone(), cache.clone()
        block = recurrent_slots(q, k, v, g, beta, block_cache, slots, launch=launch)
        recurrent_slots(q, k, v, g, beta, block_cache, slots, num_kept=kept, write_state=True,
                        need_output=False, launch=launch)
        steps = torch.cat([recurrent_slots(q[:, t : t + 1], k[:, t : t + 1], v[:, t : t + 1],
                                           g[:, t : t + 1], beta[:, t : t + 1], step_cache,
                                           slots, write_state=True, launch=launch)
                           for t in range(q.shape[1])], dim=1)
        out[name] = int((block != steps).sum() + (block_cache != step_cache).sum())
    return out


def model_rounds(device: str) -> str | None:
    """The tiny target through prefill and two rounds per L (decode L = 1; L = 5 keeping
    [1, 3, 5], [5, 1, 2]) with gdn_recurrence "slots" against the default recurrence: None if
    every logit and state agrees, else what differs (test_gdn_batched_round.run)."""
    from target_harness import TargetHarness
    from test_gdn_batched_round import assert_runs_close, run

    from configs.kernels import KernelConfig
    from tests.conftest import ASSETS

    for L, kepts in ((1, ([1, 1, 1],)), (5, ([1, 3, 5], [5, 1, 2]))):
        for kept in kepts:
            runs = [run(TargetHarness(ASSETS / "tiny" / "target"), KernelConfig(**kw), kept, L)
                    for kw in ({}, {"gdn_recurrence": "slots"})]
            try:
                assert_runs_close(runs[1], runs[0])
            except AssertionError as e:
                return f"L {L}, kept {kept}: {e}"
    return None


interpreted, errors = triton_child.fixtures(__file__, case_error)


def launch_cases() -> list[tuple[str, str]]:
    """(case@launch, dtype): every case at the default shape; at the other tile widths a
    partial value tile. fp32 past the default: the interpreter is slow, and the launch shape
    changes only the tiling and, on a GPU, the order of the reductions (block_vs_decode's
    bits)."""
    out = [(f"{name}@default", dtype) for name in CASES for dtype in DTYPES]
    return out + [(f"partial_tiles@{launch}", "fp32") for launch in LAUNCHES
                  if launch != "default"]


@needs_triton
@pytest.mark.parametrize("name, dtype", launch_cases())
def test_kernel_equals_the_per_sequence_reference(errors, name, dtype):
    err = errors(f"{name}/{dtype}")
    assert not isinstance(err, str), err
    assert err < TOL[dtype]


@needs_triton
def test_a_block_gets_the_bits_of_its_tokens_decoded_one_by_one(interpreted):
    """What makes speculative decoding equal plain decoding through this kernel: a verify's
    outputs and its commit's states are a decode's, bit for bit, at every launch shape."""
    got = interpreted["block_vs_decode"] if interpreted is not None else block_vs_decode("cuda")
    assert "default" in got and not any(got.values()), got


@needs_triton
def test_a_sequence_gets_the_same_bits_alone_and_in_a_batch(interpreted):
    got = interpreted["consistency"] if interpreted is not None else consistency("cuda")
    assert got == {"outputs_equal": True, "states_equal": True}, got


@needs_triton
def test_the_tiny_target_rounds_the_same_through_the_kernel(interpreted):
    """set_kernels(gdn_recurrence="slots") through the layer: decode writing states in place,
    verify reading them, the commit replaying the kept tokens in place (fp32, interpreter)."""
    if interpreted is not None:
        assert interpreted["model_rounds"] is None, interpreted["model_rounds"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", CASES)
def test_reference_equals_the_per_sequence_reference(name, dtype):
    assert case_error(name, dtype, "cpu", recurrent_slots_reference) < TOL[dtype]


@needs_triton
def test_no_sequences_or_no_tokens_launch_nothing():
    for n_seqs, length in ((0, 4), (2, 0)):
        q, k, v, g, beta, cache = problem(n_seqs, length, 1, 2, 16, 16, torch.float32)
        before = cache.clone()
        slots = torch.arange(n_seqs)
        o = recurrent_slots(q, k, v, g, beta, cache, slots, write_state=True)
        assert o.shape == (n_seqs, length, 2, 16) and torch.equal(cache, before)
        assert recurrent_slots(q, k, v, g, beta, cache, slots, need_output=False) is None


@needs_triton
def test_cpu_tensors_outside_the_interpreter_are_refused():
    if gdn_slots._interpreted():
        pytest.skip("TRITON_INTERPRET=1 in this process")
    q, k, v, g, beta, cache = problem(1, 1, 1, 2, 16, 16, torch.float32)
    with pytest.raises(RuntimeError, match="interpreter"):
        recurrent_slots(q, k, v, g, beta, cache, torch.tensor([0]))
    assert not recurrent_slots_available(v)


# Qwen3.5-35B-A3B: 16 key heads, 32 value heads, Dk = Dv = 128.
REAL = dict(hk=16, hv=32, dk=128, dv=128)


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 16])
def test_real_sizes_match_the_reference(length):
    n_seqs, cache_slots = 8, 64
    q, k, v, g, beta, cache = problem(n_seqs, length, dtype=torch.bfloat16, device="cuda",
                                      cache_slots=cache_slots, **REAL)
    assert recurrent_slots_available(v)
    slots = torch.randperm(cache_slots, device="cuda")[:n_seqs]
    kept = torch.randint(0, length + 1, (n_seqs,), device="cuda")
    for kw in (dict(write_state=True), dict(write_state=False),
               dict(num_kept=kept, write_state=True, need_output=False)):
        got_cache, want_cache = cache.clone(), cache.clone()
        got = recurrent_slots(q, k, v, g, beta, got_cache, slots, **kw)
        want = recurrent_slots_reference(q, k, v, g, beta, want_cache, slots, **kw)
        if want is not None:
            assert rel_err(got, want) < TOL["bf16"]
        assert rel_err(got_cache, want_cache) < 1e-5


@pytest.mark.gpu
def test_no_host_sync_and_a_cuda_graph_replays_with_new_slots():
    """A verify (read only) and its commit (kept counts, in place) captured once, replayed with
    other inputs, slots and kept counts copied into the same buffers: the eager bits."""
    n_seqs, length, cache_slots = 4, 16, 16
    args = dict(dtype=torch.bfloat16, device="cuda", cache_slots=cache_slots, **REAL)
    q, k, v, g, beta, cache = problem(n_seqs, length, **args)
    q2, k2, v2, g2, beta2, _ = problem(n_seqs, length, seed=1, **args)
    slots, slots2 = torch.tensor([3, 9, 0, 12], device="cuda"), torch.tensor([7, 1, 15, 3],
                                                                             device="cuda")
    kept, kept2 = torch.tensor([16, 0, 5, 1], device="cuda"), torch.tensor([2, 16, 0, 9],
                                                                           device="cuda")

    def round_(q, k, v, g, beta, cache, slots, kept):
        o = recurrent_slots(q, k, v, g, beta, cache, slots)
        recurrent_slots(q, k, v, g, beta, cache, slots, num_kept=kept, write_state=True,
                        need_output=False)
        return o

    round_(q, k, v, g, beta, cache.clone(), slots, kept)  # compiles both variants
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        round_(q, k, v, g, beta, cache.clone(), slots, kept)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    graph_cache = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = round_(q, k, v, g, beta, graph_cache, slots, kept)
    eager_cache = cache.clone()
    want = round_(q2, k2, v2, g2, beta2, eager_cache, slots2, kept2)
    for dst, src in ((q, q2), (k, k2), (v, v2), (g, g2), (beta, beta2), (slots, slots2),
                     (kept, kept2)):
        dst.copy_(src)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)
    assert torch.equal(graph_cache, eager_cache)
    assert not torch.equal(graph_cache, cache)  # the replay did write


def conv_commits(device: str) -> dict[str, bool]:
    """commit_conv equal to commit_conv_reference, bit for bit: kept counts per sequence (0,
    all L, between) and one n for all (a decode's 1); the block's conv inputs contiguous and
    as a transposed view; the cache in fp32 and in half (the cast: bf16 on CUDA, fp16 in the
    interpreter, whose numpy has no bf16)."""
    g = torch.Generator().manual_seed(3)
    n_seqs, channels, k_1, length = 3, 37, 3, 5
    half = torch.bfloat16 if device == "cuda" else torch.float16
    slots = torch.tensor([4, 0, 6], device=device)
    out = {}
    for layout in ("contiguous", "transposed"):
        seq = torch.randn(n_seqs, channels, k_1 + length, generator=g)
        if layout == "transposed":
            seq = torch.randn(n_seqs, k_1 + length, channels, generator=g).transpose(1, 2)
        seq = seq.to(device)
        for kept_name, kept in (("per_seq", torch.tensor([0, length, 2], device=device)),
                                ("one", 1)):
            for dtype in (torch.float32, half):
                cache = torch.randn(7, channels, k_1, generator=g).to(device, dtype)
                want = cache.clone()
                commit_conv(seq, cache, slots, kept)
                commit_conv_reference(seq, want, slots, kept)
                out[f"{layout}/{kept_name}/{dtype}"] = torch.equal(cache, want)
    return out


def tap_commits(device: str, rec=recurrent_slots, conv=commit_conv) -> dict[str, bool]:
    """A commit with taps (gdn_slots.Taps), bit for bit: each committed slot as the commit
    without taps leaves it; each tapped sequence's boundary slot holding its state (the
    recurrence over its first t tokens alone) and conv state (conv_seq's window at t) after
    its tap's t tokens, and every other slot untouched. Pages of 4; sequences starting at
    positions 6, 3, 9 and 2 keeping 5, 6, 2 and 6 of 6 tokens, ending at 100, 100, 100 and 6:
    taps after 2 tokens (position 8), 5 (positions 4 and 8 are reached: the last), none
    (9 + 2 < 12), and 2 (position 4: its end at 6 keeps it from 8)."""
    gen = torch.Generator().manual_seed(5)
    n_seqs, length, hk, hv, dk, dv, channels, k_1, page = 4, 6, 2, 4, 16, 16, 24, 3, 4
    q, k, v, g, beta, cache = problem(n_seqs, length, hk, hv, dk, dv, torch.float32, device,
                                      seed=4, cache_slots=12)
    conv_seq = torch.randn(n_seqs, channels, k_1 + length, generator=gen).to(device)
    conv_cache = torch.randn(12, channels, k_1, generator=gen).to(device)
    slots = torch.tensor([5, 1, 3, 7], device=device)
    kept = torch.tensor([5, 6, 2, 6], device=device)
    taps = gdn_slots.Taps(torch.tensor([8, 9, 10, 11], device=device),
                          torch.tensor([6, 3, 9, 2], device=device),
                          torch.tensor([100, 100, 100, 6], device=device), page)
    want_t = [2, 5, 0, 2]
    plain, plain_conv = cache.clone(), conv_cache.clone()
    rec(q, k, v, g, beta, plain, slots, num_kept=kept, write_state=True, need_output=False)
    conv(conv_seq, plain_conv, slots, kept)
    tapped, tapped_conv = cache.clone(), conv_cache.clone()
    rec(q, k, v, g, beta, tapped, slots, num_kept=kept, write_state=True, need_output=False,
        taps=taps)
    conv(conv_seq, tapped_conv, slots, kept, taps)
    alone = cache.clone()  # the state after t tokens: the commit of t tokens, taps off
    rec(q, k, v, g, beta, alone, slots, num_kept=torch.tensor(want_t, device=device),
        write_state=True, need_output=False)
    out = {"committed": torch.equal(tapped[slots], plain[slots])
           and torch.equal(tapped_conv[slots], plain_conv[slots])}
    for s, t in enumerate(want_t):
        slot = int(taps.slots[s])
        if t == 0:
            out[f"untapped {s}"] = (torch.equal(tapped[slot], cache[slot])
                                    and torch.equal(tapped_conv[slot], conv_cache[slot]))
        else:
            out[f"state {s}"] = torch.equal(tapped[slot], alone[int(slots[s])])
            out[f"conv {s}"] = torch.equal(tapped_conv[slot],
                                           conv_seq[s, :, t : t + k_1].to(conv_cache.dtype))
    others = [i for i in range(12) if i not in slots.tolist() + taps.slots.tolist()]
    out["others"] = (torch.equal(tapped[others], cache[others])
                     and torch.equal(tapped_conv[others], conv_cache[others]))
    return out


def test_taps_leave_the_boundary_states_in_the_reference():
    got = tap_commits("cpu", recurrent_slots_reference, commit_conv_reference)
    assert len(got) == 9 and all(got.values()), got


@needs_triton
def test_taps_leave_the_boundary_states_in_the_kernel(interpreted):
    got = interpreted["tap_commits"] if interpreted is not None else tap_commits("cuda")
    assert len(got) == 9 and all(got.values()), got


@needs_triton
def test_the_conv_commit_equals_its_reference(interpreted):
    got = interpreted["conv_commits"] if interpreted is not None else conv_commits("cuda")
    assert len(got) == 8 and all(got.values()), got


if __name__ == "__main__":  # the interpreter child of errors()
    errors_ = {}
    for name, dtype in launch_cases():
        errors_.update(triton_child.case_errors([name], [dtype], case_error, "cpu"))
    print(json.dumps({"errors": errors_,
                      "consistency": consistency("cpu"), "model_rounds": model_rounds("cpu"),
                      "block_vs_decode": block_vs_decode("cpu"),
                      "conv_commits": conv_commits("cpu"), "tap_commits": tap_commits("cpu")}))
