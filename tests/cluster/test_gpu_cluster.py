"""The engine on a real GPU: the KV pool sized from the measured memory profile, greedy
speculative output equal to target-only, and under Ray the aux features crossing from rank 0 to
the draft through the CUDA-IPC ring (the draft sees exactly the rows the in-process engine
feeds it: identical acceptance), and with several GPUs TP over NCCL and a draft on a GPU of its
own (skipped where there are too few)."""

from __future__ import annotations

import pytest
import torch

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams

pytestmark = pytest.mark.gpu


def workload(n: int):
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 320, (int(k),), generator=g).tolist()
               for k in torch.randint(3, 40, (n,), generator=g)]
    return prompts, [SamplingParams(max_tokens=40, ignore_eos=True)] * n


def config(tiny_demo, draft: bool, **kw) -> EngineConfig:
    target, draft_dir = map(str, tiny_demo)
    return EngineConfig(model=target, draft_model=draft_dir if draft else None,
                        block_size=8 if draft else None, device="cuda", max_num_seqs=8,
                        max_model_len=512, **kw)


def test_cuda_engine_sizes_its_pool_from_the_profile_and_is_lossless(tiny_demo):
    prompts, params = workload(6)
    spec = LLMEngine(config(tiny_demo, draft=True, gpu_memory_utilization=0.5))
    plan = spec.plan
    assert plan.num_pages is not None and plan.num_pages >= plan.min_pages
    free, total = torch.cuda.mem_get_info()
    assert total - free <= 0.5 * total * 1.05  # the pool filled the share, not beyond it
    want = LLMEngine(config(tiny_demo, draft=False, num_pages=512)).generate(prompts, params)
    got = spec.generate(prompts, params)
    assert [o.output_ids for o in got] == [o.output_ids for o in want]
    assert spec.stats.accepted_at[0] > 0


def test_cuda_adaptive_engine_captures_every_length_and_is_lossless(tiny_demo):
    """The adaptive rule's warm-up times rounds of each draft length at every graph bucket,
    capturing them; rounds switching lengths then replay those graphs (none fails to capture)
    with target-only's outputs."""
    import itertools

    prompts, params = workload(6)
    want = LLMEngine(config(tiny_demo, draft=False, num_pages=512)).generate(prompts, params)
    spec = LLMEngine(config(tiny_demo, draft=True, gpu_memory_utilization=0.5,
                            speculative_adaptive=True))
    spec.warm_up()
    rule = spec.draft_length
    assert sorted(rule.costs.seconds) == [0, 3, 7] and len(rule.costs.batch_sizes) > 1
    runner = spec.executor.runner
    widths = {w for (_, w, _) in runner.graphs.steps}
    assert widths >= {1, 4, 8} and not runner.graphs.failed
    assert [o.output_ids for o in spec.generate(prompts, params)] == [o.output_ids for o in want]
    cycle = itertools.cycle([0, 7, 3, None, 0])
    spec.draft_length = lambda seqs: next(cycle)
    assert [o.output_ids for o in spec.generate(prompts, params)] == [o.output_ids for o in want]
    assert not runner.graphs.failed and not spec.executor.drafter.failed


@pytest.mark.ray
def test_ray_cuda_engine_feeds_the_draft_through_cuda_ipc(ray_cluster, tiny_demo):
    from cluster.ray_executor import RayEngineCluster

    prompts, params = workload(6)
    cfg = config(tiny_demo, draft=True, num_pages=512, max_num_batched_tokens=16)
    want = LLMEngine(cfg).generate(prompts, params)
    cluster = RayEngineCluster(cfg, 1)  # rank 0 and the draft on half of the one GPU each
    try:
        got = cluster.engine.generate(prompts, params)
        assert [o.output_ids for o in got] == [o.output_ids for o in want]
        assert [o.acceptance_lengths for o in got] == [o.acceptance_lengths for o in want]
    finally:
        cluster.shutdown()


@pytest.mark.ray
@pytest.mark.parametrize(("tp", "placement"), [(2, "colocated"), (1, "separate"),
                                               (2, "separate"), (4, "colocated")])
def test_ray_cuda_engine_on_several_gpus_equals_target_only(ray_cluster, tiny_demo, tp,
                                                             placement):
    """TP over NCCL (and a draft on a GPU of its own, its aux features over the NCCL pair)
    gives the in-process target-only greedy tokens, fp32, on the tiny pair."""
    from cluster.ray_executor import RayEngineCluster

    need = tp + (placement == "separate")
    if torch.cuda.device_count() < need:
        pytest.skip(f"needs {need} GPUs")
    prompts, params = workload(6)
    want = LLMEngine(config(tiny_demo, draft=False, num_pages=512)).generate(prompts, params)
    cfg = config(tiny_demo, draft=True, num_pages=512, max_num_batched_tokens=16,
                 draft_placement=placement)
    cluster = RayEngineCluster(cfg, tp)
    try:
        got = cluster.engine.generate(prompts, params)
        assert [o.output_ids for o in got] == [o.output_ids for o in want]
        assert cluster.engine.stats.accepted_at[0] > 0
    finally:
        cluster.shutdown()
