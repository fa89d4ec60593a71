"""The in-process engine: prefill → (propose → verify → accept → commit)* → stop.

Used directly by `dflash-serve generate` and, in the cluster, by the driver actor. The engine
never touches model tensors beyond handing the runner's outputs to the drafter.
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from cluster.block_manager import BlockManager
from cluster.scheduler import Scheduler
from cluster.sequence import Sequence
from cluster.stats import TimeAccumulator
from configs.engine import EngineConfig, SamplingParams
from configs.model import TargetConfig
from draft.actor import DraftWorker
from draft.config import DraftConfig
from draft.proposer import DraftRunner
from workers.memory import MemoryProfile, plan_num_blocks
from workers.model_runner import ModelRunner, SeqInput, StepOutput
from workers.worker import TargetWorker


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    new_token_ids: list[int]  # produced since the previous step (for streaming)
    output_ids: list[int]
    finished: bool
    finish_reason: str | None
    acceptance_lengths: list[int]


@dataclass
class AcceptanceStats:
    rounds: int = 0
    tokens: int = 0  # tokens committed by rounds
    accepted_at: list[int] = field(default_factory=list)  # [K] rounds whose draft i was accepted
    lengths: dict[int, int] = field(default_factory=dict)  # committed per round → count

    def record(self, num_accepted: int, num_drafts: int) -> None:
        if len(self.accepted_at) < num_drafts:
            self.accepted_at += [0] * (num_drafts - len(self.accepted_at))
        self.rounds += 1
        self.tokens += num_accepted + 1
        self.lengths[num_accepted + 1] = self.lengths.get(num_accepted + 1, 0) + 1
        for i in range(num_accepted):
            self.accepted_at[i] += 1

    @property
    def mean_acceptance_length(self) -> float:
        return self.tokens / self.rounds if self.rounds else 0.0

    @property
    def position_acceptance_rate(self) -> list[float]:
        return [a / self.rounds for a in self.accepted_at] if self.rounds else []


def read_eos_ids(model_dir: str, from_config: tuple[int, ...]) -> set[int]:
    ids = set(from_config)
    gen = Path(model_dir) / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids |= set(eos if isinstance(eos, list) else [] if eos is None else [eos])
    return ids


@dataclass(frozen=True)
class EnginePlan:
    """What both the in-process and the Ray engine derive from an EngineConfig."""

    target_config: TargetConfig
    draft_config: DraftConfig | None  # with the block-size override applied
    block_size: int  # B tokens verified per round; 1 without a draft
    max_model_len: int
    # KV pages per rank. None: measured at start-up (GPU), see workers/memory.py.
    num_kv_blocks: int | None
    min_kv_blocks: int  # pages one full-length sequence (+ a verify block) reaches

    @property
    def aux_layer_ids(self) -> tuple[int, ...]:
        return tuple(self.draft_config.target_layer_ids) if self.draft_config else ()

    @classmethod
    def from_config(cls, cfg: EngineConfig) -> EnginePlan:
        tcfg = TargetConfig.from_pretrained(cfg.model)
        dcfg = None
        if cfg.draft_model:
            dcfg = DraftConfig.from_pretrained(cfg.draft_model)
            dcfg.validate_against(tcfg)
            if cfg.block_size is not None:
                dcfg = dcfg.with_block_size(cfg.block_size)
        block = dcfg.block_size if dcfg else 1
        max_len = cfg.max_model_len or tcfg.max_position_embeddings
        pages_per_seq = -(-(max_len + block) // cfg.kv_block_size)
        num_blocks = cfg.num_kv_blocks
        if num_blocks is None and not cfg.device.startswith("cuda"):
            num_blocks = cfg.max_num_seqs * pages_per_seq  # CPU: nothing to measure
        return cls(tcfg, dcfg, block, max_len, num_blocks, pages_per_seq)

    def with_measured_blocks(self, profiles: list[MemoryProfile | None],
                             max_num_seqs: int) -> EnginePlan:
        if self.num_kv_blocks is not None:
            return self
        measured = [p for p in profiles if p is not None]
        num_blocks = plan_num_blocks(measured, max_num_seqs, self.min_kv_blocks)
        return replace(self, num_kv_blocks=num_blocks)


class LLMEngine:
    """`runner` (prefill / verify / release) and `drafter` (propose / write_context) run in
    this process by default; the Ray driver passes actor-backed ones with the same methods."""

    def __init__(self, cfg: EngineConfig, runner=None, drafter=None,
                 plan: EnginePlan | None = None):
        self.cfg = cfg
        self.plan = plan or EnginePlan.from_config(cfg)
        self.target_config = self.plan.target_config
        self.draft_config = self.plan.draft_config
        self.block_size = self.plan.block_size
        self.max_model_len = self.plan.max_model_len
        if runner is None:
            runner, drafter = self._local_parts(cfg)
        self.runner, self.drafter = runner, drafter
        self.blocks = BlockManager(self.plan.num_kv_blocks, cfg.kv_block_size, cfg.max_num_seqs)
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, self.max_model_len,
                                   lookahead=self.block_size,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens)
        self.eos_ids = read_eos_ids(cfg.model, self.target_config.eos_token_ids)
        self.stats = AcceptanceStats()
        self.draft_time = TimeAccumulator()  # per propose call
        self.verify_time = TimeAccumulator()  # per verify call (forward + accept + commit)
        self._seq_ids = itertools.count()
        self._by_request: dict[str, Sequence] = {}

    def _local_parts(self, cfg: EngineConfig) -> tuple[ModelRunner, DraftRunner | None]:
        worker = TargetWorker(cfg, self.plan.aux_layer_ids, rank=0, tp=1)
        worker.init_model()
        self.target = worker.model
        draft = None
        if self.plan.draft_config is not None:
            draft = DraftWorker(cfg, self.plan.block_size, self.target.embed,
                                self.target.compute_logits, worker.device)
        profiles = [worker.profile(self.plan.block_size), draft.profile() if draft else None]
        self.plan = self.plan.with_measured_blocks(profiles, cfg.max_num_seqs)
        worker.allocate(self.plan.num_kv_blocks)
        if draft is None:
            return worker.runner, None
        draft.allocate(self.plan.num_kv_blocks)
        return worker.runner, draft.runner

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        vocab = self.target_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(prompt_ids)} tokens; the context length is {self.max_model_len}"
            )
        seq_id = next(self._seq_ids)
        request_id = request_id or f"req-{seq_id}"
        if request_id in self._by_request:
            raise ValueError(f"request id {request_id!r} is already in use")
        seq = Sequence(seq_id, request_id, list(prompt_ids), params)
        self.scheduler.add(seq)
        self._by_request[request_id] = seq
        return request_id

    def abort(self, request_id: str) -> None:
        seq = self._by_request.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")
            self.runner.release(seq.seq_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.prefill:
            self._prefill(plan.prefill, plan.chunk_lens)
        elif plan.decode:
            self._round(plan.decode)
        return self._collect(plan.prefill + plan.decode)

    def _prefill(self, seqs: list[Sequence], chunk_lens: list[int]) -> None:
        # Each feeds the next chunk of its prompt; only a prompt's last chunk samples a token.
        out = self.runner.prefill([
            SeqInput(s.seq_id, s.prompt_ids[s.num_cached : s.num_cached + n], s.num_cached,
                     s.block_table, s.state_slot, s.params,
                     sample=s.num_cached + n == len(s.prompt_ids))
            for s, n in zip(seqs, chunk_lens, strict=True)
        ])
        self._feed_draft(seqs, out)
        for s, n, toks in zip(seqs, chunk_lens, out.new_tokens, strict=True):
            s.num_cached += n
            if s.prefilled:
                self._append(s, toks)

    def _round(self, seqs: list[Sequence]) -> None:
        t0 = time.perf_counter()
        if self.drafter is not None:
            drafts = self.drafter.propose([s.anchor for s in seqs], [s.num_cached for s in seqs],
                                          [s.block_table for s in seqs]).tolist()
            self.draft_time.observe(time.perf_counter() - t0)
        else:
            drafts = [[] for _ in seqs]
        t1 = time.perf_counter()
        out = self.runner.verify([
            SeqInput(s.seq_id, [s.anchor, *d], s.num_cached, s.block_table, s.state_slot,
                     s.params)
            for s, d in zip(seqs, drafts, strict=True)
        ])
        self.verify_time.observe(time.perf_counter() - t1)
        self._feed_draft(seqs, out)
        for s, toks, n in zip(seqs, out.new_tokens, out.num_accepted, strict=True):
            s.num_cached += n + 1
            self.stats.record(n, self.block_size - 1)
            s.acceptance_lengths.append(self._append(s, toks))

    def _feed_draft(self, seqs: list[Sequence], out: StepOutput) -> None:
        if self.drafter is not None:
            aux = out.aux if out.aux_ref is None else out.aux_ref
            self.drafter.write_context(aux, out.aux_positions,
                                       [s.block_table for s in seqs], out.num_committed)

    def _append(self, seq: Sequence, tokens: list[int]) -> int:
        """Appends tokens up to the first stop condition; returns how many were kept."""
        p = seq.params
        for i, tok in enumerate(tokens):
            seq.output_ids.append(tok)
            if (tok in self.eos_ids and not p.ignore_eos) or tok in p.stop_token_ids:
                self.scheduler.finish(seq, "stop")
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                self.scheduler.finish(seq, "length")
            if seq.finished:
                return i + 1
        return len(tokens)

    def _collect(self, seqs: list[Sequence]) -> list[RequestOutput]:
        outs = []
        for s in seqs:
            new = s.output_ids[s.num_streamed :]
            if not new and not s.finished:
                continue  # a non-final prompt chunk: nothing to report yet
            s.num_streamed = len(s.output_ids)
            outs.append(RequestOutput(s.request_id, s.prompt_ids, new, list(s.output_ids),
                                      s.finished, s.finish_reason, list(s.acceptance_lengths)))
            if s.finished:
                self.runner.release(s.seq_id)
                self._by_request.pop(s.request_id, None)
        return outs

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        final: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
