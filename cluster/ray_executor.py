"""The engine's runner and drafter as Ray actors: one placement group per engine (bundles
{GPU: 1, CPU: 1} × tp, STRICT_PACK), one TargetWorker per bundle, the DraftWorker sharing
bundle 0 with rank 0 (half a GPU each). Same methods as ModelRunner / DraftRunner, so
LLMEngine drives either.

Per round this costs one call per rank for verify and one call to the draft (propose); the
draft's context write rides the same actor's queue without a wait. Aux features travel
rank 0 → driver → draft through the object store: the CPU fallback; the shared-GPU transport
replaces it."""

from __future__ import annotations

import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.engine import EnginePlan, LLMEngine
from configs.engine import EngineConfig
from draft.actor import DraftWorker
from workers.model_runner import SeqInput, StepOutput
from workers.worker import TargetWorker


class RayTargetGroup:
    def __init__(self, workers: list):
        self.workers = workers

    def _all(self, method: str, *args) -> list:
        return ray.get([getattr(w, method).remote(*args) for w in self.workers])

    def prefill(self, seqs: list[SeqInput]) -> StepOutput:
        return self._all("prefill", seqs)[0]

    def verify(self, seqs: list[SeqInput]) -> StepOutput:
        return self._all("verify", seqs)[0]

    def release(self, seq_id: int) -> None:
        for w in self.workers:
            w.release.remote(seq_id)


class RayDrafter:
    def __init__(self, actor):
        self.actor = actor

    def propose(self, anchors, context_lens, block_tables) -> torch.Tensor:
        return ray.get(self.actor.propose.remote(anchors, context_lens, block_tables))

    def write_context(self, aux, positions, block_tables, counts) -> None:
        # Not awaited: the next propose on this actor runs after it, and raises its errors.
        self.actor.write_context.remote(aux, positions, block_tables, counts)


class RayEngineCluster:
    """Places and starts the actors of one engine; `engine` is an LLMEngine over them."""

    def __init__(self, cfg: EngineConfig, tp: int):
        self.plan = EnginePlan.from_config(cfg)
        self.plan.target_config.check_tp(tp)
        self.pg = placement_group([{"GPU": 1, "CPU": 1}] * tp, strategy="STRICT_PACK")
        ray.get(self.pg.ready())
        has_draft = self.plan.draft_config is not None

        def in_bundle(i: int) -> PlacementGroupSchedulingStrategy:
            return PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                    placement_group_bundle_index=i)

        worker_cls = ray.remote(TargetWorker)
        self.workers = [
            worker_cls.options(num_cpus=1, num_gpus=0.5 if (i == 0 and has_draft) else 1,
                               scheduling_strategy=in_bundle(i))
            .remote(cfg, self.plan.num_kv_blocks, self.plan.aux_layer_ids, i, tp)
            for i in range(tp)
        ]
        addr, port = ray.get(self.workers[0].address.remote())
        ray.get([w.init_model.remote(addr, port) for w in self.workers])
        self.draft = None
        drafter = None
        if has_draft:
            self.draft = ray.remote(DraftWorker).options(
                num_cpus=0, num_gpus=0.5, scheduling_strategy=in_bundle(0)
            ).remote(cfg, self.plan.num_kv_blocks, self.plan.block_size)
            ray.get(self.draft.ping.remote())
            drafter = RayDrafter(self.draft)
        self.engine = LLMEngine(cfg, RayTargetGroup(self.workers), drafter, self.plan)

    def shutdown(self) -> None:
        for actor in [*self.workers, self.draft]:
            if actor is not None:
                ray.kill(actor)
        remove_placement_group(self.pg)
