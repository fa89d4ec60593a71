"""Where batches become tensors: the target forward for prefill and verify, acceptance, and the
commit of the accepted prefix (KV stays, GDN state is replayed). One per TP rank."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from configs.engine import SamplingParams
from target.batch import ForwardBatch, TargetCaches
from target.model import Qwen3_5MoeForCausalLM
from workers import sampling
from workers.cache import reset_state_slot
from workers.controls import SeqControls
from workers.cuda_graphs import RoundGraphs
from workers.logit_controls import ControlRows, apply_controls
from workers.logprobs import TokenLogprob, rows_logprobs, split_rows, token_logprobs
from workers.messages import host_tables


@dataclass(frozen=True)
class SeqInput:
    """One sequence's part of a forward; crosses the driver → worker boundary."""

    seq_id: int
    token_ids: list[int]  # prefill: a chunk of the prompt; verify: [anchor, d1 … dK]
    start_pos: int  # position of token_ids[0]; positions below it are cached
    block_table: list[int]
    state_slot: int
    params: SamplingParams
    # Prefill: sample the first token after this chunk (the prompt's last); a non-final chunk
    # only fills the caches and yields its aux features.
    sample: bool = True
    # PREFILL with prompt logprobs: the prompt tokens this chunk's rows predict,
    # prompt[start_pos + 1 : start_pos + n + 1] (the last chunk's last row samples instead).
    prompt_targets: list[int] | None = None
    # block_table as an int32 tensor where the caller keeps one (workers/stepper.py SeqTable)
    block_table_t: torch.Tensor | None = None
    # the sampling controls' state in this process (params.has_controls; workers/controls.py)
    controls: SeqControls | None = None
    # verify: the state slot that receives the sequence's state at each page boundary its
    # committed tokens reach up to tap_end (the prefix cache's boundary slot; its prompt and
    # max_tokens: gdn_slots.Taps); −1: none
    tap_slot: int = -1
    tap_end: int = 0
    # prefill: (snapshot slot, position): the sequence's state after that position of its
    # chunk (start_pos < position ≤ its end) is copied into the slot (the prefix cache's)
    snapshot: tuple[int, int] | None = None


@dataclass
class StepOutput:
    """Per sequence: tokens this forward produced (accepted drafts + bonus, or the first token)
    and the aux features of the tokens it committed to the cache, for the draft context."""

    new_tokens: list[list[int]]
    num_accepted: list[int]  # accepted draft tokens (0 for prefill)
    num_committed: list[int]  # tokens entered into the cache (prompt, or anchor + accepted)
    aux: torch.Tensor | None  # [sum committed, n_aux·H], sequences concatenated
    aux_positions: torch.Tensor  # [sum committed] their positions
    # index in the step → why that sequence's sampling failed: it fails alone (no tokens;
    # a round commits its anchor only), the others' results stand
    errors: dict[int, str] = field(default_factory=dict)
    # index → its new tokens' log-probabilities (sequences that asked: params.logprobs)
    logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)
    # index → log-probabilities of the prompt tokens its chunk's rows predict (prompt_targets)
    prompt_logprobs: dict[int, list[TokenLogprob]] = field(default_factory=dict)


def describe(error: Exception) -> str:
    return f"{type(error).__name__}: {error}"


