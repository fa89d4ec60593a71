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

A step's logits get them in workers/logit_controls.py."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from configs.engine import SamplingParams
from workers.grammar import GrammarError, Grammars
from workers.messages import StepMsg
from workers.token_bitmask import clear_bits, pack_bits

log = logging.getLogger(__name__)


class ControlsEnv:
    """What one process needs to build controls: the logits' width, the device, (for
    grammars, made on first use) the tokenizer, whose grammars compile on a thread of their
    own beside the step, and the penalties' kernel: "torch" or "triton" (KernelConfig's
    `penalties` resolved for the device, target/kernels/selection.py)."""

    def __init__(self, vocab_size: int, device: torch.device | str,
                 tokenizer_dir: str | None = None, penalties: str = "torch"):
        if penalties not in ("torch", "triton"):
            raise ValueError(f"penalties must be 'torch' or 'triton', got {penalties!r}")
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.tokenizer_dir = tokenizer_dir
        self.penalties = penalties
        self._grammars: Grammars | None = None
        self._pool: ThreadPoolExecutor | None = None
        # the step's thread and the compile thread may both ask first: one builds
        self._lock = threading.Lock()

    @classmethod
    def for_checkpoint(cls, model_dir: str, vocab_size: int, device: torch.device | str,
                       penalties: str = "torch") -> ControlsEnv:
        """Grammars from the checkpoint's tokenizer, where it ships one."""
        d = Path(model_dir)
        has_tokenizer = (d / "tokenizer.json").is_file() or (d / "tokenizer_config.json").is_file()
        return cls(vocab_size, device, str(d) if has_tokenizer else None, penalties)

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
        # [V] int32 generated-token counts (the penalties), read through counts(): the tokens
        # committed since the last read are added then, on the device while the next step's
        # forward runs, rather than between steps where the device would wait for them
        self._counts: torch.Tensor | None = None
        self._uncounted: list[int] = []
        self.in_prompt: torch.Tensor | None = None  # [V] bool (repetition_penalty)
        if params.has_penalties and penalties:
            self._counts = torch.zeros(v, dtype=torch.int32, device=device)
            if params.repetition_penalty != 1:
                self.in_prompt = torch.zeros(v, dtype=torch.bool, device=device)
                self.in_prompt[device_tensor(prompt_ids, torch.long, device)] = True
        self.env = env
        self._compiled: Future | None = None
        self._matcher = None
        # the grammar's opening token (a reasoning model's </think>) while it is still to come
        self.waiting_for: int | None = None
        if params.grammar is not None:
            self._compiled = env.compile_later(params)
            self.waiting_for = params.grammar.starts_after

    @property
    def masks(self) -> bool:
        return (self._compiled is not None or self.static_mask is not None
                or bool(self.long_bad_words) or len(self.generated) < self.params.min_tokens)

    def matcher(self):
        """The grammar's matcher (waits for its compile); GrammarError if it did not."""
        if self._matcher is None and self._compiled is not None:
            compiled = self._compiled.result()  # (the compile thread built the Grammars)
            self._matcher = self.env.grammars().matcher(compiled, self.grammar_end_ids)
        return self._matcher

    def fill_masks(self, block: list[int], out: torch.Tensor) -> None:
        """out [len(block) or 1, words] int32, all ones on entry: row j's mask after the
        anchor and drafts d1..dj (block = [anchor, d1 … dK]; [] for a prefill's one row)."""
        n_rows = out.shape[0]
        matcher = self.matcher()
        # rows before the grammar opens are free: the grammar's first row follows the first
        # draft that is its opening token (row 0 when it has opened)
        first = 0 if self.waiting_for is None else next(
            (j for j in range(1, n_rows) if block[j] == self.waiting_for), n_rows)
        if matcher is not None and not matcher.is_terminated() and first < n_rows:
            rows = n_rows - first
            if rows == 1:
                matcher.fill_next_token_bitmask(out[first:], 0)
            else:  # the draft chain as a tree: node j's child is j + 1 (node 0: the anchor)
                nxt = torch.arange(1, rows + 1)
                nxt[-1] = -1
                matcher.traverse_draft_tree(nxt, torch.full((rows,), -1),
                                            torch.tensor(block[first:], dtype=torch.long),
                                            out[first:])
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

    def counts(self) -> torch.Tensor:
        """[V] int32: how often each token was generated (the committed tokens)."""
        count_tokens([self])
        return self._counts

    def commit(self, tokens: list[int]) -> None:
        """The step's committed tokens for this sequence (accepted drafts and the bonus, or a
        prefill's first token). GrammarError if the grammar refuses one: no token was left
        allowed (the grammar and allowed_token_ids/bad_words exclude each other)."""
        if not tokens:
            return
        self.generated += tokens
        if self._counts is not None:
            self._uncounted += tokens
        matcher = self.matcher()
        if self.waiting_for is not None:
            if self.waiting_for not in tokens:
                return
            tokens = tokens[tokens.index(self.waiting_for) + 1:]
            self.waiting_for = None
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
        opened = self.waiting_for is None
        for j, cands in enumerate(candidates):
            if not opened:  # free until the grammar's opening token
                out.append(cands[0])
                opened = cands[0] == self.waiting_for
                continue
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

    def apply(self, msg: StepMsg) -> None:
        """The step's new sequences (those with controls) and its released ones."""
        for seq in msg.new_seqs:
            p = seq.params
            wanted = p.grammar is not None if self.draft else p.has_controls
            if wanted and self.env is not None:
                self.by_seq[seq.seq_id] = SeqControls(self.env, p, seq.prompt_ids, seq.eos_ids,
                                                      penalties=not self.draft)
        for seq_id in msg.released:
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


def count_tokens(controls: list[SeqControls]) -> None:
    """Adds each sequence's tokens committed since its last count to its counts: one copy to
    the device for all of them and one index_add per sequence that has any."""
    todo = [c for c in controls if c._uncounted]
    if not todo:
        return
    dev = todo[0]._counts.device
    tokens = device_tensor([t for c in todo for t in c._uncounted], torch.long, dev)
    ones = torch.ones(len(tokens), dtype=torch.int32, device=dev)
    at = 0
    for c in todo:
        n = len(c._uncounted)
        c._counts.index_add_(0, tokens[at : at + n], ones[at : at + n])
        c._uncounted, at = [], at + n


def device_tensor(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """values on `device`; to CUDA from pinned memory without waiting: a blocking copy would
    wait for the forward queued before it, and the host work after it would no longer
    overlap the device's."""
    host = torch.tensor(values, dtype=dtype)
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)
