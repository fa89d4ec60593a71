"""The engine's runner and drafter as Ray actors: one placement group per engine (bundles
{GPU: 1, CPU: 1} × tp, STRICT_PACK; {CPU: 1} × tp when the engine runs on CPU), one
TargetWorker per bundle, the DraftWorker sharing bundle 0 with rank 0 (half a GPU each), or with
`draft_placement: separate` in a bundle (a GPU) of its own, the last. Same methods as
ModelRunner / DraftRunner, so LLMEngine drives either.

Per round this costs one call per rank for verify and one call to the draft (propose); the
draft's context write rides the same actor's queue without a wait. Aux features go from
rank 0 to the draft through a ring both map (workers/aux_transport.py: CUDA IPC on a shared
GPU, shared memory on CPU) or, for a separate draft, an NCCL (gloo on CPU) send/recv pair;
only a small `AuxRef` rides the calls through the driver.

Failure handling: every wait on an actor is a `ray.wait` loop, so a dead rank surfaces as
soon as its reply is an error (the other ranks may be stuck in a collective with it) and a
hung one after `step_timeout_s`. The caller then `restart()`s: every actor of the engine is
killed and started afresh in the same placement group."""

from __future__ import annotations

import time
from collections import deque

import ray
import torch
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.engine import EnginePlan, LLMEngine
from configs.engine import EngineConfig
from draft.actor import DraftWorker
from workers.model_runner import SeqInput, StepOutput
from workers.worker import AUX_RING_SLOTS, TargetWorker

# Generous: a first step on a GPU may compile Triton kernels for minutes.
DEFAULT_STEP_TIMEOUT_S = 900.0


class ActorStepTimeout(TimeoutError):
    pass


def wait_all(refs: list, timeout_s: float, what: str) -> list:
    """ray.get(refs), but raises the first failure as soon as it arrives (ray.get of a list
    may sit on a healthy rank blocked in a collective with the dead one)."""
    pending, deadline = list(refs), time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1,
                                  timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            raise ActorStepTimeout(f"{what}: no reply within {timeout_s:.0f} s")
        ray.get(ready)
    return ray.get(refs)


