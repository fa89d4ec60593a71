"""The engine's target and draft as Ray actors: one placement group per engine (bundles
{GPU: 1, CPU: 1} × tp, STRICT_PACK; {CPU: 1} × tp when the engine runs on CPU), one
TargetWorker per bundle, the DraftWorker sharing bundle 0 with rank 0 (half a GPU each), or with
`draft_placement: separate` in a bundle (a GPU) of its own, the last.

Ray carries placement, start-up (cluster/startup.py: load → aux transport → profile →
allocate), the loops' lifetimes and failures. Steps do not ride Ray calls: each actor runs a
step loop (workers/step_loop.py) fed by the control channel (workers/channel.py), and the
engine drives them through a `ChannelExecutor` (cluster/executor.py):

  steps    driver → every TP rank and the draft   (shared memory on one node, else TCP)
  drafts   draft  → every TP rank
  results  rank 0 → driver and the draft

Aux features go from rank 0 to the draft through a ring both map (workers/aux_transport.py:
CUDA IPC on a shared GPU, shared memory on CPU) or, for a separate draft, an NCCL (gloo on CPU)
send/recv pair; only a small `AuxRef` rides the results channel.

Failure handling: while the driver waits on the channel it checks the loops' Ray tasks, so a
dead actor (or one whose loop raised) surfaces within `POLL_S` of Ray noticing. A step that
runs far past what the warm-up's steps took is overdue (cluster/executor.py, StepTimes): the
actors are probed through Ray, and one that does not answer (a frozen process) fails the step
within seconds; one whose step is slow but whose process answers has until `step_timeout_s`.
The caller then `restart()`s: every actor of the engine is killed and started afresh in the
same placement group."""

from __future__ import annotations

import logging
import time

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cluster.engine import EnginePlan, LLMEngine
from cluster.executor import (
    ActorStepTimeout,
    ActorUnresponsive,
    ChannelExecutor,
    StepTimes,
    execute,
)
from cluster.startup import start_parts
from configs.engine import EngineConfig
from draft.actor import DraftWorker
from workers.channel import ChannelReader, ChannelWriter
from workers.cuda_graphs import graph_batch_buckets
from workers.messages import StepKind, StepMsg
from workers.worker import TargetWorker

log = logging.getLogger(__name__)

# Generous: a first step on a GPU may compile Triton kernels for minutes.
DEFAULT_STEP_TIMEOUT_S = 900.0
# The step loop holds one of an actor's threads for its whole life; the other answers calls
# that do not touch the model (ping, node_id, an operator's introspection).
LOOP_ACTOR_CONCURRENCY = 2

__all__ = ["ActorStepTimeout", "DEFAULT_STEP_TIMEOUT_S", "RayEngineCluster", "engine_bundles",
           "separate_draft", "wait_all"]


class ActorDied(RuntimeError):
    """An actor of the engine died, or its step loop raised."""


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


class RayMembers:
    def __init__(self, actors: list, timeout_s: float, what: str):
        self.actors, self.timeout_s, self.what = actors, timeout_s, what

    def call(self, method: str, *args) -> list:
        return wait_all([getattr(a, method).remote(*args) for a in self.actors], self.timeout_s,
                        f"{self.what} {method}")


class RayParts:
    """The start-up steps (cluster/startup.py) over the actors of `cluster`."""

    def __init__(self, cluster: RayEngineCluster):
        self.c = cluster
        self.targets: RayMembers | None = None
        self.draft: RayMembers | None = None

    def load(self) -> None:
        c, cfg, plan, timeout = self.c, self.c.cfg, self.c.plan, self.c.step_timeout_s
        has_draft = plan.draft_config is not None
        shared = has_draft and not c.separate_draft  # rank 0 and the draft split a GPU

        def gpus(share: float) -> float:
            return share if c.use_gpu else 0

        # A ring slot holds the largest step: a prefill budget, or every sequence's block.
        aux_ring_rows = max(cfg.max_num_batched_tokens, cfg.max_num_seqs * plan.block_size)
        aux_ring_rows = aux_ring_rows if has_draft else 0
        worker_cls = ray.remote(TargetWorker)
        log.info("starting %d target worker%s%s: each process imports torch and sets up its "
                 "device, then loads its weights", c.tp, "s" if c.tp > 1 else "",
                 " and the draft actor" if has_draft else "")
        c.workers = [
            worker_cls.options(num_cpus=1, num_gpus=gpus(0.5 if (i == 0 and shared) else 1),
                               scheduling_strategy=c.in_bundle(i), max_restarts=0,
                               max_concurrency=LOOP_ACTOR_CONCURRENCY)
            .remote(cfg, plan.aux_layer_ids, i, c.tp, aux_ring_rows)
            for i in range(c.tp)
        ]
        addr, port = wait_all([c.workers[0].address.remote()], timeout, "rank 0 address")[0]
        log.info("target rank 0 is up at %s:%d; loading the weights", addr, port)
        loads = [w.init_model.remote(addr, port) for w in c.workers]
        if has_draft:  # alongside the target (colocated: its weights count in rank 0's profile)
            c.draft = ray.remote(DraftWorker).options(
                num_cpus=0 if shared else 1, num_gpus=gpus(0.5 if shared else 1),
                scheduling_strategy=c.in_bundle(0 if shared else c.tp), max_restarts=0,
                max_concurrency=LOOP_ACTOR_CONCURRENCY,
            ).remote(cfg, plan.block_size)
            loads.append(c.draft.load_report.remote())
        for report in wait_all(loads, timeout, "model load"):
            log.info("%s", report.line())
        self.targets = RayMembers(c.workers, timeout, "target")
        self.draft = RayMembers([c.draft], timeout, "draft") if has_draft else None

    def connect_aux(self) -> None:
        c, timeout = self.c, self.c.step_timeout_s
        rank0 = c.workers[0]
        spec = wait_all([rank0.aux_spec.remote()], timeout, "aux ring")[0]
        # Together: a pair transport's two ends rendezvous (the others return at once).
        wait_all([rank0.connect_aux.remote(), c.draft.open_aux.remote(spec)], timeout,
                 "aux transport")
        wait_all([rank0.seal_aux.remote()], timeout, "aux transport")


