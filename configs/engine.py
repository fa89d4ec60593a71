"""Engine and request configuration: frozen, validated once, errors name the field."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from configs.kernels import KernelConfig, parse_choices

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The most alternatives a token's log-probabilities may list (vLLM's max_logprobs default).
MAX_LOGPROBS = 20


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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
CONTROL_SPIN_US = 50_000
SPIN_MIN_CPUS = 8
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
