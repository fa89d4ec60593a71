"""The Ray Serve application: `serve run deploy/dflash.yaml` (import path
`deploy.app:app_builder`, application args = `ServeArgs`) or `dflash-serve serve …`.

One engine per replica: Serve places each replica with `placement_group_bundles` =
{GPU: 1, CPU: 1} × tp, STRICT_PACK (the replica itself needs no resources); the replica's
`RayEngineClient` starts the driver actor in that group, and the driver the TP workers and the
draft. More replicas = data parallel; Serve's autoscaler and Ray's cluster autoscaler see the
GPU bundles."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from pathlib import Path

from ray import serve
from ray.serve import Application

from cluster.ray_executor import engine_bundles, separate_draft
from configs.engine import EngineConfig
from configs.model import TargetConfig
from deploy.openai_api import ApiOptions, build_app
from deploy.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_SHUTDOWN_GRACE_S,
    load_sampling_defaults,
)
from deploy.ray_client import DRAIN_MARGIN_S, RayEngineClient
from deploy.tokenizer import chat_template_text, load_tokenizer, with_chat_template

log = logging.getLogger(__name__)

REPO = Path(__file__).resolve().parents[1]


def _resolve_path(path: str) -> str:
    """Relative model paths are taken from the working directory, else from the repository
    (Serve replicas do not run in the directory `serve run` was started from)."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return str(p.resolve())
    return str((REPO / p).resolve()) if (REPO / p).exists() else path


@dataclass(frozen=True)
class ServeArgs:
    """Application args (YAML `args:` / CLI flags, same names)."""

    model: str
    draft_model: str | None = None
    tp: int = 1
    speculative_algorithm: str | None = None  # "dflash", any case (implied by draft_model)
    # B: the verify block (the anchor + B − 1 proposed tokens); None → the draft's own
    speculative_dflash_block_size: int | None = None
    # K: the tokens the draft proposes per round, so B = K + 1 (vLLM's num_speculative_tokens;
    # NOT SGLang's --speculative-num-draft-tokens, which counts B). Must agree with B if both.
    speculative_num_draft_tokens: int | None = None
    # vLLM's --speculative-config: {"method": "dflash", "model": …, "num_speculative_tokens": K}
    speculative_config: dict | None = None
    device: str = "cuda"
    dtype: str | None = None  # None → bfloat16 on cuda, float32 on cpu
    served_model_name: str | None = None  # None → the model directory's name
    max_num_seqs: int = 64
    max_model_len: int | None = None
    max_num_batched_tokens: int | None = None  # prefill tokens per step; None → engine default
    kv_block_size: int = 16
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9  # share of each GPU for weights + activations + caches
    max_waiting: int | None = None  # requests queued for admission before 429; None → 4 × seqs
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES  # larger request bodies: 413
    enforce_eager: bool = False  # GPU: no CUDA graphs
    load_format: str = "auto"  # "dummy": random weights from config.json (benchmarks)
    draft_placement: str = "colocated"  # "separate": the draft on a GPU of its own
    control_channel: str = "auto"  # per-step messages: shared memory within a node, else TCP
    control_spin_us: int | None = None  # spin before sleeping on it; None: by core count
    attention_backend: str = "auto"  # decode/rounds/draft blocks: "triton" on CUDA, or "torch"
    shutdown_grace_s: float = DEFAULT_SHUTDOWN_GRACE_S  # SIGTERM: requests in flight run on
    # API access (deploy/openai_api.py ApiOptions): a Bearer key (None: open; the CLI reads
    # DFLASH_SERVE_API_KEY), CORS as vLLM's flags
    api_key: str | None = None
    allowed_origins: list[str] = field(default_factory=lambda: ["*"])
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # Sampling defaults of requests that leave them out: "auto" the model's
    # generation_config.json, "vllm" OpenAI's, or a directory (vLLM's --generation-config)
    generation_config: str = "auto"
    # a Jinja chat template (or a file holding one) instead of the tokenizer's
    chat_template: str | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            value = getattr(self, name)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{name} must be a list of strings, got {value!r}")
        if self.api_key is not None and (not isinstance(self.api_key, str) or not self.api_key):
            raise ValueError("api_key must be a non-empty string or null")
        if not isinstance(self.shutdown_grace_s, (int, float)) or self.shutdown_grace_s < 0:
            raise ValueError(f"shutdown_grace_s must be a number >= 0, got "
                             f"{self.shutdown_grace_s!r}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.speculative_config is not None:
            self._merge_speculative_config(self.speculative_config)
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", None)
        algo = self.speculative_algorithm
        if algo is not None and algo.lower() != "dflash":
            raise ValueError(f"speculative_algorithm must be 'dflash', got {algo!r}")
        if algo is not None and not self.draft_model:
            raise ValueError("speculative_algorithm 'dflash' needs draft_model")
        k = self.speculative_num_draft_tokens
        if k is not None and k < 1:
            raise ValueError(f"speculative_num_draft_tokens must be >= 1, got {k}")
        b = self.speculative_dflash_block_size
        if k is not None and b is not None and k + 1 != b:
            raise ValueError(
                f"speculative_num_draft_tokens {k} contradicts speculative_dflash_block_size "
                f"{b}: here K counts the proposed tokens, so B = K + 1 (give one of them)")
        if self.max_waiting is not None and self.max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {self.max_waiting}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")

    def _merge_speculative_config(self, spec: dict) -> None:
        if not isinstance(spec, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {spec!r}")
        unknown = sorted(set(spec) - {"method", "model", "num_speculative_tokens"})
        if unknown:
            raise ValueError(f"speculative_config: unsupported keys {unknown} (known: method, "
                             f"model, num_speculative_tokens)")
        for key, name in (("method", "speculative_algorithm"), ("model", "draft_model"),
                          ("num_speculative_tokens", "speculative_num_draft_tokens")):
            if key not in spec:
                continue
            mine = getattr(self, name)
            value = spec[key]
            same = mine is None or (str(mine).lower() == str(value).lower() if key == "method"
                                    else mine == value)
            if not same:
                raise ValueError(f"speculative_config.{key} {value!r} contradicts {name} "
                                 f"{mine!r}")
            object.__setattr__(self, name, value)

    def check_draft_block(self) -> None:
        """Refuses a K (speculative_num_draft_tokens) whose block B = K + 1 is larger than the
        one the draft was trained for: SGLang's flag of the same name counts B, so its users'
        K is one too many."""
        k = self.speculative_num_draft_tokens
        if k is None or not self.draft_model or self.speculative_dflash_block_size is not None:
            return
        from draft.config import DraftConfig

        trained = DraftConfig.from_pretrained(_resolve_path(self.draft_model)).block_size
        if k + 1 > trained:
            raise ValueError(
                f"speculative_num_draft_tokens {k} makes verify blocks of {k + 1}, but the draft "
                f"was trained for blocks of {trained}. Here K counts only the proposed tokens "
                f"(B = K + 1, as vLLM's num_speculative_tokens); SGLang's "
                f"--speculative-num-draft-tokens counts B. Pass {trained - 1}, or "
                f"--speculative-dflash-block-size {trained}")

    @classmethod
    def from_dict(cls, args: dict) -> ServeArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - names)
        if unknown:
            raise ValueError(f"unknown application args {unknown}; known: {sorted(names)}")
        if "model" not in args:
            raise ValueError("application args need 'model' (the target checkpoint directory)")
        return cls(**args)

    @property
    def block_size(self) -> int | None:
        if self.speculative_dflash_block_size is not None:
            return self.speculative_dflash_block_size
        k = self.speculative_num_draft_tokens
        return None if k is None else k + 1

    @property
    def on_gpu(self) -> bool:
        return self.device.startswith("cuda")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model).name

    def api_options(self) -> ApiOptions:
        return ApiOptions(api_key=self.api_key, allowed_origins=tuple(self.allowed_origins),
                          allowed_methods=tuple(self.allowed_methods),
                          allowed_headers=tuple(self.allowed_headers),
                          allow_credentials=self.allow_credentials)

    def engine_config(self) -> EngineConfig:
        extra = {}
        if self.max_num_batched_tokens is not None:  # else the engine's default
            extra["max_num_batched_tokens"] = self.max_num_batched_tokens
        return EngineConfig(
            model=_resolve_path(self.model),
            draft_model=_resolve_path(self.draft_model) if self.draft_model else None,
            block_size=self.block_size, device=self.device,
            dtype=self.dtype or ("bfloat16" if self.on_gpu else "float32"),
            max_num_seqs=self.max_num_seqs, max_model_len=self.max_model_len,
            kv_block_size=self.kv_block_size, num_kv_blocks=self.num_kv_blocks, seed=self.seed,
            gpu_memory_utilization=self.gpu_memory_utilization,
            enforce_eager=self.enforce_eager, load_format=self.load_format,
            draft_placement=self.draft_placement, control_channel=self.control_channel,
            control_spin_us=self.control_spin_us, attention_backend=self.attention_backend,
            **extra,
        )