class RayEngineCluster:
    """Places and starts the actors of one engine; `engine` is an LLMEngine over them, warmed
    up.

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
        log.info("Ray at %s; starting the engine from node %s", ray.get_runtime_context()
                 .gcs_address, ray.util.get_node_ip_address())
        self.pg = pg or placement_group(engine_bundles(tp, self.use_gpu, self.separate_draft),
                                        strategy="STRICT_PACK")
        ray.get(self.pg.ready())
        log.info("placement group ready: %s (%s)", " + ".join(map(str, self.pg.bundle_specs)),
                 "STRICT_PACK" if self.owns_pg else "the Serve replica's")
        self.workers: list = []
        self.draft = None
        self.loops: dict = {}  # each actor's serve_steps task → its name
        self.channel_kind = ""
        self.executor: ChannelExecutor | None = None
        # The first start's warm-up sets what a step is expected to take; restarts keep it.
        self.step_times = StepTimes()
        self.restarts = 0
        self.engine = self._start()

    def in_bundle(self, i: int) -> PlacementGroupSchedulingStrategy:
        return PlacementGroupSchedulingStrategy(placement_group=self.pg,
                                                placement_group_bundle_index=i)

    def _start(self) -> LLMEngine:
        """Start-up (the page count measured the first time is kept for restarts), the step
        loops, then the warm-up."""
        self.plan = start_parts(RayParts(self), self.cfg, self.plan)
        self.executor = self._start_loops()
        engine = LLMEngine(self.cfg, self.executor, self.plan)
        start = time.perf_counter()
        engine.warm_up()
        self.step_times.calibrate()
        w, graphs = engine.warmup, "no CUDA graphs (enforce_eager)"
        if not self.cfg.device.startswith("cuda"):
            graphs = f"no CUDA graphs on {self.cfg.device}"
        elif not self.cfg.enforce_eager:  # the warm-up's rounds capture them
            graphs = (f"CUDA graphs captured for "
                      f"{len(graph_batch_buckets(self.cfg.max_num_seqs))} batch sizes")
        log.info("warm-up done in %.1f s: %d requests, %d steps; %s",
                 time.perf_counter() - start, w.get("requests", 0), w.get("steps", 0), graphs)
        return engine

    def _actors(self) -> list:
        return [*self.workers, *([self.draft] if self.draft is not None else [])]

    def _pick_channel_kind(self) -> str:
        kind = self.cfg.control_channel
        if kind != "auto":
            return kind
        here = ray.get_runtime_context().get_node_id()
        nodes = wait_all([a.node_id.remote() for a in self._actors()], self.step_timeout_s,
                         "node ids")
        return "shm" if all(n == here for n in nodes) else "tcp"

    def _start_loops(self) -> ChannelExecutor:
        """Creates the three channels (each writer makes its own, the readers open it, the
        writer seals it) and starts every actor's step loop."""
        kind, spin, timeout = self._pick_channel_kind(), self.cfg.control_spin_s, \
            self.step_timeout_s
        self.channel_kind = kind
        rank0, draft, tp = self.workers[0], self.draft, self.tp
        host = ray.util.get_node_ip_address()
        steps = ChannelWriter(kind, tp + (draft is not None), host=host, spin_s=spin)
        creates = [rank0.create_channel.remote(kind, 1 + (draft is not None), None, spin)]
        if draft is not None:
            creates.append(draft.create_channel.remote(kind, tp, None, spin))
        specs = wait_all(creates, timeout, "control channels")
        opens = [w.open_channel.remote("steps", steps.spec, i, spin)
                 for i, w in enumerate(self.workers)]
        if draft is not None:
            opens += [w.open_channel.remote("drafts", specs[1], i, spin)
                      for i, w in enumerate(self.workers)]
            opens += [draft.open_channel.remote("steps", steps.spec, tp, spin),
                      draft.open_channel.remote("results", specs[0], 1, spin)]
        results = ChannelReader(specs[0], 0, spin)
        wait_all(opens, timeout, "control channels")
        steps.seal(timeout)
        writers = [rank0, *([draft] if draft is not None else [])]
        wait_all([w.seal_channel.remote() for w in writers], timeout, "control channels")
        names = [f"target rank {i}" for i in range(tp)] + (["draft"] if draft else [])
        self.loops = {a.serve_steps.remote(): name
                      for a, name in zip(self._actors(), names, strict=True)}
        return ChannelExecutor(steps, results, self._check_loops, timeout, self._probe,
                               self.step_times)

    def _check_loops(self) -> None:
        """Raises ActorDied if an actor's step loop has ended (it never does while healthy)."""
        ready, _ = ray.wait(list(self.loops), num_returns=1, timeout=0)
        if not ready:
            return
        name = self.loops[ready[0]]
        try:
            ray.get(ready[0])
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if isinstance(getattr(e, "cause", None), Exception) else e
            raise ActorDied(f"{name}: {type(cause).__name__}: {cause}") from None
        except ray.exceptions.RayActorError:
            raise ActorDied(f"{name} died") from None
        raise ActorDied(f"{name}'s step loop returned")

    def _probe(self, timeout_s: float) -> None:
        """Asks every actor, through Ray (the thread beside its step loop), to answer within
        `timeout_s`; raises ActorUnresponsive naming those that did not (ActorDied for one that
        died)."""
        self._check_loops()
        names = [f"target rank {i}" for i in range(self.tp)] + (["draft"] if self.draft else [])
        refs = {a.ping.remote(): name for a, name in zip(self._actors(), names, strict=True)}
        ready, pending = ray.wait(list(refs), num_returns=len(refs), timeout=timeout_s)
        for ref in ready:
            try:
                ray.get(ref)
            except ray.exceptions.RayActorError:
                raise ActorDied(f"{refs[ref]} died") from None
        if pending:
            raise ActorUnresponsive(f"{', '.join(refs[r] for r in pending)} did not answer a "
                                    f"probe within {timeout_s:g} s")

    def stalled(self) -> str | None:
        """Why the step waited on now is overdue, while its actors are being probed (any
        thread may ask)."""
        executor = self.executor
        return None if executor is None else executor.stalled

    def actors(self) -> dict[str, list]:
        """Handles of the live actors (for operators and fault-injection tests)."""
        return {"workers": list(self.workers), "draft": [self.draft] if self.draft else []}

    def ping(self, timeout_s: float = 10.0) -> None:
        """Raises if an actor is dead, or rank 0's loop does not answer within `timeout_s`, or
        an actor does not answer the probe of an overdue ping. Writes the steps channel: call
        it from the thread that steps the engine."""
        self._check_loops()
        self.executor.submit(StepMsg(-2, StepKind.CALL, call=("ping", ())))
        self.executor.result(timeout_s)

    def call_workers(self, method: str, *args) -> object:
        """TargetWorker.method(*args) on every rank, in step with the loops; rank 0's value
        (e.g. bench/engine.py's all-reduce timing). Same thread rule as `ping`."""
        return execute(self.executor, StepMsg(-3, StepKind.CALL, call=(method, args))).value

    def restart(self) -> LLMEngine:
        """Kills every actor (a rank that survived may hold half-committed state, or sit in a
        collective with a dead peer) and starts them afresh; the new engine keeps the
        cumulative statistics. Requests in flight are the caller's to fail."""
        self._kill_actors()
        old = self.engine
        self.engine = self._start()
        self.engine.stats, self.engine.draft_time = old.stats, old.draft_time
        self.engine.verify_time = old.verify_time
        self.restarts += 1
        return self.engine

    def _kill_actors(self) -> None:
        for actor in self._actors():
            ray.kill(actor, no_restart=True)
        self.workers, self.draft, self.loops = [], None, {}
        if self.executor is not None:
            self.executor.steps.close()
            self.executor.results.close()
            self.executor = None

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()  # STOP: the loops return
            self.executor = None
        self._kill_actors()
        if self.owns_pg:
            remove_placement_group(self.pg)
