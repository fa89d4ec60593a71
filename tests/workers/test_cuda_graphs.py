"""The CUDA-graph runners' own logic — bucket padding with dummy sequences in scratch pages and
a scratch state slot, static buffers filled by prefix copy, the commit over the captured
journal — equals the eager path. Off CUDA the "graphs" run their function on the static
buffers instead of replaying, so all of it is checked on CPU; the `gpu` cases capture and
replay for real (fp32: the same tokens as the eager reference path)."""

from __future__ import annotations

import pytest
import torch

from configs.engine import SamplingParams
from draft.model import DFlashDraftModel
from draft.proposer import DraftRunner
from target.loader import load_target
from workers.cache import allocate_target_caches
from workers.cuda_graphs import (
    MAX_GRAPH_WIDTH,
    CapturedCall,
    RoundGraphs,
    bucket_for,
    num_scratch_pages,
)
from workers.messages import ContextWrite, ProposeRequest
from workers.model_runner import ModelRunner, SeqInput, committed_rows

PAGE_SIZE, NUM_PAGES, MAX_SEQS = 4, 96, 5
PROMPTS = [[5, 9, 2, 77, 31, 8], [100, 3, 3, 41, 9, 12, 60, 7, 2, 19, 4], [250, 11]]
AUX = (0, 1)


def test_committed_rows_are_each_blocks_kept_head_in_order():
    width, kept = 4, torch.tensor([2, 4, 1])
    aux = torch.arange(16 * 3).view(16, 3)  # 12 real rows, then a padding block
    positions = torch.arange(100, 116)
    got_aux, got_pos = committed_rows(kept, width, aux, positions)
    rows = [0, 1, 4, 5, 6, 7, 8]
    assert torch.equal(got_aux[:7], aux[rows]) and torch.equal(got_pos[:7], positions[rows])
    assert sorted(got_pos[7:].tolist()) == [102, 103, 109, 110, 111]  # the rest follow
    aux_1, pos_1 = committed_rows(torch.ones(3, dtype=torch.long), 1, aux, positions)
    assert torch.equal(aux_1, aux[:3]) and torch.equal(pos_1, positions[:3])
    aux_1[0, 0] = -1  # a copy: the graph's outputs are overwritten by the next replay
    assert aux[0, 0] == 0


@pytest.mark.gpu
def test_a_staged_call_copies_every_input_in_one_transfer_and_replays():
    inputs = {"ids": torch.zeros(6, dtype=torch.long, device="cuda"),
              "tables": torch.zeros(2, 5, dtype=torch.int32, device="cuda"),
              "lens": torch.zeros(2, dtype=torch.long, device="cuda")}

    def fn(x):
        return x["ids"].sum() + x["tables"].long().sum(1) * x["lens"]

    call = CapturedCall(fn, inputs, torch.cuda.graph_pool_handle(), staged=True)
    for k in range(3):
        ids, lens = torch.arange(6) + k, torch.tensor([k, 2 * k])
        tables = torch.arange(10, dtype=torch.int32).view(2, 5) * (k + 1)
        want = fn({"ids": ids, "tables": tables, "lens": lens})
        assert torch.equal(call(ids=ids, tables=tables, lens=lens).cpu(), want)
    with pytest.raises(ValueError, match="every input whole"):
        call(ids=ids, tables=tables)
    with pytest.raises(ValueError, match="every input whole"):
        call(ids=ids, tables=tables[:, :3], lens=lens)


def test_buckets():
    assert [bucket_for(n, 5) for n in (1, 2, 3, 5, 8, 9)] == [1, 2, 4, 8, 8, None]
    assert bucket_for(64, 64) == 64 and bucket_for(65, 64) is None
    assert bucket_for(200, 256) == 256


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def runner(model_dir, graphs: bool, device: str = "cpu",
           max_graphs: int = 16) -> tuple[ModelRunner, object]:
    model = load_target(model_dir, dtype=torch.float32, device=device)
    scratch = num_scratch_pages(MAX_GRAPH_WIDTH, PAGE_SIZE) if graphs else 0
    caches = allocate_target_caches(model, NUM_PAGES + scratch, PAGE_SIZE, MAX_SEQS + 1, device)
    rounds = RoundGraphs(model, caches, AUX, torch.device(device), MAX_SEQS, 24,
                         list(range(NUM_PAGES, NUM_PAGES + scratch)), MAX_SEQS,
                         max_graphs=max_graphs) if graphs else None
    return ModelRunner(model, caches, AUX, device, graphs=rounds), caches


