"""The sampling controls that change a sequence's logits before its token is picked: structured
outputs' grammars, allowed_token_ids, bad_words, min_tokens, logit_bias and the three
penalties, with vLLM's semantics and in vLLM's order (masks, then the bias, then the
penalties; temperature, min_p, top-k and top-p come after, in workers/sampling.py).

Each process that picks tokens keeps a `SeqControls` per controlled sequence (every TP rank
runs the same acceptance, so each keeps its own, fed the same tokens), advanced only by the
tokens a step commits. A verify block's row j predicts the token after the anchor and the
drafts d1..dj: its controls see the committed state plus those drafts (the grammar walked
through them, the penalties' counts with them), so each row is what plain decoding would
have seen at that position, and speculative output equals plain decoding's.

Masks are token bitmasks (bit t % 32 of int32 word t // 32 allows token t), built on the host
into one pinned buffer while the device runs the forward, copied once and applied by one
pass; the bias and penalties are a few device ops for all controlled rows together."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from configs.engine import SamplingParams
from workers.grammar import GrammarError, Grammars, bitmask_words

log = logging.getLogger(__name__)


class ControlsEnv:
    """What one process needs to build controls: the logits' width, the device, and (for
    grammars, made on first use) the tokenizer, whose grammars compile on a thread of their
    own beside the step."""

    def __init__(self, vocab_size: int, device: torch.device | str,
                 tokenizer_dir: str | None = None):
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.tokenizer_dir = tokenizer_dir
        self._grammars: Grammars | None = None
        self._pool: ThreadPoolExecutor | None = None
        # the step's thread and the compile thread may both ask first: one builds
        self._lock = threading.Lock()

    @classmethod
    def for_checkpoint(cls, model_dir: str, vocab_size: int,
                       device: torch.device | str) -> ControlsEnv:
        """Grammars from the checkpoint's tokenizer, where it ships one."""
        d = Path(model_dir)
        has_tokenizer = (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()
        return cls(vocab_size, device, str(d) if has_tokenizer else None)

    def grammars(self) -> Grammars:
        with self._lock:
            if self._grammars is None:
                if self.tokenizer_dir is None:
                    raise GrammarError("structured outputs need the model's tokenizer; this "
                                       "checkpoint ships none")
                from transformers import AutoTokenizer

                tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
                self._grammars = Grammars(tokenizer, self.vocab_size)
            return self._grammars

    def compile_later(self, params: SamplingParams) -> Future:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="grammar-compile")
        return self._pool.submit(lambda: self.grammars().compile(params.grammar))


