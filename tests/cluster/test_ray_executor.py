"""The engine over Ray actors: tensor-parallel TargetWorkers (gloo on CPU) and a DraftWorker,
colocated with rank 0 or in a bundle of its own, give exactly the in-process engine's greedy
tokens."""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from cluster.engine import LLMEngine
from cluster.ray_executor import RayEngineCluster
from configs.engine import EngineConfig, GrammarSpec, SamplingParams

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"
pytestmark = pytest.mark.ray


def prompts_and_params(n: int):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 320, (int(k),), generator=g).tolist()
               for k in torch.randint(2, 30, (n,), generator=g)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True)
              for m in torch.randint(4, 30, (n,), generator=g)]
    # the sampling controls' state lives in every rank and the draft actor: a grammar, the
    # penalties, a bias and bad words, through every placement and TP size
    params[:3] = [
        replace(params[0], grammar=GrammarSpec("regex", "[a-z]{2,6}( [a-z]{2,6}){1,3}")),
        replace(params[1], repetition_penalty=1.3, frequency_penalty=0.4,
                logit_bias=((7, 3.0),)),
        replace(params[2], bad_words_token_ids=((264,), (90, 17)), min_tokens=3),
    ]
    return prompts, params


def config(draft: bool, placement: str = "colocated", channel: str = "auto") -> EngineConfig:
    return EngineConfig(model=str(DEMO / "target"), draft_model=str(DEMO / "draft") if draft
                        else None, block_size=8 if draft else None, max_num_seqs=8,
                        page_size=4, draft_placement=placement, control_channel=channel)


@pytest.fixture(scope="module")
def reference():
    prompts, params = prompts_and_params(8)
    outs = LLMEngine(config(draft=False)).generate(prompts, params)
    return prompts, params, [o.output_ids for o in outs]


def assert_equals_target_only(cluster: RayEngineCluster, reference, tp: int, draft: bool,
                              use_gpu: bool = False, placement: str = "colocated",
                              channel: str = "auto") -> list:
    """The cluster's greedy tokens are the in-process target-only engine's; its control
    channel, bundles and the draft's GPU share are what the placement asks. Returns the
    outputs."""
    import ray

    prompts, params, want = reference
    assert cluster.channel_kind == ("shm" if channel == "auto" else channel)
    outs = cluster.engine.generate(prompts, params)
    assert [o.output_ids for o in outs] == want
    # again, from the prefix cache: the snapshots restored on every rank
    again = cluster.engine.generate(prompts, params)
    assert [o.output_ids for o in again] == want
    assert sum(o.num_cached_tokens > 0 for o in again) >= len(prompts) // 2
    if draft:
        assert cluster.engine.stats.accepted_at[0] > 0
    bundles = cluster.pg.bundle_specs
    assert len(bundles) == tp + (placement == "separate" and draft)
    if draft and use_gpu:  # the draft's GPU share: half of rank 0's, or one of its own
        draft_gpu = ray.get(cluster.draft.__ray_call__.remote(lambda self: ray.get_gpu_ids()))
        shared = ray.get(cluster.workers[0].__ray_call__.remote(
            lambda self: ray.get_gpu_ids()))
        assert (draft_gpu == shared) == (placement == "colocated")
    return outs


# use_gpu: the GPU placement ({GPU: 1, CPU: 1} bundles, draft and rank 0 on half a GPU each,
# or the draft on a whole one in an extra bundle) exercised with the session cluster's fake
# GPUs; the computation stays on CPU. "separate": aux features over the gloo pair. "tcp": the
# control channel as it runs when the actors are not on one node. Each cluster start costs
# 10–40 s on a 2-core box, so three more cases run in the tests below, on their clusters:
# TP 1 with the draft colocated or separate, on CPU bundles (the aux ring's test), and TP 2
# with the draft colocated on GPU bundles (the start-up's).
@pytest.mark.parametrize(("tp", "draft", "use_gpu", "placement", "channel"),
                         [(1, False, False, "colocated", "auto"),
                          (2, False, False, "colocated", "auto"),
                          (4, True, False, "colocated", "auto"),
                          (1, True, True, "separate", "auto"),
                          (2, True, True, "separate", "auto"),
                          (2, True, False, "colocated", "tcp")])
def test_ray_engine_equals_in_process_target_only(ray_cluster, reference, tp, draft, use_gpu,
                                                  placement, channel):
    cluster = RayEngineCluster(config(draft, placement, channel), tp, use_gpu=use_gpu)
    try:
        assert_equals_target_only(cluster, reference, tp, draft, use_gpu, placement, channel)
    finally:
        cluster.shutdown()