def tables() -> list[list[int]]:
    # interleaved pages, so a paging bug cannot hide
    return [[(3 * i + 5 * s) % NUM_PAGES for i in range(20)] for s in range(len(PROMPTS))]


class Seqs:
    def __init__(self, r: ModelRunner):
        self.r, self.tables = r, tables()
        out = r.prefill([SeqInput(s, p, 0, self.tables[s], s, SamplingParams())
                         for s, p in enumerate(PROMPTS)])
        self.cached = [len(p) for p in PROMPTS]
        self.anchor = [t[0] for t in out.new_tokens]

    def round(self, drafts: list[list[int]]):
        out = self.r.verify([SeqInput(s, [self.anchor[s], *drafts[s]], self.cached[s],
                                      self.tables[s], s, SamplingParams())
                             for s in range(len(PROMPTS))])
        for s, toks in enumerate(out.new_tokens):
            self.cached[s] += len(toks)
            self.anchor[s] = toks[-1]
        return out


@pytest.mark.parametrize("device", DEVICES)
def test_round_graphs_equal_the_eager_rounds(tiny_demo, device):
    target_dir = tiny_demo[0]  # (committed: the GPU host cannot build the fixture models)
    eager_runner, eager_caches = runner(target_dir, False, device)
    graph_runner, graph_caches = runner(target_dir, True, device)
    tol = {"atol": 1e-5, "rtol": 1e-5} if device == "cpu" else {"atol": 1e-3, "rtol": 1e-3}
    eager, graph = Seqs(eager_runner), Seqs(graph_runner)
    assert eager.anchor == graph.anchor
    # Target-only decode (W = 1 rounds, 3 sequences in the bucket of 4): the continuation.
    continuation = [[a] for a in eager.anchor]
    for _ in range(10):
        a, b = eager.round([[]] * 3), graph.round([[]] * 3)
        assert a.new_tokens == b.new_tokens
        torch.testing.assert_close(b.aux, a.aux, **tol)
        assert torch.equal(b.aux_positions.cpu(), a.aux_positions.cpu())
        for s, toks in enumerate(a.new_tokens):
            continuation[s] += toks
    # Rounds of W = 4 whose drafts are the continuation with sequence s's draft s corrupted:
    # 3, 1 and 0 accepted; then rounds that must commit exactly that prefix.
    eager, graph = Seqs(eager_runner), Seqs(graph_runner)  # prefilled again: slots reset
    produced = [[] for _ in PROMPTS]
    for _ in range(2):
        drafts = []
        for s in range(3):
            at = len(produced[s]) + 1
            d = list(continuation[s][at : at + 3])
            if s < 2:
                d[2 - s * 2] = (d[2 - s * 2] + 1) % 300
            drafts.append(d)
        a, b = eager.round(drafts), graph.round(drafts)
        assert (a.new_tokens, a.num_accepted) == (b.new_tokens, b.num_accepted)
        torch.testing.assert_close(b.aux, a.aux, **tol)
        assert torch.equal(b.aux_positions.cpu(), a.aux_positions.cpu())
        for s, toks in enumerate(a.new_tokens):
            produced[s] += toks
    assert a.num_accepted == [2, 0, 3]
    for s in range(3):  # the greedy invariant through graphs
        assert produced[s] == continuation[s][1 : 1 + len(produced[s])]
    for layer in eager_caches.ssm:  # committed states of the real slots agree
        torch.testing.assert_close(graph_caches.ssm[layer][:3], eager_caches.ssm[layer][:3],
                                   **tol)
        torch.testing.assert_close(graph_caches.conv[layer][:3], eager_caches.conv[layer][:3])
    assert {key[:2] for key in graph_runner.graphs.steps} == {(4, 1), (4, 4)}  # S=3: bucket 4
    if device == "cuda":  # replayed, not run eagerly
        assert all(step.forward.graph is not None for step in graph_runner.graphs.steps.values())


