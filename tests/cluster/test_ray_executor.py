"""The engine over Ray actors: tensor-parallel TargetWorkers (gloo on CPU) and a colocated
DraftWorker give exactly the in-process engine's greedy tokens."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cluster.engine import LLMEngine
from cluster.ray_executor import RayEngineCluster
from configs.engine import EngineConfig, SamplingParams

DEMO = Path(__file__).resolve().parents[1] / "assets" / "tiny"
pytestmark = pytest.mark.ray


def prompts_and_params(n: int):
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 320, (int(k),), generator=g).tolist()
               for k in torch.randint(2, 30, (n,), generator=g)]
    params = [SamplingParams(max_tokens=int(m), ignore_eos=True)
              for m in torch.randint(4, 30, (n,), generator=g)]
    return prompts, params


def config(draft: bool) -> EngineConfig:
    return EngineConfig(model=str(DEMO / "target"), draft_model=str(DEMO / "draft") if draft
                        else None, block_size=8 if draft else None, max_num_seqs=8,
                        kv_block_size=4)


@pytest.fixture(scope="module")
def reference():
    prompts, params = prompts_and_params(8)
    outs = LLMEngine(config(draft=False)).generate(prompts, params)
    return prompts, params, [o.output_ids for o in outs]


# use_gpu: the GPU placement ({GPU: 1, CPU: 1} bundles, draft and rank 0 on half a GPU each)
# exercised with the session cluster's fake GPUs; the computation stays on CPU.
@pytest.mark.parametrize(("tp", "draft", "use_gpu"),
                         [(1, True, False), (2, True, True), (2, False, False), (4, True, False)])
def test_ray_engine_equals_in_process_target_only(ray_cluster, reference, tp, draft, use_gpu):
    prompts, params, want = reference
    cluster = RayEngineCluster(config(draft), tp, use_gpu=use_gpu)
    try:
        got = [o.output_ids for o in cluster.engine.generate(prompts, params)]
        assert got == want
        if draft:
            assert cluster.engine.stats.accepted_at[0] > 0
    finally:
        cluster.shutdown()