class SeqControls:
    """One sequence's controls in one process. `eos_ids`: the engine's end-of-sequence ids."""

    def __init__(self, env: ControlsEnv, params: SamplingParams, prompt_ids: list[int],
                 eos_ids: tuple[int, ...], penalties: bool = True):
        self.params = params
        v, device = env.vocab_size, env.device
        # what min_tokens holds back; a grammar's end stops the sequence even with ignore_eos
        self.end_ids = sorted((set() if params.ignore_eos else set(eos_ids))
                              | set(params.stop_token_ids))
        self.grammar_end_ids = sorted(set(eos_ids) | set(params.stop_token_ids))
        self.generated: list[int] = []
        self.static_mask: np.ndarray | None = None  # [words] allowed ∧ ¬(one-token bad words)
        if params.allowed_token_ids is not None or any(
                len(w) == 1 for w in params.bad_words_token_ids):
            allowed = np.ones(v, bool)
            if params.allowed_token_ids is not None:
                allowed[:] = False
                allowed[list(params.allowed_token_ids)] = True
            allowed[[w[0] for w in params.bad_words_token_ids if len(w) == 1]] = False
            self.static_mask = pack_bits(allowed[None])[0]
        self.long_bad_words = [w for w in params.bad_words_token_ids if len(w) > 1]
        self.counts: torch.Tensor | None = None  # [V] int32 generated-token counts
        self.in_prompt: torch.Tensor | None = None  # [V] bool (repetition_penalty)
        if params.has_penalties and penalties:
            self.counts = torch.zeros(v, dtype=torch.int32, device=device)
            if params.repetition_penalty != 1:
                self.in_prompt = torch.zeros(v, dtype=torch.bool, device=device)
                self.in_prompt[_device_tensor(prompt_ids, torch.long, device)] = True
        self._env = env
        self._compiled: Future | None = None
        self._matcher = None
        if params.grammar is not None:
            self._compiled = env.compile_later(params)

    @property
    def masks(self) -> bool:
        return (self._compiled is not None or self.static_mask is not None
                or bool(self.long_bad_words) or len(self.generated) < self.params.min_tokens)

    def matcher(self):
        """The grammar's matcher (waits for its compile); GrammarError if it did not."""
        if self._matcher is None and self._compiled is not None:
            compiled = self._compiled.result()  # (the compile thread built the Grammars)
            self._matcher = self._env.grammars().matcher(compiled, self.grammar_end_ids)
        return self._matcher

    def fill_masks(self, block: list[int], out: torch.Tensor) -> None:
        """out [len(block) or 1, words] int32, all ones on entry: row j's mask after the
        anchor and drafts d1..dj (block = [anchor, d1 … dK]; [] for a prefill's one row)."""
        n_rows = out.shape[0]
        matcher = self.matcher()
        if matcher is not None and not matcher.is_terminated():
            if n_rows == 1:
                matcher.fill_next_token_bitmask(out, 0)
            else:  # the draft chain as a tree: node j's child is j + 1 (node 0: the anchor)
                nxt = torch.arange(1, n_rows + 1)
                nxt[-1] = -1
                matcher.traverse_draft_tree(nxt, torch.full((n_rows,), -1),
                                            torch.tensor(block, dtype=torch.long), out)
        words = out.numpy()
        if self.static_mask is not None:
            words &= self.static_mask
        for j in range(n_rows):
            done = len(self.generated) + j  # tokens generated before row j's
            banned = list(self.end_ids) if done < self.params.min_tokens else []
            if self.long_bad_words:
                past = self.generated + block[1 : j + 1]
                banned += [w[-1] for w in self.long_bad_words
                           if len(past) >= len(w) - 1 and past[len(past) - len(w) + 1 :] ==
                           list(w[:-1])]
            if banned:
                clear_bits(words[j], banned)

    def commit(self, tokens: list[int]) -> None:
        """The step's committed tokens for this sequence (accepted drafts and the bonus, or a
        prefill's first token). GrammarError if the grammar refuses one: no token was left
        allowed (the grammar and allowed_token_ids/bad_words exclude each other)."""
        if not tokens:
            return
        self.generated += tokens
        if self.counts is not None:
            dev = self.counts.device
            self.counts.index_put_((_device_tensor(tokens, torch.long, dev),),
                                   torch.ones(len(tokens), dtype=torch.int32, device=dev),
                                   accumulate=True)
        matcher = self.matcher()
        if matcher is not None:
            for t in tokens:
                if matcher.is_terminated():
                    break  # the engine ends the sequence at the grammar's end token
                if not matcher.accept_token(t):
                    raise GrammarError(f"token {t} does not continue the structured output: "
                                       f"the constraints leave no token allowed")

    def allows(self, token: int) -> bool:
        """The static mask's verdict (allowed_token_ids, one-token bad words)."""
        m = self.static_mask
        return m is None or bool((int(m[token // 32]) >> (token % 32)) & 1)

    def constrain_proposal(self, candidates: list[list[int]]) -> list[int]:
        """The draft's proposal under the grammar: candidates [B − 1][k], each position's
        best tokens first → at each position the best candidate the grammar (and the static
        mask) allows after the ones picked before it. Where none is allowed the rest are the
        top candidates unchanged (the target rejects there anyway). The matcher ends where it
        began."""
        try:
            matcher = self.matcher()
        except GrammarError:
            matcher = None
        out: list[int] = []
        walked = 0
        for j, cands in enumerate(candidates):
            pick = None
            if matcher is not None and not matcher.is_terminated():
                pick = next((t for t in cands if self.allows(t) and matcher.accept_token(t)),
                            None)
            if pick is None:
                out += [c[0] for c in candidates[j:]]
                break
            out.append(pick)
            walked += 1
        if walked:
            matcher.rollback(walked)
        return out


class ControlsTable:
    """A process's controls by sequence id, made when a sequence arrives (its grammar starts
    compiling then, beside the step) and dropped at its release. `draft`: the draft actor's,
    which constrains its proposals by grammars alone."""

    def __init__(self, env: ControlsEnv | None, draft: bool = False):
        self.env, self.draft = env, draft
        self.by_seq: dict[int, SeqControls] = {}

    def add(self, seq_id: int, params: SamplingParams, prompt_ids: list[int],
            eos_ids: tuple[int, ...]) -> None:
        wanted = params.grammar is not None if self.draft else params.has_controls
        if wanted and self.env is not None:
            self.by_seq[seq_id] = SeqControls(self.env, params, prompt_ids, eos_ids,
                                              penalties=not self.draft)

    def release(self, seq_id: int) -> None:
        self.by_seq.pop(seq_id, None)

    def get(self, seq_id: int) -> SeqControls | None:
        return self.by_seq.get(seq_id)

    def commit(self, seq_ids: list[int], new_tokens: list[list[int]]) -> dict[int, str]:
        """Advances each sequence by its committed tokens; {index: why} for those refused."""
        errors = {}
        for i, (seq_id, tokens) in enumerate(zip(seq_ids, new_tokens, strict=True)):
            c = self.by_seq.get(seq_id)
            if c is not None and tokens:
                try:
                    c.commit(tokens)
                except GrammarError as e:
                    errors[i] = f"GrammarError: {e}"
        return errors


@dataclass(frozen=True)
class ControlRows:
    """A controlled sequence's rows in a step's logits: `first` and the block's tokens
    ([anchor, d1 … dK], one row each; [] for a prefill's sampled row)."""

    index: int  # the sequence's index in the step
    controls: SeqControls
    first: int
    block: list[int]

    @property
    def num_rows(self) -> int:
        return max(len(self.block), 1)


def apply_controls(logits: torch.Tensor, rows: list[ControlRows]) -> dict[int, str]:
    """Applies each sequence's controls to its rows of logits [T, V] in place; returns {index:
    why} for the sequences whose controls failed (a grammar that did not compile), whose rows
    are left as they were."""
    errors: dict[int, str] = {}
    masked, biased, penalized = [], [], []
    for r in rows:
        p = r.controls.params
        try:
            if r.controls.masks:
                r.controls.matcher()  # a compile error surfaces here, for this sequence
                masked.append(r)
        except GrammarError as e:
            errors[r.index] = f"GrammarError: {e}"
            continue
        if p.logit_bias:
            biased.append(r)
        if p.has_penalties:
            penalized.append(r)
    if masked:
        _apply_masks(logits, masked, errors)
    if biased:
        _apply_bias(logits, biased)
    if penalized:
        _apply_penalties(logits, penalized)
    return errors


def _apply_masks(logits: torch.Tensor, rows: list[ControlRows], errors: dict[int, str]) -> None:
    words = bitmask_words(logits.shape[-1])
    total = sum(r.num_rows for r in rows)
    host = torch.full((total, words), -1, dtype=torch.int32,
                      pin_memory=logits.is_cuda)
    index, at = [], 0
    for r in rows:
        try:
            r.controls.fill_masks(r.block, host[at : at + r.num_rows])
        except Exception as e:  # noqa: BLE001 — this sequence fails alone
            errors[r.index] = f"{type(e).__name__}: {e}"
            host[at : at + r.num_rows] = -1
        index.extend(range(r.first, r.first + r.num_rows))
        at += r.num_rows
    index_t = _device_tensor(index, torch.long, logits.device)
    allowed = unpack_bits(host.to(logits.device, non_blocking=True), logits.shape[-1])
    logits[index_t] = logits[index_t].masked_fill(~allowed, float("-inf"))


def _apply_bias(logits: torch.Tensor, rows: list[ControlRows]) -> None:
    row_idx, tok_idx, values = [], [], []
    for r in rows:
        for t, b in r.controls.params.logit_bias:
            row_idx.extend(range(r.first, r.first + r.num_rows))
            tok_idx.extend([t] * r.num_rows)
            values.extend([b] * r.num_rows)
    dev = logits.device
    logits.index_put_((_device_tensor(row_idx, torch.long, dev),
                       _device_tensor(tok_idx, torch.long, dev)),
                      _device_tensor(values, logits.dtype, dev), accumulate=True)


def _apply_penalties(logits: torch.Tensor, rows: list[ControlRows]) -> None:
    """vLLM's formula per row: a token seen in the prompt or generated has its logit divided
    by repetition_penalty if positive, multiplied if not; then frequency_penalty × its
    generated count and presence_penalty × (count > 0) are subtracted. Row j's counts include
    the drafts before it."""
    dev, v = logits.device, logits.shape[-1]
    row_of, seq_of, extra_r, extra_t = [], [], [], []
    at = 0
    for s, r in enumerate(rows):
        row_of.extend(range(r.first, r.first + r.num_rows))
        seq_of.extend([s] * r.num_rows)
        for j in range(1, len(r.block)):  # row j counts the drafts d1..dj
            extra_r.extend([at + j] * j)
            extra_t.extend(r.block[1 : j + 1])
        at += r.num_rows
    seq_t = _device_tensor(seq_of, torch.long, dev)
    counts = torch.stack([r.controls.counts for r in rows])[seq_t]  # [R, V]
    if extra_r:
        counts.index_put_((_device_tensor(extra_r, torch.long, dev),
                           _device_tensor(extra_t, torch.long, dev)),
                          torch.ones(len(extra_r), dtype=counts.dtype, device=dev),
                          accumulate=True)
    params = [r.controls.params for r in rows]
    per_row = _device_tensor([[p.repetition_penalty, p.frequency_penalty, p.presence_penalty]
                              for p in params], torch.float32, dev)[seq_t]  # [R, 3]
    rep, freq, pres = per_row.unbind(1)
    seen = counts > 0
    prompt = [r.controls.in_prompt if r.controls.in_prompt is not None
              else torch.zeros(v, dtype=torch.bool, device=dev) for r in rows]
    in_prompt_or_seen = torch.stack(prompt)[seq_t] | seen
    row_t = _device_tensor(row_of, torch.long, dev)
    x = logits[row_t].float()
    rep = torch.where(in_prompt_or_seen, rep[:, None], 1.0)
    x = torch.where(x > 0, x / rep, x * rep)
    x = x - freq[:, None] * counts - pres[:, None] * seen
    logits[row_t] = x.to(logits.dtype)


def _device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values on `device`; to CUDA from pinned memory without waiting: a blocking copy would
    wait for the forward queued before it, and the host work after it would no longer
    overlap the device's."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


# ---- token bitmasks ------------------------------------------------------------------------

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def pack_bits(allowed: np.ndarray) -> np.ndarray:
    """[N, V] bool → [N, words] int32 bitmask."""
    n, v = allowed.shape
    padded = np.zeros((n, bitmask_words(v) * 32), bool)
    padded[:, :v] = allowed
    return np.packbits(padded.reshape(n, -1, 32), axis=-1, bitorder="little") \
        .view(np.int32).reshape(n, -1)


def clear_bits(words: np.ndarray, tokens: list[int]) -> None:
    """Bans `tokens` in one row's bitmask [words] int32, in place."""
    for t in tokens:
        words[t // 32] &= np.int32(~(1 << (t % 32)) if t % 32 != 31 else 0x7FFFFFFF)


def unpack_bits(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, words] int32 → [N, vocab_size] bool, on bitmask's device."""
    shifts = _SHIFTS.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS[bitmask.device] = torch.arange(32, dtype=torch.int32,
                                                        device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [N, words, 32]
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()
