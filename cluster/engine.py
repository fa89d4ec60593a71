"""The engine: prefill → (propose → verify → accept → commit)* → stop.

Used directly by `dflash-serve generate` and, in the cluster, by the driver actor. The engine
never touches model tensors: it schedules, sends each step to an executor and applies what
comes back.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from cluster.block_manager import BlockManager
from cluster.executor import Executor
from cluster.prefix_cache import PrefixCache, PrefixCacheSnapshot, PrefixCacheStats, page_keys
from cluster.scheduler import ScheduledStep, Scheduler
from cluster.sequence import Sequence
from cluster.speculation import AdaptiveDraftLength, measure_round_costs
from cluster.startup import EnginePlan, start_in_process
from cluster.stats import TimeAccumulator
from configs.engine import EngineConfig, SamplingParams
from workers.cache import state_slot_bytes
from workers.cuda_graphs import graph_batch_buckets
from workers.logprobs import TokenLogprob
from workers.messages import NewSeq, StepKind, StepMsg

log = logging.getLogger(__name__)

__all__ = ["AcceptanceStats", "EnginePlan", "LLMEngine", "RequestOutput", "read_eos_ids"]


@dataclass
class RequestOutput:
    request_id: str
    prompt_ids: list[int]
    new_token_ids: list[int]  # produced since the previous step (for streaming)
    output_ids: list[int]
    finished: bool
    finish_reason: str | None
    acceptance_lengths: list[int]
    error: str | None = None  # finish_reason "error": why this request failed alone
    # params.logprobs: one per token of new_token_ids
    new_logprobs: list[TokenLogprob] | None = None
    # params.prompt_logprobs, in the first output only: one per prompt token, None for the
    # first (nothing precedes it)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens the prefix cache spared (not prefilled)


@dataclass
class AcceptanceStats:
    rounds: int = 0
    tokens: int = 0  # tokens committed by rounds
    accepted_at: list[int] = field(default_factory=list)  # [K] rounds whose draft i was accepted
    lengths: dict[int, int] = field(default_factory=dict)  # committed per round → count
    draft_tokens: int = 0  # tokens proposed by the draft (B − 1 per round)
    # rounds by their drafts per sequence (B − 1, or what the adaptive rule picked)
    draft_lengths: dict[int, int] = field(default_factory=dict)

    def record(self, num_accepted: int, num_drafts: int) -> None:
        if len(self.accepted_at) < num_drafts:
            self.accepted_at += [0] * (num_drafts - len(self.accepted_at))
        self.rounds += 1
        self.draft_tokens += num_drafts
        self.draft_lengths[num_drafts] = self.draft_lengths.get(num_drafts, 0) + 1
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


# Tokens each request of the adaptive rule's cost measurement generates: ~10 rounds of random
# drafts, fewer where the draft guesses right.
COST_ROUND_TOKENS = 12


class LLMEngine:
    """The scheduler, the sequences and the stop conditions; each step goes to an `executor`
    (cluster/executor.py) as one StepMsg and comes back as one StepResult. Without one, the
    engine starts its target and draft in this process (cluster/startup.py); the Ray driver
    passes a ChannelExecutor over the actors. `warm_up` runs the shapes a first request meets."""

    def __init__(self, cfg: EngineConfig, executor: Executor | None = None,
                 plan: EnginePlan | None = None):
        self.cfg = cfg
        self.plan = plan or EnginePlan.from_config(cfg)
        if executor is None:
            executor, self.plan = start_in_process(cfg, self.plan)
        self.executor = executor
        self.target_config = self.plan.target_config
        self.draft_config = self.plan.draft_config
        self.has_draft = self.draft_config is not None
        self.block_size = self.plan.block_size
        self.max_model_len = self.plan.max_model_len
        prefix = PrefixCache(cfg.page_size, self.plan.snapshot_slots(cfg.max_num_seqs)) \
            if cfg.enable_prefix_caching else None
        self.blocks = BlockManager(self.plan.num_pages, cfg.page_size, cfg.max_num_seqs, prefix)
        self.prefix = prefix
        self.scheduler = Scheduler(self.blocks, cfg.max_num_seqs, self.max_model_len,
                                   lookahead=self.block_size,
                                   max_num_batched_tokens=cfg.max_num_batched_tokens)
        self.eos_ids = read_eos_ids(cfg.model, self.target_config.eos_token_ids)
        self._eos_tuple = tuple(sorted(self.eos_ids))
        # statistics: acceptance; per proposal, where the draft runs (draft_time); per round,
        # target forward + accept + commit (verify_time); per step as the driver sees it, by
        # kind, from its submission to its result applied (step_time: the step's processes,
        # the transfers and this engine's own work)
        self._fresh_stats()
        self._step_started = 0.0
        self._seq_ids = itertools.count()
        self.num_steps = 0  # step messages sent (their ids)
        self._by_request: dict[str, Sequence] = {}
        self._sent: set[int] = set()  # seq ids the executor's side knows
        self._released: list[int] = []  # seq ids to drop there with the next step
        self._in_flight: ScheduledStep | None = None
        self._deferred_aborts: list[str] = []
        self._snapshots: list[tuple[Sequence, int, int]] = []  # the step in flight takes
        self.warmup: dict[str, float] = {}  # what warm_up ran: requests, steps, seconds
        # The drafts per sequence of the next round, given its sequences: K in [0, B − 1] (0:
        # a plain decode step; the draft still writes the token into its context), or None
        # for B − 1. None here: every round drafts B − 1.
        self.draft_length: Callable[[list[Sequence]], int | None] | None = None
        self._num_drafts = self.block_size - 1  # the round in flight's

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, prompt_ids: list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        if not isinstance(prompt_ids, (list, tuple)):
            raise ValueError(f"prompt must be a list of token ids, got "
                             f"{type(prompt_ids).__name__}")
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        vocab = self.target_config.vocab_size
        params.check_vocab(vocab)
        # exact ints only: a tensor or numpy value would reach the workers as something else
        if any(type(t) is not int or not 0 <= t < vocab for t in prompt_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
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
        """Drops the request; while a step is in flight, once it completes."""
        if self._in_flight is not None:
            self._deferred_aborts.append(request_id)
            return
        seq = self._by_request.pop(request_id, None)
        if seq is not None and not seq.finished:
            self.scheduler.finish(seq, "abort")
            self._release(seq)
            self._flush_if_idle()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work()

    @property
    def step_in_flight(self) -> ScheduledStep | None:
        """The step begun and not finished yet (what it runs: bench/prefix.py's breakdown)."""
        return self._in_flight

    def _flush_if_idle(self) -> None:
        """Finished sequences ride the next step to the executor's side; with no next step in
        sight, a RELEASE message drops them now."""
        if not self.scheduler.has_work():
            self.flush_releases()

    def flush_releases(self) -> None:
        """Drops finished sequences on the executor's side now, not with the next step."""
        if self._released and self._in_flight is None:
            self.executor.submit(StepMsg(self._next_step_id(), StepKind.RELEASE,
                                         released=self._released))
            self._released = []
            self.executor.result()

    # ---- one step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        return self.finish_step() if self.begin_step() else []

    def begin_step(self) -> bool:
        """Schedules a step and hands it to the executor (in the cluster, the actors start on
        it while this thread goes on); False when there is nothing to run."""
        plan = self.scheduler.schedule()
        if not plan.prefill and not plan.decode:
            return False
        seqs = plan.prefill or plan.decode
        new = [NewSeq(s.seq_id, s.prompt_ids, s.block_table, s.state_slot, s.params,
                      self._eos_tuple if s.params.has_controls else ())
               for s in seqs if s.seq_id not in self._sent]
        self._sent.update(s.seq_id for s in seqs)
        common = {"step_id": self._next_step_id(), "seq_ids": [s.seq_id for s in seqs],
                  "starts": [s.num_cached for s in seqs], "new_seqs": new,
                  "released": self._released}
        self._released = []
        if plan.prefill:
            restores, snapshots = self._state_copies(plan)
            msg = StepMsg(kind=StepKind.PREFILL, chunk_lens=list(plan.chunk_lens),
                          samples=[s.num_cached + n == len(s.prompt_ids)
                                   for s, n in zip(seqs, plan.chunk_lens, strict=True)],
                          restores=restores,
                          snapshots=[(s.seq_id, slot, pages * self.cfg.page_size)
                                     for s, slot, pages in snapshots],
                          **common)
            self._snapshots = snapshots
        else:
            taps = None
            if any(s.boundary_slot is not None for s in seqs):
                taps = [(-1, 0) if s.boundary_slot is None
                        else (s.boundary_slot, self.scheduler.tap_end(s)) for s in seqs]
            num_drafts = None
            if self.has_draft and self.draft_length is not None:
                num_drafts = self.draft_length(seqs)
                if num_drafts is not None and not 0 <= num_drafts < self.block_size:
                    raise ValueError(f"a round's drafts must be in [0, {self.block_size - 1}], "
                                     f"got {num_drafts}")
            self._num_drafts = self.block_size - 1 if num_drafts is None else num_drafts
            msg = StepMsg(kind=StepKind.ROUND, anchors=[s.anchor for s in seqs], taps=taps,
                          num_drafts=num_drafts, **common)
        self._step_started = time.perf_counter()
        self.executor.submit(msg)
        self._in_flight = plan
        return True

    def finish_step(self) -> list[RequestOutput]:
        """Waits for the step begun last and applies its result."""
        plan, self._in_flight = self._in_flight, None
        snapshots, self._snapshots = self._snapshots, []
        try:
            result = self.executor.result()
        except BaseException:
            for _, slot, _ in snapshots:  # nothing the step wrote is entered
                self.prefix.cancel_snapshot(slot)
            self._apply_deferred_aborts()
            raise
        if plan.prefill:
            failed = set()
            for i, (s, n, toks) in enumerate(zip(plan.prefill, plan.chunk_lens,
                                                 result.new_tokens, strict=True)):
                s.num_cached += n
                if i in result.errors:
                    failed.add(s.seq_id)
                    self._fail(s, result.errors[i])
                    continue
                self._enter_pages(s)
                s.prompt_logprobs += result.prompt_logprobs.get(i, [])
                if s.prefilled:
                    self._append(s, toks, result.logprobs.get(i))
                    self.scheduler.lend_boundary_slot(s)
            for s, slot, pages in snapshots:
                if s.seq_id in failed:
                    self.prefix.cancel_snapshot(slot)
                elif self.prefix.enter_snapshot(s.prompt_keys[pages - 1], slot, pages,
                                                s.last_snapshot):
                    s.last_snapshot = s.prompt_keys[pages - 1]
        else:
            if result.propose_s is not None:
                self.draft_time.observe(result.propose_s)
            self.verify_time.observe(result.verify_s)
            observe = getattr(self.draft_length, "observe", None)
            for i, (s, toks, n) in enumerate(zip(plan.decode, result.new_tokens,
                                                 result.num_accepted, strict=True)):
                s.num_cached += n + 1
                if i in result.errors:
                    self._fail(s, result.errors[i])
                    continue
                self.stats.record(n, self._num_drafts)
                if observe is not None:
                    observe(s.seq_id, n, self._num_drafts)
                self._enter_pages(s, toks[:n])  # (before a stop frees its pages)
                s.acceptance_lengths.append(self._append(s, toks, result.logprobs.get(i)))
        outputs = self._collect(plan.prefill + plan.decode)
        self.step_time["prefill" if plan.prefill else "round"].observe(
            time.perf_counter() - self._step_started)
        self._apply_deferred_aborts()
        self._flush_if_idle()
        return outputs

    # ---- the prefix cache (cluster/prefix_cache.py) ----------------------------------------

    def _state_copies(self, plan: ScheduledStep
                      ) -> tuple[list[tuple[int, int]], list[tuple[Sequence, int, int]]]:
        """A prefill step's restores (snapshot slot → state slot, for the sequences admitted on
        a hit) and the snapshots it takes: (sequence, snapshot slot, pages) for each chunk
        that passes its prompt's last page boundary before its last token or ends at a page
        boundary before it (Scheduler.snapshot_in), where the cache has no snapshot of that
        page yet."""
        if self.prefix is None:
            return [], []
        restores = []
        for s in plan.prefill:
            if s.restore_slot is not None:
                restores.append((s.restore_slot, s.state_slot))
                s.restore_slot = None
        keep = {slot for slot, _ in restores}
        snapshots = []
        page = self.cfg.page_size
        for s, n in zip(plan.prefill, plan.chunk_lens, strict=True):
            at = self.scheduler.snapshot_in(s, n)
            if s.prompt_keys is None or at is None or s.prompt_keys[at // page - 1] in \
                    self.prefix.snapshots:
                continue
            slot = self.prefix.reserve_snapshot(keep)
            if slot is None:
                break
            snapshots.append((s, slot, at // page))
        return restores, snapshots

    def prefix_snapshot(self) -> PrefixCacheSnapshot | None:
        """The prefix cache's figures (None: prefix caching is off)."""
        c = self.prefix
        if c is None:
            return None
        st = c.stats
        return PrefixCacheSnapshot(
            st.queries, st.query_tokens, st.hits, st.hit_tokens, c.num_cached_pages,
            c.num_snapshots, c.num_snapshot_slots,
            state_slot_bytes(self.target_config, self.cfg.torch_dtype)
            if self.target_config.linear_attention_layers else 0,
            st.page_evictions, st.snapshot_evictions, len(c.boundary_slots))

    def _enter_pages(self, seq: Sequence, accepted: list[int] = ()) -> None:
        """The sequence's pages that are full and committed since it last entered some go into
        the prefix cache, keyed by the tokens they hold (prompt, then output: the round's
        accepted drafts, `accepted`, are committed but not appended yet)."""
        if self.prefix is None:
            return
        page, first = self.cfg.page_size, len(seq.page_keys)
        full = seq.num_cached // page
        if full <= first:
            return
        if seq.prompt_keys is None:
            seq.prompt_keys = page_keys(seq.prompt_ids, page)
        keys = seq.prompt_keys[first:full]
        if len(seq.page_keys) + len(keys) < full:  # pages past the prompt: its output's
            known = first + len(keys)
            parent = keys[-1] if keys else seq.page_keys[-1] if seq.page_keys else b""
            keys = keys + page_keys(_tokens(seq, accepted, known * page, full * page), page,
                                    parent)
        self.prefix.enter_pages(keys, seq.block_table[first:full])
        seq.page_keys += keys

    def _apply_deferred_aborts(self) -> None:
        aborts, self._deferred_aborts = self._deferred_aborts, []
        for request_id in aborts:
            self.abort(request_id)

    def _fail(self, seq: Sequence, error: str) -> None:
        """The step failed for this sequence alone (its sampling): it ends with finish reason
        "error" and the reason; the others go on."""
        log.error("request %s failed in step %d: %s", seq.request_id, self.num_steps - 1, error)
        seq.error = error
        self.scheduler.finish(seq, "error")

    def _append(self, seq: Sequence, tokens: list[int],
                logprobs: list[TokenLogprob] | None = None) -> int:
        """Appends tokens (and their log-probabilities) up to the first stop condition;
        returns how many were kept."""
        p = seq.params
        kept = len(tokens)
        for i, tok in enumerate(tokens):
            seq.output_ids.append(tok)
            # a grammar's end (its end token) stops the sequence even with ignore_eos
            if (tok in self.eos_ids and (not p.ignore_eos or p.grammar is not None)) \
                    or tok in p.stop_token_ids:
                self.scheduler.finish(seq, "stop")
            elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
                self.scheduler.finish(seq, "length")
            if seq.finished:
                kept = i + 1
                break
        if logprobs is not None:
            seq.logprobs += logprobs[:kept]
        return kept

    def _release(self, seq: Sequence) -> None:
        forget = getattr(self.draft_length, "forget", None)
        if forget is not None:
            forget(seq.seq_id)
        if seq.seq_id in self._sent:
            self._sent.discard(seq.seq_id)
            self._released.append(seq.seq_id)

    def _collect(self, seqs: list[Sequence]) -> list[RequestOutput]:
        outs = []
        for s in seqs:
            new = s.output_ids[s.num_streamed :]
            if not new and not s.finished:
                continue  # a non-final prompt chunk: nothing to report yet
            p, first = s.params, s.num_streamed == 0
            outs.append(RequestOutput(
                s.request_id, s.prompt_ids, new, list(s.output_ids), s.finished,
                s.finish_reason, list(s.acceptance_lengths), s.error,
                new_logprobs=None if p.logprobs is None else s.logprobs[s.num_streamed :],
                prompt_logprobs=[None, *s.prompt_logprobs]
                if first and p.prompt_logprobs is not None else None,
                num_cached_tokens=s.num_cached_tokens))
            s.num_streamed = len(s.output_ids)
            if s.finished:
                self._release(s)
                self._by_request.pop(s.request_id, None)
        return outs

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams]) -> list[RequestOutput]:
        """Runs the requests to the end: their final outputs, whose new_logprobs (if asked
        for) cover every output token and prompt_logprobs the prompt."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list, strict=True)]
        final: dict[str, RequestOutput] = {}
        logprobs: dict[str, list[TokenLogprob]] = {}
        prompt_logprobs: dict[str, list[TokenLogprob | None]] = {}
        while self.has_unfinished():
            for out in self.step():
                logprobs.setdefault(out.request_id, []).extend(out.new_logprobs or [])
                if out.prompt_logprobs is not None:
                    prompt_logprobs[out.request_id] = out.prompt_logprobs
                if out.finished:
                    final[out.request_id] = out
        return [replace(final[i], new_logprobs=logprobs[i] if p.logprobs is not None else None,
                        prompt_logprobs=prompt_logprobs.get(i))
                for i, p in zip(ids, params_list, strict=True)]

    # ---- start-up -----------------------------------------------------------------------------

    def warm_up(self) -> None:
        """Runs what a first request meets, so it does not pay for compilation and capture:
        a prompt fed in two chunks (on a GPU the first one of a full prefill budget) with its
        draft context writes, rounds with proposals; with CUDA graphs also a round at every
        batch bucket the graphs capture. Leaves the statistics as they were."""
        stats = (self.stats, self.draft_time, self.verify_time, self.step_time)
        t, first_step, requests = time.perf_counter(), self.num_steps, 0
        on_gpu = self.cfg.device.startswith("cuda")
        page_size, budget = self.cfg.page_size, self.scheduler.max_num_batched_tokens
        params = SamplingParams(max_tokens=2 * self.block_size + 1, ignore_eos=True)
        room = self.max_model_len - params.max_tokens - self.block_size
        prompt_len = min(budget + page_size if on_gpu else 2 * page_size + 3, room)
        if prompt_len < 2:
            return
        chunk = budget if prompt_len > budget else -(-prompt_len // 2)
        vocab = self.target_config.vocab_size
        self.scheduler.max_num_batched_tokens = chunk  # two prefill steps
        try:
            requests += self._warm([[i % vocab for i in range(1, prompt_len + 1)]], params)
        finally:
            self.scheduler.max_num_batched_tokens = budget
        if on_gpu and not self.cfg.enforce_eager:
            for n in graph_batch_buckets(self.cfg.max_num_seqs):
                requests += self._warm([[(1 + i) % vocab] * page_size for i in range(n)],
                                       params)
        if self.has_draft and self.cfg.speculative_adaptive:
            self._start_adaptive(on_gpu and not self.cfg.enforce_eager)
        self.stats, self.draft_time, self.verify_time, self.step_time = stats
        if self.prefix is not None:  # its entries stay (harmless), its counts start now
            self.prefix.stats = PrefixCacheStats()
        self.warmup = {"requests": requests, "steps": self.num_steps - first_step,
                       "seconds": time.perf_counter() - t}

    def _start_adaptive(self, graphs: bool) -> None:
        """Measures a round's cost at each draft length the rule may pick, at every batch
        bucket of the CUDA graphs (capturing their shapes) or, eagerly, at 1 and
        max_num_seqs sequences; then lets the rule pick (cluster/speculation.py)."""
        sizes = graph_batch_buckets(self.cfg.max_num_seqs) if graphs \
            else sorted({1, self.cfg.max_num_seqs})
        params = SamplingParams(max_tokens=COST_ROUND_TOKENS, ignore_eos=True)
        reach = self.scheduler.reach(Sequence(-1, "", [0] * self.cfg.page_size, params))
        sizes = [n for n in sizes if n * self.blocks.pages_needed(reach) <= self.blocks.num_pages]
        if not sizes:
            log.warning("adaptive speculation off: the KV pool cannot hold a round to time")
            return
        t = time.perf_counter()
        self._fresh_stats()
        costs = measure_round_costs(self._round_times, sizes, self.block_size)
        self.draft_length = AdaptiveDraftLength(costs, self.block_size)
        log.info("adaptive speculation: round ms by drafts at batch %s: %s (measured in %.1f s)",
                 "/".join(map(str, sizes)), "; ".join(
                     f"{k}: " + "/".join(f"{1e3 * x:.2f}" for x in costs.seconds[k])
                     for k in sorted(costs.seconds)), time.perf_counter() - t)

    def _round_times(self, batch: int, drafts: int) -> list[float]:
        """Wall seconds of the rounds of `batch` page-long prompts drafting `drafts` tokens
        each round, but the first two (a new shape's CUDA graph is captured there)."""
        vocab, page = self.target_config.vocab_size, self.cfg.page_size
        params = SamplingParams(max_tokens=COST_ROUND_TOKENS, ignore_eos=True)
        chosen, self.draft_length = self.draft_length, lambda seqs: drafts
        times = []
        try:
            for i in range(batch):
                self.add_request([(7 + i) % vocab] * page, params)
            while self.has_unfinished():
                t = time.perf_counter()
                if not self.begin_step():
                    break
                rounds = bool(self._in_flight.decode)
                self.finish_step()
                if rounds:
                    times.append(time.perf_counter() - t)
        finally:
            self.draft_length = chosen
        return times[2:] or times

    def _warm(self, prompts: list[list[int]], params: SamplingParams) -> int:
        reach = self.scheduler.reach(Sequence(-1, "", prompts[0], params))
        if self.blocks.pages_needed(reach) > self.blocks.num_pages:
            return 0  # a pool too small for the warm-up: the first request compiles instead
        self._fresh_stats()
        self.generate(prompts, params)
        return len(prompts)

    def _fresh_stats(self) -> None:
        """New statistics, for start-up's own requests (warm_up puts the old ones back)."""
        self.stats, self.draft_time = AcceptanceStats(), TimeAccumulator()
        self.verify_time = TimeAccumulator()
        self.step_time = {"round": TimeAccumulator(), "prefill": TimeAccumulator()}

    def _next_step_id(self) -> int:
        self.num_steps += 1
        return self.num_steps - 1


def _tokens(seq: Sequence, accepted: list[int], lo: int, hi: int) -> list[int]:
    """The sequence's tokens at positions lo … hi − 1 (prompt, output, then `accepted`), without
    building the whole list: a round asks for a page's worth of a long context."""
    n_prompt, n_out = len(seq.prompt_ids), len(seq.output_ids)
    out = seq.prompt_ids[lo:hi] if lo < n_prompt else []
    a, b = max(lo - n_prompt, 0), hi - n_prompt
    if b > 0:
        out += seq.output_ids[a:b] + list(accepted)[max(a - n_out, 0):max(b - n_out, 0)]
    return out