def engine_bundles(tp: int, use_gpu: bool, separate_draft: bool = False
                   ) -> list[dict[str, float]]:
    """One bundle per TP rank, and one more for a draft on its own GPU (the last)."""
    return [{"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}] * (tp + int(separate_draft))


def separate_draft(cfg: EngineConfig) -> bool:
    """The engine runs a draft, on a GPU (a bundle) of its own."""
    return cfg.draft_model is not None and cfg.draft_placement == "separate"


class RayTargetGroup:
    def __init__(self, workers: list, step_timeout_s: float):
        self.workers = workers
        self.step_timeout_s = step_timeout_s

    def _all(self, method: str, *args) -> list:
        refs = [getattr(w, method).remote(*args) for w in self.workers]
        return wait_all(refs, self.step_timeout_s, f"target {method}")

    def prefill(self, seqs: list[SeqInput]) -> StepOutput:
        return self._all("prefill", seqs)[0]

    def verify(self, seqs: list[SeqInput]) -> StepOutput:
        return self._all("verify", seqs)[0]

    def release(self, seq_id: int) -> None:
        for w in self.workers:
            w.release.remote(seq_id)


class RayDrafter:
    """Context writes are not awaited: they queue on the draft actor ahead of the next
    propose. Two things still need their refs: their errors (raised after that propose), and
    the aux ring's flow control (rank 0's next put may not overwrite a slot the draft has not
    read: at most AUX_RING_SLOTS − 1 writes may be outstanding when a step starts)."""

    def __init__(self, actor, step_timeout_s: float):
        self.actor = actor
        self.step_timeout_s = step_timeout_s
        self.pending: deque = deque()  # write_context refs not yet known to be done

    def propose(self, anchors, context_lens, block_tables) -> torch.Tensor:
        ref = self.actor.propose.remote(anchors, context_lens, block_tables)
        drafts = wait_all([ref], self.step_timeout_s, "draft propose")[0]
        done, self.pending = list(self.pending), deque()
        ray.get(done)  # ran before the propose (actor order): raises a failed write
        return drafts

    def write_context(self, aux, positions, block_tables, counts) -> None:
        self.pending.append(self.actor.write_context.remote(aux, positions, block_tables, counts))
        while len(self.pending) > AUX_RING_SLOTS - 1:  # e.g. consecutive prefill steps
            wait_all([self.pending.popleft()], self.step_timeout_s, "draft context write")


class RayEngineCluster:
    """Places and starts the actors of one engine; `engine` is an LLMEngine over them.

    `pg`: a placement group with `engine_bundles(tp, use_gpu)` to use (e.g. a Serve replica's
    own); None creates one, removed again by `shutdown()`. `use_gpu` defaults to whether the
    engine runs on CUDA; tests set it with fake GPU resources to exercise the GPU placement."""

    def __init__(self, cfg: EngineConfig, tp: int, pg: PlacementGroup | None = None,
                 use_gpu: bool | None = None, step_timeout_s: float = DEFAULT_STEP_TIMEOUT_S):
        self.cfg, self.tp, self.step_timeout_s = cfg, tp, step_timeout_s
        self.plan = EnginePlan.from_config(cfg)
        self.plan.target_config.check_tp(tp)
        self.use_gpu = cfg.device.startswith("cuda") if use_gpu is None else use_gpu
        self.owns_pg = pg is None
        self.separate_draft = separate_draft(cfg)
        self.pg = pg or placement_group(engine_bundles(tp, self.use_gpu, self.separate_draft),
                                        strategy="STRICT_PACK")
        ray.get(self.pg.ready())
        self.workers: list = []
        self.draft = None
        self.restarts = 0
        runner, drafter = self._start_actors()  # sets plan.num_kv_blocks where measured
        self.engine = LLMEngine(cfg, runner, drafter, self.plan)

    def _in_bundle(self, i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                placement_group_bundle_index=i)

    def _start_actors(self) -> tuple[RayTargetGroup, RayDrafter | None]:
        """Load → profile (first start only: the page count is kept for restarts) → allocate."""
        cfg, plan, timeout = self.cfg, self.plan, self.step_timeout_s
        has_draft = plan.draft_config is not None
        shared = has_draft and not self.separate_draft  # rank 0 and the draft split a GPU

        def gpus(share: float) -> float:
            return share if self.use_gpu else 0

        # A ring slot holds the largest step: a prefill budget, or every sequence's block.
        aux_ring_rows = max(cfg.max_num_batched_tokens, cfg.max_num_seqs * plan.block_size)
        aux_ring_rows = aux_ring_rows if has_draft else 0
        worker_cls = ray.remote(TargetWorker)
        self.workers = [
            worker_cls.options(num_cpus=1, num_gpus=gpus(0.5 if (i == 0 and shared) else 1),
                               scheduling_strategy=self._in_bundle(i), max_restarts=0)
            .remote(cfg, plan.aux_layer_ids, i, self.tp, aux_ring_rows)
            for i in range(self.tp)
        ]
        addr, port = wait_all([self.workers[0].address.remote()], timeout, "rank 0 address")[0]
        loads = [w.init_model.remote(addr, port) for w in self.workers]
        if has_draft:  # alongside the target (colocated: its weights count in rank 0's profile)
            self.draft = ray.remote(DraftWorker).options(
                num_cpus=0 if shared else 1, num_gpus=gpus(0.5 if shared else 1),
                scheduling_strategy=self._in_bundle(0 if shared else self.tp), max_restarts=0,
            ).remote(cfg, plan.block_size)
            loads.append(self.draft.ping.remote())
        wait_all(loads, timeout, "model load")
        if has_draft:
            spec = wait_all([self.workers[0].aux_spec.remote()], timeout, "aux ring")[0]
            # Together: a pair transport's two ends rendezvous (the others return at once).
            wait_all([self.workers[0].connect_aux.remote(), self.draft.open_aux.remote(spec)],
                     timeout, "aux transport")
        if plan.num_kv_blocks is None:
            refs = [w.profile.remote(plan.block_size) for w in self.workers]
            profiles = wait_all(refs, timeout, "memory profile")
            if has_draft:  # after the target's: colocated, both measure the same GPU
                profiles += wait_all([self.draft.profile.remote()], timeout, "draft profile")
            self.plan = plan = plan.with_measured_blocks(profiles, cfg.max_num_seqs)
        actors = [*self.workers, *([self.draft] if has_draft else [])]
        wait_all([a.allocate.remote(plan.num_kv_blocks) for a in actors], timeout, "allocate")
        drafter = RayDrafter(self.draft, timeout) if has_draft else None
        return RayTargetGroup(self.workers, timeout), drafter

    def actors(self) -> dict[str, list]:
        """Handles of the live actors (for operators and fault-injection tests)."""
        return {"workers": list(self.workers), "draft": [self.draft] if self.draft else []}

    def ping(self, timeout_s: float = 10.0) -> None:
        """Raises if any actor is dead or does not answer within `timeout_s`."""
        actors = [*self.workers, *([self.draft] if self.draft else [])]
        wait_all([a.ping.remote() for a in actors], timeout_s, "ping")

    def restart(self) -> LLMEngine:
        """Kills every actor (a rank that survived may hold half-committed state, or sit in a
        collective with a dead peer) and starts them afresh; the new engine keeps the
        cumulative statistics. Requests in flight are the caller's to fail."""
        self._kill_actors()
        old = self.engine
        runner, drafter = self._start_actors()
        self.engine = LLMEngine(self.cfg, runner, drafter, self.plan)
        self.engine.stats, self.engine.draft_time = old.stats, old.draft_time
        self.engine.verify_time = old.verify_time
        self.restarts += 1
        return self.engine

    def _kill_actors(self) -> None:
        for actor in [*self.workers, self.draft]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.workers, self.draft = [], None

    def shutdown(self) -> None:
        self._kill_actors()
        if self.owns_pg:
            remove_placement_group(self.pg)
