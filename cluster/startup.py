"""One start-up sequence for both engines: load → aux transport → profile → allocate (then the
engine warms up, `LLMEngine.warm_up`). In process the parts are plain objects; in the cluster
(cluster/ray_executor.py) Ray actors. Either way `start_parts` runs the same steps over an
`EngineParts`, which says how each step reaches its processes."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Protocol

from cluster.executor import LocalExecutor
from configs.engine import (
    CPU_SNAPSHOTS_PER_SEQ,
    MAX_SNAPSHOTS,
    PREFIX_STATE_FRACTION,
    EngineConfig,
)
from configs.model import TargetConfig
from draft.actor import DraftWorker
from draft.config import DraftConfig
from target.kernels import selection
from target.kernels.attention import backend_name
from workers.cache import state_slot_bytes
from workers.memory import MemoryProfile, plan_num_pages, plan_snapshots
from workers.worker import TargetWorker

log = logging.getLogger(__name__)


# vLLM's variable: "1" allows a max_model_len above the model's max_position_embeddings.
ALLOW_LONG_MAX_MODEL_LEN_ENV = "VLLM_ALLOW_LONG_MAX_MODEL_LEN"


def resolve_max_model_len(cfg: EngineConfig, target_config: TargetConfig) -> int:
    """The context length: the configured one, else the target's. Resolved here alone; the
    plan hands it to the scheduler, the workers and the draft. Longer than the model's
    max_position_embeddings only when allowed, as vLLM: `allow_long_max_model_len` or
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (past it, outputs may be garbage)."""
    limit = target_config.max_position_embeddings
    if cfg.max_model_len is None:
        return limit
    allowed = cfg.allow_long_max_model_len or os.environ.get(
        ALLOW_LONG_MAX_MODEL_LEN_ENV, "").strip().lower() in ("1", "true")
    if cfg.max_model_len > limit and not allowed:
        raise ValueError(
            f"max_model_len {cfg.max_model_len} is longer than the model's context "
            f"(max_position_embeddings {limit} in its config.json): pass at most {limit}, or "
            f"allow it with --allow-long-max-model-len (the YAML's allow_long_max_model_len: "
            f"true) or {ALLOW_LONG_MAX_MODEL_LEN_ENV}=1; past it, outputs may be garbage")
    return cfg.max_model_len


@dataclass(frozen=True)
class EnginePlan:
    """What both the in-process and the Ray engine derive from an EngineConfig."""

    target_config: TargetConfig
    draft_config: DraftConfig | None  # with the block-size override applied
    block_size: int  # B tokens verified per round; 1 without a draft
    max_model_len: int  # resolve_max_model_len
    # KV pages per rank. None: measured at start-up (GPU), see workers/memory.py.
    num_pages: int | None
    min_pages: int  # pages one full-length sequence (+ a verify block) reaches
    # The prefix cache's state snapshot slots per target rank (their ids follow the running
    # sequences' slots and the CUDA graphs' padding slot: `snapshot_slots`); 0 without prefix
    # caching. None: measured at start-up with the pages.
    num_snapshots: int | None = 0

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.draft_config.target_layer_ids) if self.draft_config else ()

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> EnginePlan:
        selection.check(cfg.kernels, cfg.device)  # a Triton kernel where it cannot run: now
        tcfg = TargetConfig.from_pretrained(cfg.model)
        dcfg = None
        if cfg.draft_model:
            dcfg = DraftConfig.from_pretrained(cfg.draft_model)
            dcfg.validate_against(tcfg)
            if cfg.block_size is not None:
                dcfg = dcfg.with_block_size(cfg.block_size)
        block = dcfg.block_size if dcfg else 1
        max_model_len = resolve_max_model_len(cfg, tcfg)
        pages_per_seq = -(-(max_model_len + block) // cfg.page_size)
        num_pages = cfg.num_pages
        if num_pages is None and not cfg.device.startswith("cuda"):
            num_pages = cfg.max_num_seqs * pages_per_seq  # CPU: nothing to measure
        snapshots: int | None = 0
        if cfg.enable_prefix_caching and tcfg.linear_attention_layers:
            if num_pages is None:
                snapshots = None  # measured with the pages
            elif cfg.prefix_cache_state_gb is not None:
                snapshots = min(MAX_SNAPSHOTS, int(cfg.prefix_cache_state_gb * (1 << 30)
                                                   // state_slot_bytes(tcfg, cfg.torch_dtype)))
            else:
                snapshots = CPU_SNAPSHOTS_PER_SEQ * cfg.max_num_seqs
        return cls(tcfg, dcfg, block, max_model_len, num_pages, pages_per_seq, snapshots)

    def with_measured_pages(self, profiles: list[MemoryProfile | None], max_num_seqs: int,
                            state_gb: float | None = None) -> EnginePlan:
        """The page count (and the snapshots', where they are measured too) from the
        processes' memory profiles; `state_gb`: EngineConfig.prefix_cache_state_gb."""
        if self.num_pages is not None:
            return self
        measured = [p for p in profiles if p is not None]
        snapshots = self.num_snapshots
        if snapshots is None:
            snapshots = plan_snapshots(measured, max_num_seqs, state_gb,
                                       PREFIX_STATE_FRACTION, MAX_SNAPSHOTS)
        num_pages = plan_num_pages(measured, max_num_seqs + snapshots, self.min_pages)
        return replace(self, num_pages=num_pages, num_snapshots=snapshots)

    def snapshot_slots(self, max_num_seqs: int) -> list[int]:
        """The snapshot slots' ids on the target ranks: after the running sequences' slots
        and the padding slot of the CUDA graphs (max_num_seqs)."""
        return list(range(max_num_seqs + 1, max_num_seqs + 1 + (self.num_snapshots or 0)))


class Members(Protocol):
    """Processes of one engine part (the TP ranks; the draft)."""

    def call(self, method: str, *args) -> list:
        """method(*args) on every member, at once; their results in rank order."""
        ...


class EngineParts(Protocol):
    targets: Members
    draft: Members | None

    def load(self) -> None:
        """Weights (the TP group formed first), the draft's alongside."""
        ...

    def connect_aux(self) -> None:
        """Rank 0's aux feature transport to the draft, both ends."""
        ...


def start_parts(parts: EngineParts, cfg: EngineConfig, plan: EnginePlan) -> EnginePlan:
    """Loads, connects, sizes the KV pool (measured on a GPU; the page count of a restart's
    plan is kept) and allocates; returns the plan with the page count."""
    log.info("dtype %s on %s", str(cfg.torch_dtype).removeprefix("torch."), cfg.device)
    parts.load()
    if parts.draft is not None:
        parts.connect_aux()
    kv_bytes = None  # KV bytes per page on one GPU: measured (CUDA) only
    if plan.num_pages is None:
        profiles = parts.targets.call("profile", plan.block_size, plan.max_model_len)
        if parts.draft is not None:  # after the target's: colocated, both measure one GPU
            profiles += parts.draft.call("profile", plan.max_model_len)
        peaks = [p.activation_peak for p in profiles if p is not None]
        plan = plan.with_measured_pages(profiles, cfg.max_num_seqs, cfg.prefix_cache_state_gb)
        if peaks:  # rank 0's GPU (the draft's pages too where it shares it)
            gpu0 = next(p.gpu_id for p in profiles if p is not None)
            kv_bytes = sum(p.bytes_per_page for p in profiles
                           if p is not None and p.gpu_id == gpu0)
            log.info("measured activation peaks of the largest steps at %d tokens of context: "
                     "%s GiB", plan.max_model_len, ", ".join(f"{p / 2**30:.2f}" for p in peaks))
    parts.targets.call("allocate", plan.num_pages, plan.max_model_len, plan.num_snapshots)
    if parts.draft is not None:
        parts.draft.call("allocate", plan.num_pages, plan.max_model_len)
    size = f", {plan.num_pages * kv_bytes / 2**30:.2f} GiB per GPU" if kv_bytes else ""
    log.info("memory plan: KV cache %d pages of %d tokens (%d tokens%s), max_model_len %d, "
             "max_num_seqs %d, prefix cache %s", plan.num_pages, cfg.page_size,
             plan.num_pages * cfg.page_size, size, plan.max_model_len, cfg.max_num_seqs,
             f"on ({plan.num_snapshots} state snapshots)" if cfg.enable_prefix_caching
             else "off")
    log.info("kernels: attention %s, experts %s, routing %s, recurrence %s",
             backend_name(cfg.device, cfg.torch_dtype,
                          selection.attention_kernel(cfg.kernels, cfg.device)),
             selection.experts_kernel(cfg.kernels, cfg.device),
             selection.routing_kernel(cfg.kernels, cfg.device),
             selection.recurrence_label(cfg.kernels, cfg.device))
    return plan


class LocalMembers:
    def __init__(self, objs: list):
        self.objs = objs

    def call(self, method: str, *args) -> list:
        return [getattr(o, method)(*args) for o in self.objs]


class LocalParts:
    """Rank 0 of a TP-1 target in this process; the draft borrows its embedding and lm_head."""

    def __init__(self, cfg: EngineConfig, plan: EnginePlan):
        self.cfg, self.plan = cfg, plan
        self.worker = TargetWorker(cfg, plan.aux_layer_ids, rank=0, tp=1)
        self.drafter: DraftWorker | None = None
        self.targets = LocalMembers([self.worker])
        self.draft: LocalMembers | None = None

    def load(self) -> None:
        self.worker.init_model()
        if self.plan.draft_config is not None:
            model = self.worker.model
            self.drafter = DraftWorker(self.cfg, self.plan.block_size, model.embed,
                                       model.compute_logits, self.worker.device)
            self.draft = LocalMembers([self.drafter])

    def connect_aux(self) -> None:
        pass  # the aux tensors go straight from the target's step to the draft


def start_in_process(cfg: EngineConfig, plan: EnginePlan) -> tuple[LocalExecutor, EnginePlan]:
    parts = LocalParts(cfg, plan)
    plan = start_parts(parts, cfg, plan)
    drafter = parts.drafter.runner if parts.drafter is not None else None
    replay = parts.drafter.replay if parts.drafter is not None else None
    return LocalExecutor(parts.worker.runner, drafter, parts.worker.controls, replay), plan
