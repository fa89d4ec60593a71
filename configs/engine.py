"""Engine and request configuration: frozen, validated once, errors name the field."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import torch

from configs.kernels import KernelConfig, parse_choices

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The most alternatives a token's log-probabilities may list (vLLM's max_logprobs default).
MAX_LOGPROBS = 20
# OpenAI's ranges for the penalties and the logit bias.
PENALTY_RANGE = (-2.0, 2.0)
LOGIT_BIAS_RANGE = (-100.0, 100.0)
# What a structured output is constrained by (vLLM's structured_outputs keys, with
# json_object for OpenAI's response_format {"type": "json_object"}).
GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")


@dataclass(frozen=True)
class GrammarSpec:
    """A structured output's constraint, as text: json — a JSON schema (serialized);
    json_object — any JSON object (value ""); regex; choice — a JSON list of the strings;
    grammar — EBNF (GBNF as llama.cpp and xgrammar read it); structural_tag — xgrammar's
    structural tag (JSON). Compiled by workers/grammar.py.

    `starts_after`: a token id (a reasoning model's `</think>`): the output is free until it
    has generated that token, and constrained from the token after it on."""

    kind: str
    value: str
    starts_after: int | None = None

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.value, str):
            raise ValueError(f"grammar value must be a string, got {type(self.value).__name__}")
        if self.starts_after is not None:
            _token_id(self.starts_after, "grammar.starts_after")


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 → greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 → disabled
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # The target's log-probabilities (log-softmax of its logits, before temperature, top-k and
    # top-p) of each generated token, with this many most likely alternatives; None: none.
    logprobs: int | None = None
    # The same for every prompt token after the first (echo, prompt_logprobs); None: none.
    prompt_logprobs: int | None = None
    # The controls below are vLLM's, with its semantics (workers/logit_controls.py applies them, in
    # vLLM's order): presence and frequency over the generated tokens, repetition over the
    # prompt and the generated tokens; min_p after temperature.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # the sequence's end tokens are banned before this many are generated
    # token-id sequences never generated: a single token always banned, a longer one's last
    # token banned after the others (the API tokenizes bad_words strings into these)
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    allowed_token_ids: tuple[int, ...] | None = None  # only these may be generated
    grammar: GrammarSpec | None = None  # structured output

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise ValueError(
                f"top_k must be -1, 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"seed must be an integer, got {self.seed!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got "
                                 f"{value!r}")
        self._check_controls()

    def _check_controls(self) -> None:
        lo, hi = PENALTY_RANGE
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (_is_number(value) and lo <= value <= hi):
                raise ValueError(f"{name} must be a number in [{lo:g}, {hi:g}], got {value!r}")
        if not (_is_number(self.repetition_penalty) and 0 < self.repetition_penalty <= 100):
            raise ValueError(f"repetition_penalty must be a number in (0, 100], got "
                             f"{self.repetition_penalty!r}")
        if not (_is_number(self.min_p) and 0 <= self.min_p <= 1):
            raise ValueError(f"min_p must be a number in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or isinstance(self.min_tokens, bool) \
                or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}]"
                             f", got {self.min_tokens!r}")
        lo, hi = LOGIT_BIAS_RANGE
        bias = tuple((_token_id(t, "logit_bias"), float(b)) for t, b in self.logit_bias)
        if any(not (_is_number(b) and lo <= b <= hi) for _, b in self.logit_bias):
            raise ValueError(f"logit_bias values must be numbers in [{lo:g}, {hi:g}]")
        object.__setattr__(self, "logit_bias", bias)
        words = tuple(tuple(_token_id(t, "bad_words") for t in w)
                      for w in self.bad_words_token_ids)
        if any(not w for w in words):
            raise ValueError("bad_words must not hold an empty sequence")
        object.__setattr__(self, "bad_words_token_ids", words)
        if self.allowed_token_ids is not None:
            allowed = tuple(_token_id(t, "allowed_token_ids") for t in self.allowed_token_ids)
            if not allowed:
                raise ValueError("allowed_token_ids must not be empty")
            object.__setattr__(self, "allowed_token_ids", allowed)
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError(f"grammar must be a GrammarSpec, got {type(self.grammar).__name__}")

    # cached: read per sequence at every step (a frozen dataclass's cached_property writes
    # the instance's __dict__ directly)
    @cached_property
    def has_penalties(self) -> bool:
        return (self.presence_penalty != 0 or self.frequency_penalty != 0
                or self.repetition_penalty != 1)

    @cached_property
    def has_controls(self) -> bool:
        """Anything that changes the logits before the token is picked (workers/logit_controls.py);
        min_p acts on the probabilities instead (workers/sampling.py)."""
        return (self.has_penalties or bool(self.logit_bias) or self.min_tokens > 0
                or bool(self.bad_words_token_ids) or self.allowed_token_ids is not None
                or self.grammar is not None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def check_vocab(self, vocab_size: int) -> None:
        """Every token id the controls name is below vocab_size (ValueError naming the
        field)."""
        named = (("logit_bias", [t for t, _ in self.logit_bias]),
                 ("bad_words", [t for w in self.bad_words_token_ids for t in w]),
                 ("allowed_token_ids", self.allowed_token_ids or ()),
                 ("stop_token_ids", self.stop_token_ids),
                 ("grammar.starts_after", () if self.grammar is None
                  or self.grammar.starts_after is None else (self.grammar.starts_after,)))
        for name, ids in named:
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name}: token id {bad[0]} is outside the vocabulary "
                                 f"[0, {vocab_size})")


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) \
        and value == value and abs(value) != float("inf")


def _token_id(value: object, field: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{field}: token ids must be integers, got {value!r}")
    return value


# Where the weights come from: "auto" the checkpoints' safetensors; "dummy" random weights
# from config.json alone (target/dummy.py; benchmarks and TP checks without the weights).
# vLLM's name and values.
LOAD_FORMATS = ("auto", "dummy")


def check_load_format(value: str) -> str:
    if value not in LOAD_FORMATS:
        raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {value!r}")
    return value


DRAFT_PLACEMENTS = ("colocated", "separate")
CONTROL_CHANNELS = ("auto", "shm", "tcp")
# The prefix cache's state snapshots by default: this share of the memory a GPU has left for
# caches (after weights, activations and the running sequences' state slots), at most
# MAX_SNAPSHOTS; on CPU this many per max_num_seqs.
PREFIX_STATE_FRACTION = 0.1
MAX_SNAPSHOTS = 4096
CPU_SNAPSHOTS_PER_SEQ = 4
CONTROL_SPIN_US = 50_000
SPIN_MIN_CPUS = 8
def check_acceptance_replay(spec: object, draft_model: str | None) -> None:
    """A mean acceptance length ≥ 1, a JSON list or an existing file, with a draft
    (draft/replay.py reads the list, and checks the length against the block size)."""
    if draft_model is None:
        raise ValueError("acceptance_replay needs --draft-model")
    if not isinstance(spec, str):
        raise ValueError(f"acceptance_replay must be a number, a JSON list or a file name, "
                         f"got {spec!r}")
    if spec.lstrip().startswith("["):
        return
    try:
        tau = float(spec)
    except ValueError:
        if not Path(spec).is_file():
            raise ValueError(f"acceptance_replay: {spec!r} is neither a mean acceptance length "
                             f"nor a file") from None
        return
    if not tau >= 1:
        raise ValueError(f"acceptance_replay: a mean acceptance length must be >= 1, got "
                         f"{spec!r}")


@dataclass(frozen=True)
class EngineConfig:
    model: str
    draft_model: str | None = None
    block_size: int | None = None  # --speculative-dflash-block-size; None → the draft's own
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 64
    max_model_len: int | None = None  # None → the target's max_position_embeddings
    # A max_model_len above the model's max_position_embeddings is refused unless this (or
    # vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) allows it: past it, outputs may be garbage.
    allow_long_max_model_len: bool = False
    page_size: int = 16  # tokens per KV page
    num_pages: int | None = None  # None → enough for max_num_seqs full-length sequences
    seed: int = 0  # seeds the per-request generators of requests that bring no seed
    # Prompt tokens one prefill step feeds (vLLM's name); longer prompts are prefilled in chunks.
    max_num_batched_tokens: int = 8192
    # GPU: the share of each GPU's memory the engine may hold (weights + activations + caches);
    # the KV pool gets what is left (unless num_pages is given). vLLM's name and default.
    gpu_memory_utilization: float = 0.9
    # GPU: rounds and proposals replay CUDA graphs per batch-size bucket (workers/
    # cuda_graphs.py) with the elementwise chains compiled (target/kernels/fused.py); True
    # runs every step eagerly and uncompiled (vLLM's name).
    enforce_eager: bool = False
    load_format: str = "auto"  # one of LOAD_FORMATS
    # Where the draft runs under Ray: "colocated" shares TP rank 0's GPU (half of it each; aux
    # features through CUDA IPC), "separate" takes a GPU of its own (one more placement
    # bundle; aux features through an NCCL send/recv pair). The in-process engine ignores it.
    draft_placement: str = "colocated"
    # What carries the per-step messages between the driver and the actors
    # (workers/channel.py): "shm" (shared memory; every actor on the driver's node), "tcp", or
    # "auto" (shm when they share a node, as a placement group's STRICT_PACK makes them).
    control_channel: str = "auto"
    # How long a process waiting on the control channel spins before it sleeps on a FIFO.
    # None: CONTROL_SPIN_US on GPU hosts with at least SPIN_MIN_CPUS cores, else 0 (on a small
    # machine, or when the model runs on the CPU, the spinners would take the cores the work
    # needs).
    control_spin_us: int | None = None
    # The attention of decode, rounds and draft blocks, and the routed experts' kernel: see
    # configs/kernels.py (ATTENTION_BACKENDS, MOE_BACKENDS) and `kernels`.
    attention_backend: str = "auto"
    moe_backend: str = "auto"
    # The other kernel choices, "field=value[,…]" over configs/kernels.py's KernelConfig
    # (moe_routing, gdn_recurrence, gdn_prologue, attention_prologue, pdl,
    # gdn_rounds): to compare a variant with the defaults (tools/golden_check.py), or to step
    # around a kernel. "": the defaults, the paths measured fastest.
    kernel_overrides: str = ""
    # Prefix caching (cluster/prefix_cache.py; vLLM's name): full KV pages shared by content
    # and Gated DeltaNet state snapshots at page boundaries, so a prompt that starts as an
    # earlier one did prefills only the rest.
    enable_prefix_caching: bool = True
    # The snapshots' memory per GPU in GiB (each one every linear-attention layer's state of
    # one sequence: ~63 MB for 35B-A3B at TP 1). None: PREFIX_STATE_FRACTION of the memory
    # left for caches on a GPU; on CPU, where nothing is measured, CPU_SNAPSHOTS_PER_SEQ ×
    # max_num_seqs snapshots.
    prefix_cache_state_gb: float | None = None
    # Benchmarks only (draft/replay.py): the draft's proposals replaced by the target's own
    # continuation recorded from an earlier run of the same prompt, accepted as far as a mean
    # acceptance length ("6.3") or per-position acceptance probabilities (a JSON list, given so
    # or in a file) draw.
    # Outputs are unchanged (the target verifies every draft); the speed becomes that of the
    # chosen acceptance. None: off.
    acceptance_replay: str | None = None
    # With a draft: each round's draft length (B − 1, 7, 3 or none) picked for the batch from
    # the sequences' recent acceptance and the round costs measured at warm-up
    # (cluster/speculation.py); False: B − 1 every round.
    speculative_adaptive: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.dtype == "float16":
            raise ValueError("dtype float16 overflows the DFlash feature fusion; use bfloat16")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.block_size is not None:
            if self.draft_model is None:
                raise ValueError("--speculative-dflash-block-size needs --draft-model")
            if not isinstance(self.block_size, int) or not 2 <= self.block_size <= 64:
                raise ValueError(
                    f"--speculative-dflash-block-size must be an integer in [2, 64], "
                    f"got {self.block_size!r}"
                )
        check_load_format(self.load_format)
        if self.draft_placement not in DRAFT_PLACEMENTS:
            raise ValueError(f"draft_placement must be one of {DRAFT_PLACEMENTS}, got "
                             f"{self.draft_placement!r}")
        if self.control_channel not in CONTROL_CHANNELS:
            raise ValueError(f"control_channel must be one of {CONTROL_CHANNELS}, got "
                             f"{self.control_channel!r}")
        if self.control_spin_us is not None and (
                not isinstance(self.control_spin_us, int) or self.control_spin_us < 0):
            raise ValueError(f"control_spin_us must be a non-negative integer or None, got "
                             f"{self.control_spin_us!r}")
        # a bad kernel choice: a ValueError naming its field, now; whether the choices run on
        # the device is checked at start-up (target/kernels/selection.py `check`)
        self.kernels  # noqa: B018
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.page_size <= 0:
            raise ValueError(f"page_size must be positive, got {self.page_size}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got "
                             f"{self.gpu_memory_utilization}")
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be true or false, got "
                             f"{self.enable_prefix_caching!r}")
        if self.prefix_cache_state_gb is not None and not (
                isinstance(self.prefix_cache_state_gb, (int, float))
                and not isinstance(self.prefix_cache_state_gb, bool)
                and 0 <= self.prefix_cache_state_gb < float("inf")):
            raise ValueError(f"prefix_cache_state_gb must be a number of GiB >= 0, got "
                             f"{self.prefix_cache_state_gb!r}")
        if not isinstance(self.speculative_adaptive, bool):
            raise ValueError(f"speculative_adaptive must be true or false, got "
                             f"{self.speculative_adaptive!r}")
        if self.acceptance_replay is not None:
            check_acceptance_replay(self.acceptance_replay, self.draft_model)
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def control_spin_s(self) -> float:
        if self.control_spin_us is not None:
            return self.control_spin_us * 1e-6
        spare_cores = (os.cpu_count() or 1) >= SPIN_MIN_CPUS and self.device.startswith("cuda")
        return CONTROL_SPIN_US * 1e-6 if spare_cores else 0.0

    @property
    def kernels(self) -> KernelConfig:
        """The kernel choices (validated here: a bad name is a ValueError naming its field)."""
        overrides = parse_choices(self.kernel_overrides)
        for name, setting in (("attention", "attention_backend"), ("moe", "moe_backend")):
            if name in overrides:
                raise ValueError(f"kernel_overrides: {name!r} is set by {setting}")
        return KernelConfig(attention=self.attention_backend, moe=self.moe_backend, **overrides)