def test_start_up_warms_up_and_restart_keeps_the_plan(ray_cluster, reference, caplog):
    """The cluster's engine has run its warm-up (a prompt in two chunks, then rounds) when the
    constructor returns, saying each stage once, in order, from this (the driver's) process;
    it equals target-only (TP 2, the draft colocated on GPU bundles); with acceptance replay
    (every draft accepted) the draft actor replays the recorded outputs; a restart starts new
    actors, warms them up again and stays exact."""
    prompts, params, want = reference
    caplog.set_level(logging.INFO, logger="cluster")
    cluster = RayEngineCluster(replace(config(draft=True), acceptance_replay="8"), 2,
                               use_gpu=True)
    try:
        stages = ["Ray at ", "placement group ready: ", "dtype float32 on cpu",
                  "starting 2 target workers and the draft actor", "target rank 0 is up at ",
                  "target rank 0 on ", "target rank 1 on ", "draft on ", "memory plan: ",
                  "kernels: ", "warm-up done in "]
        lines = [r.getMessage() for r in caplog.records]
        found = [[i for i, m in enumerate(lines) if m.startswith(s)] for s in stages]
        assert all(len(f) == 1 for f in found), list(zip(stages, found, strict=True))
        assert [f[0] for f in found] == sorted(f[0] for f in found)
        at = dict(zip(stages, (f[0] for f in found), strict=True))
        assert "(cpu): weights " in lines[at["target rank 0 on "]]
        assert "recurrence torch (fla runs on CUDA only)" in lines[at["kernels: "]]
        assert "no CUDA graphs on cpu" in lines[at["warm-up done in "]]
        warm = cluster.engine.warmup
        assert warm["requests"] >= 1 and warm["steps"] >= 3
        assert cluster.engine.stats.rounds == 0  # the warm-up's rounds are not counted
        assert_equals_target_only(cluster, reference, 2, True, use_gpu=True)
        replayed = cluster.engine.generate(prompts, params)  # recorded by the passes above
        assert [o.output_ids for o in replayed] == want
        for o in replayed:  # B = 8 tokens a round, but where max_tokens cuts the last one
            assert o.acceptance_lengths[:-1] == [8] * (len(o.acceptance_lengths) - 1)
        # a round's draft length switched every round, none at all in some (the draft actor
        # proposes nothing then, the target decodes, the context write goes on)
        cycle = itertools.cycle([0, 3, None, 1, 0])
        cluster.engine.draft_length = lambda seqs: next(cycle)
        assert [o.output_ids for o in cluster.engine.generate(prompts, params)] == want
        cluster.engine.draft_length = None
        old_workers = cluster.actors()["workers"]
        engine = cluster.restart()
        assert cluster.restarts == 1 and engine.warmup["steps"] >= 3
        assert cluster.actors()["workers"] != old_workers
        # the new workers' caches are new: the prefix cache starts empty (but for warm-up)
        assert engine.prefix is not None and engine.prefix.stats.queries == 0
        outs = engine.generate(prompts, params)
        assert [o.output_ids for o in outs] == want
        assert not any(o.num_cached_tokens for o in outs)
    finally:
        cluster.shutdown()


@pytest.mark.parametrize("placement", ["colocated", "separate"])
def test_aux_ring_feeds_the_draft_exactly_what_the_in_process_engine_feeds(ray_cluster,
                                                                           reference, placement):
    """The draft's inputs travel through the shared-memory ring (colocated) or the gloo pair
    (separate) under Ray. Wrong rows would not change greedy outputs (verification fixes them)
    but would change acceptance, so compare acceptance lengths with the in-process engine. A
    prefill budget of 7 tokens makes several prefill steps in a row: more context writes
    outstanding than the ring has slots, unless the driver's flow control holds them back.
    TP 1 on CPU bundles: the outputs are also target-only's (as in the test above)."""
    prompts, params, _ = reference
    cfg = replace(config(draft=True, placement=placement), max_num_batched_tokens=7)
    want = LLMEngine(cfg).generate(prompts, params)
    cluster = RayEngineCluster(cfg, 1)
    try:
        got = assert_equals_target_only(cluster, reference, 1, True, placement=placement)
        assert [o.output_ids for o in got] == [o.output_ids for o in want]
        assert [o.acceptance_lengths for o in got] == [o.acceptance_lengths for o in want]
        assert sum(map(sum, (o.acceptance_lengths for o in want))) > len(want) * 3
    finally:
        cluster.shutdown()


def test_wait_all_raises_a_failure_at_once_and_a_hang_after_the_timeout(ray_cluster):
    """What keeps a dead or hung rank from hanging the engine: the first error comes back
    while a healthy rank is still blocked (as in a collective with the dead one), and silence
    ends at the step timeout."""
    import time

    import ray

    from cluster.ray_executor import ActorStepTimeout, wait_all

    @ray.remote
    def blocked(seconds: float) -> int:
        time.sleep(seconds)
        return 1

    @ray.remote
    def dies() -> int:
        raise RuntimeError("rank 1 is gone")

    slow = blocked.remote(120)
    with pytest.raises(RuntimeError, match="rank 1 is gone"):
        wait_all([slow, dies.remote()], timeout_s=100, what="verify")
    assert ray.wait([slow], timeout=0)[0] == []  # raised while the blocked rank still runs
    with pytest.raises(ActorStepTimeout, match="verify: no reply within 1 s"):
        wait_all([slow], timeout_s=1, what="verify")
    ray.cancel(slow, force=True)
    assert wait_all([blocked.remote(0), blocked.remote(0)], 30, "ok") == [1, 1]


def test_the_rendezvous_listens_on_the_address_it_advertises_only(tiny_demo):
    """Rank 0's TCP store socket is bound to the node IP the other ranks are told, not to
    every interface."""
    from workers.worker import TargetWorker

    worker = TargetWorker(EngineConfig(model=str(tiny_demo[0])), (), rank=0, tp=2)
    host, port = worker.address()
    try:
        assert worker._store_socket.getsockname()[:2] == (host, port)
        assert host not in ("0.0.0.0", "::", "")
    finally:
        worker._store_socket.close()