@pytest.mark.parametrize("device", DEVICES)
def test_evicted_round_shapes_are_recaptured_and_stay_exact(tiny_demo, device):
    """One shape kept at a time: alternating W = 1 and W = 3 rounds evict and recapture every
    time, and still equal the eager rounds."""
    eager, graph = Seqs(runner(tiny_demo[0], False, device)[0]), \
        Seqs(runner(tiny_demo[0], True, device, max_graphs=1)[0])
    g = torch.Generator().manual_seed(3)
    for i in range(6):
        drafts = [[]] * 3 if i % 2 else torch.randint(0, 300, (3, 2), generator=g).tolist()
        a, b = eager.round(drafts), graph.round(drafts)
        assert (a.new_tokens, a.num_accepted) == (b.new_tokens, b.num_accepted)
    rounds = graph.r.graphs
    assert len(rounds.steps) == 1 and rounds.evictions == 5


@pytest.mark.parametrize("device", DEVICES)
def test_draft_graph_proposals_equal_the_eager_ones(tiny_demo, request, device):
    target = load_target(tiny_demo[0], dtype=torch.float32, device=device)
    block = 4
    # On CPU the sliding-window revision (the windowed gather); the GPU host cannot build it.
    draft_dir = tiny_demo[1] if device == "cuda" else \
        request.getfixturevalue("tiny_models") / "draft-swa"

    def drafter(graphs: bool) -> DraftRunner:
        model = DFlashDraftModel.from_pretrained(draft_dir, dtype=torch.float32,
                                                 device=device, block_size=block)
        return DraftRunner(model, NUM_PAGES, PAGE_SIZE, block, target.embed, target.compute_logits,
                           device, graph_max_seqs=MAX_SEQS if graphs else 0, graph_max_pages=24)

    g = torch.Generator().manual_seed(0)
    lens = [len(p) for p in PROMPTS]
    width = drafter(False).model.cfg.aux_hidden_size
    aux = torch.randn(sum(lens), width, generator=g).to(device)
    positions = torch.cat([torch.arange(n) for n in lens]).to(device)
    eager, graph = drafter(False), drafter(True)
    for d in (eager, graph):
        d.write_context(ContextWrite(aux, positions, tables(), lens))
    for anchors, n in (([4, 50, 9], 3), ([7], 1), ([1, 2], 2)):  # buckets 4, 1, 2
        want = eager.propose(ProposeRequest(anchors, lens[:n], tables()[:n]))
        got = graph.propose(ProposeRequest(anchors, lens[:n], tables()[:n]))
        assert got.shape == (n, block - 1) and torch.equal(got.cpu(), want.cpu())
    assert {key[:2] for key in graph.graphs} == {(4, block), (1, block), (2, block)}


@pytest.mark.parametrize("device", DEVICES)
def test_draft_context_writes_through_graphs_equal_the_eager_ones(tiny_demo, device):
    """Writes of up to bucket · B rows (rounds' committed tokens, short prefill chunks) run
    padded through one graph per row bucket; their padding rows go to scratch slots only, so
    the real pages hold what the eager writes leave, and longer writes stay eager."""
    block = 4

    def drafter(graphs: bool) -> DraftRunner:
        model = DFlashDraftModel.from_pretrained(tiny_demo[1], dtype=torch.float32,
                                                 device=device, block_size=block)
        return DraftRunner(model, NUM_PAGES, PAGE_SIZE, block, None, None, device,
                           graph_max_seqs=MAX_SEQS if graphs else 0, graph_max_pages=24)

    eager, graph = drafter(False), drafter(True)
    assert graph.write_rows == [4, 8, 16, 32]
    width = eager.model.cfg.aux_hidden_size
    g = torch.Generator().manual_seed(1)
    start = [0, 0, 0]
    # (counts per sequence): a 40-row prefill (eager), then round-sized commits
    for counts in ([14, 20, 6], [1, 4, 2], [4, 4, 4], [3], [2, 1]):
        n = len(counts)
        aux = torch.randn(sum(counts), width, generator=g).to(device)
        positions = torch.cat([torch.arange(start[s], start[s] + c)
                               for s, c in enumerate(counts)])
        for d in (eager, graph):
            d.write_context(ContextWrite(aux, positions, tables()[:n], counts))
        for s, c in enumerate(counts):
            start[s] += c
    assert sorted(graph.write_graphs) == [4, 8, 16] and not graph.failed
    # (to rounding: a GEMM over the padded rows may sum in another order)
    for (ek, ev), (gk, gv) in zip(eager.kv_cache, graph.kv_cache, strict=True):
        torch.testing.assert_close(gk[:NUM_PAGES], ek, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(gv[:NUM_PAGES], ev, rtol=1e-5, atol=1e-6)