class ModelRunner:
    def __init__(self, model: Qwen3_5MoeForCausalLM, caches: TargetCaches,
                 aux_layer_ids: tuple[int, ...], device: torch.device | str, seed: int = 0,
                 graphs: RoundGraphs | None = None):
        self.model = model
        self.graphs = graphs
        self.caches = caches
        self.aux_layer_ids = aux_layer_ids
        self.device = torch.device(device)
        self.page_size = caches.page_size
        self.generators: dict[int, torch.Generator] = {}
        self._seed_source = torch.Generator().manual_seed(seed)
        # pinned host buffers the acceptance reads back into, by shape: allocated once, not
        # every step (each step waits for its read before the next can reuse the buffer)
        self._pinned: dict[tuple[int, ...], torch.Tensor] = {}

    def _generator(self, seq: SeqInput) -> torch.Generator | None:
        if seq.params.greedy:
            return None
        if seq.seq_id not in self.generators:
            seed = seq.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_source).item())
            self.generators[seq.seq_id] = torch.Generator().manual_seed(seed)
        return self.generators[seq.seq_id]

    def release(self, seq_id: int) -> None:
        self.generators.pop(seq_id, None)

    def _host_inputs(self, seqs: list[SeqInput]) -> dict[str, torch.Tensor]:
        # Built with CPU tensor ops, not per-token Python (a prefill step holds thousands of
        # tokens); copied to the device once per tensor.
        page_size = self.page_size
        tables = torch.from_numpy(host_tables(
            [s.block_table if s.block_table_t is None else s.block_table_t for s in seqs],
            max(len(s.block_table) for s in seqs)))
        lens = torch.tensor([len(s.token_ids) for s in seqs])
        seq_of = torch.repeat_interleave(torch.arange(len(seqs)), lens)  # [T]
        first = torch.cumsum(lens, 0) - lens  # [S] index of each sequence's first token
        starts = torch.tensor([s.start_pos for s in seqs])
        pos = starts[seq_of] + torch.arange(int(lens.sum())) - first[seq_of]  # [T]
        return {
            "input_ids": torch.tensor([t for s in seqs for t in s.token_ids], dtype=torch.long),
            "positions": pos,
            "slot_mapping": (tables[seq_of, pos // page_size].long() * page_size
                             + pos % page_size),
            "block_tables": tables,
            "seq_lens": starts + lens,
            "state_slots": torch.tensor([s.state_slot for s in seqs]),
        }

    def _batch(self, seqs: list[SeqInput], is_verify: bool) -> ForwardBatch:
        host = self._host_inputs(seqs)
        dev = {name: t.to(self.device) for name, t in host.items()}
        return ForwardBatch(
            input_ids=dev["input_ids"], positions=dev["positions"],
            query_lens=[len(s.token_ids) for s in seqs],
            seq_lens=[s.start_pos + len(s.token_ids) for s in seqs],
            slot_mapping=dev["slot_mapping"], block_tables=dev["block_tables"],
            state_slots=[s.state_slot for s in seqs], is_verify=[is_verify] * len(seqs),
            aux_layer_ids=self.aux_layer_ids, seq_lens_t=dev["seq_lens"],
            state_slots_t=dev["state_slots"],
            snapshots={i: (s.snapshot[0], s.snapshot[1] - s.start_pos)
                       for i, s in enumerate(seqs) if s.snapshot is not None},
        )

    @torch.inference_mode()
    def copy_states(self, pairs: list[tuple[int, int]]) -> None:
        """Each (from slot, to slot): every linear-attention layer's conv and recurrent state
        copied, on the device in stream order (the prefix cache's snapshots and restores)."""
        if not pairs or not self.caches.ssm:
            return
        dev = next(iter(self.caches.ssm.values())).device
        src = torch.tensor([a for a, _ in pairs], device=dev)
        dst = torch.tensor([b for _, b in pairs], device=dev)
        for t in (*self.caches.conv.values(), *self.caches.ssm.values()):
            t.index_copy_(0, dst, t.index_select(0, src))

    @torch.inference_mode()
    def prefill(self, seqs: list[SeqInput]) -> StepOutput:
        """Each seq's token_ids = prompt_ids[start_pos : start_pos + n]. A chunk with
        start_pos > 0 attends over the KV pages and continues from the GDN state of the chunks
        before it, so only a prompt's first chunk resets its state slot."""
        for s in seqs:
            if s.start_pos == 0:
                reset_state_slot(self.caches, s.state_slot)
        batch = self._batch(seqs, is_verify=False)
        hidden, aux = self.model(batch, self.caches)
        sampled = [i for i, s in enumerate(seqs) if s.sample]
        new_tokens: list[list[int]] = [[] for _ in seqs]
        errors: dict[int, str] = {}
        logprobs = {}
        if sampled:
            cu = batch.cu_seqlens
            last = torch.tensor([cu[i + 1] - 1 for i in sampled], device=hidden.device)
            raw = self.model.compute_logits(hidden[last])  # [len(sampled), V]
            logits = self._controlled(seqs, raw, [(i, r, []) for r, i in enumerate(sampled)],
                                      errors)
            # Greedy rows take the argmax, the others an inverse-CDF sample with a uniform from
            # their own generator; all read back with one host sync.
            tokens = logits.argmax(-1)  # [len(sampled)]
            rows, probs, u = [], [], []
            for r, i in enumerate(sampled):
                if seqs[i].params.greedy or i in errors:
                    continue
                try:  # a sequence whose sampling fails fails alone
                    probs.append(sampling.probs_from_logits(logits[r : r + 1], seqs[i].params))
                    u.append(torch.rand(1, generator=self._generator(seqs[i])))
                    rows.append(r)
                except Exception as e:
                    errors[i] = describe(e)
            if rows:
                picked = torch.tensor(rows, device=tokens.device)
                probs_t = torch.cat(probs)
                tokens[picked] = sampling.sample_from(probs_t, torch.cat(u).to(probs_t.device))
            for row, tok in enumerate(tokens.tolist()):
                if sampled[row] not in errors:
                    new_tokens[sampled[row]] = [tok]
            rows = [r for r, i in enumerate(sampled) if i not in errors]
            logprobs = self._logprobs(seqs, [sampled[r] for r in rows],
                                      [raw[r : r + 1] for r in rows],
                                      [new_tokens[sampled[r]] for r in rows])
        prompt = {}
        for i, s in enumerate(seqs):
            if s.prompt_targets:
                lo = batch.cu_seqlens[i]
                prompt[i] = rows_logprobs(self.model.compute_logits,
                                          hidden[lo : lo + len(s.prompt_targets)],
                                          s.prompt_targets, s.params.prompt_logprobs or 0)
        return StepOutput(new_tokens, [0] * len(seqs), batch.query_lens, aux, batch.positions,
                          errors, logprobs, prompt)

    @staticmethod
    def _controlled(seqs: list[SeqInput], logits: torch.Tensor,
                    blocks: list[tuple[int, int, list[int]]], errors: dict[int, str]
                    ) -> torch.Tensor:
        """logits with the sampling controls of the sequences that have them applied (a copy
        where some of those also report log-probabilities, which are the raw logits', as
        vLLM's default raw_logprobs); blocks: (index in seqs, first row, the block's tokens).
        A sequence whose controls fail goes to `errors`."""
        rows = [ControlRows(i, seqs[i].controls, first, block) for i, first, block in blocks
                if seqs[i].params.has_controls and seqs[i].controls is not None]
        for i, _, _ in blocks:
            if seqs[i].params.has_controls and seqs[i].controls is None:
                errors[i] = "RuntimeError: this engine was built without sampling controls"
        if not rows:
            return logits
        if any(seqs[r.index].params.logprobs is not None for r in rows):
            logits = logits.clone()
        errors.update(apply_controls(logits, rows))
        return logits

    @staticmethod
    def _logprobs(seqs: list[SeqInput], idx: list[int], logits: list[torch.Tensor],
                  tokens: list[list[int]]) -> dict[int, list[TokenLogprob]]:
        """Per sequence idx[j]: its tokens[j] drawn from logits[j] rows, for the sequences that
        asked for log-probabilities; one pass and one host read for all of them."""
        want = [j for j, i in enumerate(idx) if seqs[i].params.logprobs is not None
                and tokens[j]]
        if not want:
            return {}
        tops = [seqs[idx[j]].params.logprobs for j in want]
        flat = token_logprobs(torch.cat([logits[j][: len(tokens[j])] for j in want]),
                              [t for j in want for t in tokens[j]], max(tops))
        parts = split_rows(flat, [len(tokens[j]) for j in want], tops)
        return {idx[j]: part for j, part in zip(want, parts, strict=True)}

    def _pinned_like(self, t: torch.Tensor) -> torch.Tensor:
        host = self._pinned.get(tuple(t.shape))
        if host is None or host.dtype != t.dtype:
            host = self._pinned[tuple(t.shape)] = torch.empty(t.shape, dtype=t.dtype,
                                                              pin_memory=True)
        return host

    def _accept_greedy(self, seqs: list[SeqInput], batch: ForwardBatch, logits: torch.Tensor,
                       commit: Callable[[torch.Tensor], None] | None = None
                       ) -> dict[int, tuple[int, int]]:
        """Greedy acceptance of every greedy sequence at once, read back with one host sync;
        {index in seqs: (accepted, bonus)}. Rounds verify B tokens for every sequence, so the
        blocks stack; a batch of mixed lengths leaves the rest to the per-sequence path. With
        `commit` (every sequence greedy), the kept counts go to it as a device tensor: the
        GPU moves on to the commit without waiting for the host, and (CUDA) the host waits
        only for the acceptance's read-back, queued before the commit, not for the commit."""
        idx = [i for i, s in enumerate(seqs) if s.params.greedy]
        if not idx or len({len(seqs[i].token_ids) for i in idx}) != 1:
            return {}
        width, cu = len(seqs[idx[0]].token_ids), batch.cu_seqlens
        if len(idx) == len(seqs):  # the usual round: the blocks are the rows, as a view
            rows = len(seqs) * width  # (a captured round has padding rows after them)
            ids = batch.input_ids[:rows].view(len(seqs), width)
            block_logits = logits[:rows].view(len(seqs), width, -1)
        else:
            rows = torch.tensor([cu[i] for i in idx], device=logits.device)[:, None] + \
                torch.arange(width, device=logits.device)  # [S, B]
            ids, block_logits = batch.input_ids[rows], logits[rows]
        # ids [S, B]: the anchor, then the drafts
        n, bonus = sampling.accept_greedy_batch(ids[:, 1:], block_logits)
        decided = torch.stack([n, bonus], 1)
        if commit is not None and len(idx) == len(seqs):
            if decided.is_cuda:  # read back before the commit is queued: waited for alone
                host = self._pinned_like(decided)
                host.copy_(decided, non_blocking=True)
                read = torch.cuda.Event()
                read.record()
                commit(n + 1)
                read.synchronize()
                decided = host
            else:
                commit(n + 1)
        pairs = decided.tolist()
        return {i: (a, b) for i, (a, b) in zip(idx, pairs, strict=True)}

    def _accept_sampled(self, seqs: list[SeqInput], batch: ForwardBatch, logits: torch.Tensor,
                        errors: dict[int, str]) -> dict[int, tuple[int, int]]:
        """Rejection sampling of every sampled sequence at once on the device (each with its
        own temperature/top-k/top-p, its uniforms from its own generator), one host sync. A
        sequence whose probabilities fail goes to `errors` and the rest go on as before."""
        idx = [i for i, s in enumerate(seqs) if not s.params.greedy and i not in errors]
        if not idx or len({len(seqs[i].token_ids) for i in idx}) != 1:
            return {}
        width, cu = len(seqs[idx[0]].token_ids), batch.cu_seqlens
        rows = []
        for i in idx:
            try:
                rows.append(sampling.probs_from_logits(logits[cu[i] : cu[i] + width],
                                                       seqs[i].params))
            except Exception as e:
                errors[i] = describe(e)
        idx = [i for i in idx if i not in errors]
        if not idx:
            return {}
        probs = torch.stack(rows)
        u = torch.stack([torch.rand(width, generator=self._generator(seqs[i])) for i in idx])
        drafts = torch.stack([batch.input_ids[cu[i] + 1 : cu[i] + width] for i in idx])
        n, token = sampling.accept_sampling_batch(drafts, probs, u.to(probs.device))
        pairs = torch.stack([n, token], 1).tolist()
        return {i: (a, b) for i, (a, b) in zip(idx, pairs, strict=True)}

    @torch.inference_mode()
    def verify(self, seqs: list[SeqInput]) -> StepOutput:
        """Each seq's token_ids = [anchor, d1 … dK]. Accept, then commit anchor + accepted. A
        uniform round replays CUDA graphs where the runner has them (workers/cuda_graphs.py);
        their outputs are padded past the real sequences, which are read by index."""
        width = len(seqs[0].token_ids)
        # greedy acceptance alone reads only argmaxes: logits in the model's dtype do (masks
        # too; the bias and penalties compute in fp32, as vLLM's)
        fp32 = any(not s.params.greedy or s.params.logprobs is not None or s.params.has_penalties
                   or s.params.logit_bias for s in seqs)
        graphs, captured = self.graphs, None
        if graphs is not None and all(len(s.token_ids) == width for s in seqs) and graphs.fits(
                len(seqs), width, max(len(s.block_table) for s in seqs)):
            captured = graphs.forward(seqs, width)
        if captured is not None:
            hidden, aux, batch = captured
            logits = self.model.compute_logits(hidden[: sum(len(s.token_ids) for s in seqs)],
                                               fp32)
            commit = graphs.commit
        else:
            batch = self._batch(seqs, True)
            hidden, aux = self.model(batch, self.caches)
            logits = self.model.compute_logits(hidden, fp32)  # [T, V]
            taps = (None, None)
            if any(s.tap_slot >= 0 for s in seqs):
                taps = (torch.tensor([s.tap_slot for s in seqs], device=batch.positions.device),
                        torch.tensor([s.tap_end for s in seqs], device=batch.positions.device))

            def commit(num_kept: list[int]) -> None:
                self.model.commit_verify(batch, self.caches, num_kept, *taps)
        if width == 1:  # a decode committed in its forward: a boundary it reached is copied
            page = self.page_size
            self.copy_states([(s.state_slot, s.tap_slot) for s in seqs if s.tap_slot >= 0
                              and (s.start_pos + 1) % page == 0 and s.start_pos < s.tap_end])
        cu = batch.cu_seqlens
        errors: dict[int, str] = {}
        raw, logits = logits, self._controlled(
            seqs, logits, [(i, cu[i], s.token_ids) for i, s in enumerate(seqs)], errors)
        committed_early: list[torch.Tensor] = []
        early_rows: list[tuple[torch.Tensor, torch.Tensor]] = []

        def commit_early(kept: torch.Tensor) -> None:
            graphs.commit(kept)
            committed_early.append(kept)
            # the committed rows' aux features and positions, gathered on the device while
            # the host waits for the acceptance: after it only a slice is left to take
            early_rows.append(committed_rows(kept, width, aux, batch.positions))

        decided = self._accept_greedy(seqs, batch, logits,
                                      commit_early if captured is not None else None)
        decided.update(self._accept_sampled(seqs, batch, logits, errors))
        new_tokens, num_accepted, kept_rows = [], [], []
        for i, s in enumerate(seqs):
            n, bonus = decided.get(i, (0, None))
            if i not in decided and i not in errors:
                block_logits = logits[cu[i] : cu[i + 1]]
                draft = batch.input_ids[cu[i] + 1 : cu[i + 1]]
                try:
                    if s.params.greedy:
                        n, bonus = sampling.accept_greedy(draft, block_logits)
                    else:
                        n, bonus = sampling.accept_sampling(draft, block_logits, s.params,
                                                            self._generator(s))
                except Exception as e:  # it fails alone
                    errors[i] = describe(e)
            # a failed sequence commits its anchor only and reports no tokens
            new_tokens.append([] if i in errors else s.token_ids[1 : n + 1] + [bonus])
            num_accepted.append(n)
            kept_rows.extend(range(cu[i], cu[i] + n + 1))
        if not committed_early:
            commit([n + 1 for n in num_accepted])
        if early_rows:  # every sequence kept n + 1 rows of its block, in order
            early_aux, early_positions = early_rows[0]
            aux_rows = early_aux[: len(kept_rows)]
            aux_positions = early_positions[: len(kept_rows)]
        else:
            rows = torch.tensor(kept_rows)
            if aux.is_cuda:  # from pinned memory the copy is queued, not waited for: the host
                # goes on (the draft's context write, the engine's bookkeeping) while the
                # commit runs
                rows = rows.pin_memory().to(aux.device, non_blocking=True)
            aux_rows, aux_positions = aux[rows], batch.positions[rows]
        committed = [n + 1 for n in num_accepted]
        # token j of a sequence's new ones was drawn from its block's row j
        logprobs = self._logprobs(seqs, list(range(len(seqs))),
                                  [raw[cu[i] : cu[i + 1]] for i in range(len(seqs))],
                                  new_tokens) if any(s.params.logprobs is not None
                                                     for s in seqs) else {}
        return StepOutput(new_tokens, num_accepted, committed, aux_rows, aux_positions,
                          errors, logprobs)


def committed_rows(kept: torch.Tensor, width: int, aux: torch.Tensor, positions: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of S uniform blocks of `width` that a round commits, sequence by sequence, with
    no host value: kept [S] (device) rows at the head of each block. Returns aux and positions
    [S·width] whose first sum(kept) rows are the committed ones in order (the rest: the
    others). Every row is its own copy, not the graph's output, which the next replay
    overwrites."""
    n_rows = kept.shape[0] * width
    if width == 1:  # a decode step commits every row
        return aux[:n_rows].clone(), positions[:n_rows].clone()
    keep = torch.arange(width, device=kept.device) < kept[:, None]  # [S, W]
    # kept rows first (stable: in block order), then the rest
    order = torch.argsort(keep.flatten().logical_not().int(), stable=True)
    return aux[:n_rows][order], positions[:n_rows][order]