@serve.deployment(
    name="DFlashServer",
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=512,
    health_check_period_s=10,
    health_check_timeout_s=120,
    graceful_shutdown_timeout_s=30,
)
@serve.ingress()
class DFlashServer:
    async def __init__(self, args: ServeArgs):
        self.args = args
        cfg = args.engine_config()
        self.client = await RayEngineClient.start(
            cfg, args.tp, args.model_name,
            max_waiting=args.max_waiting or 4 * args.max_num_seqs)
        self.tokenizer = with_chat_template(load_tokenizer(cfg.model), args.chat_template)
        self.defaults = load_sampling_defaults(args.generation_config, cfg.model)
        log.info("sampling defaults (%s): temperature %g, top_p %g, top_k %d",
                 self.defaults.source, self.defaults.temperature, self.defaults.top_p,
                 self.defaults.top_k)

    def __serve_build_asgi_app__(self):
        return build_app(self.client, self.tokenizer, shutdown_client=True,
                         max_request_bytes=self.args.max_request_bytes,
                         options=self.args.api_options(), defaults=self.defaults)

    async def check_health(self) -> None:
        # Only a dead engine fails the replica: a restart after a worker death is the
        # engine's own recovery (GET /health reports it as 503 meanwhile).
        await self.client.check_alive()


def app_builder(args: dict) -> Application:
    """Serve's application builder: `serve run deploy.app:app_builder model=…` or the YAML."""
    return build_deployment(ServeArgs.from_dict(dict(args)))


def build_deployment(a: ServeArgs, num_replicas: int | None = None) -> Application:
    # Fail here, in `serve run`, not later in a replica that Serve would restart forever.
    cfg = a.engine_config()
    TargetConfig.from_pretrained(cfg.model).check_tp(a.tp)
    a.check_draft_block()
    chat_template_text(a.chat_template)
    load_sampling_defaults(a.generation_config, cfg.model)
    options = {"num_replicas": num_replicas} if num_replicas is not None else {}
    # Serve waits this long for a replica's requests when it stops it (serve run's Ctrl-C, a
    # redeploy, a downscale): past the grace period, so a drain (drain_engines) ends first.
    options["graceful_shutdown_timeout_s"] = a.shutdown_grace_s + DRAIN_MARGIN_S
    return DFlashServer.options(
        placement_group_bundles=engine_bundles(a.tp, a.on_gpu, separate_draft(cfg)),
        placement_group_strategy="STRICT_PACK", **options,
    ).bind(a)
