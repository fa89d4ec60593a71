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
from deploy.ray_metrics import RayMetricsExport
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


def arg(default, help: str, *aliases: str, **extra):
    """A ServeArgs field with its command-line help and extra spellings (other stacks' flag
    names); the CLI's `serve` flags are generated from these (deploy/cli.py)."""
    factory = {"default_factory": default} if callable(default) else {"default": default}
    return field(**factory, metadata={"help": help, "aliases": aliases, **extra})


@dataclass(frozen=True)
class ServeArgs:
    """Application args: the YAML's `args:`, and the CLI's `serve` flags (the same names with
    dashes, generated from these fields). The engine's settings among them go to EngineConfig
    by name (`engine_config`)."""

    model: str = arg(None, "target checkpoint directory", required=True)
    draft_model: str | None = arg(
        None, "DFlash draft checkpoint directory (none: plain decoding)",
        "--speculative-draft-model", "--speculative-draft-model-path")
    tp: int = arg(1, "tensor-parallel size: GPUs per engine", "-tp", "--tensor-parallel-size")
    speculative_algorithm: str | None = arg(
        None, "dflash, any case (implied by --draft-model)")
    speculative_dflash_block_size: int | None = arg(
        None, "verify block size B (the anchor + B-1 proposed tokens); default: the draft's")
    speculative_num_draft_tokens: int | None = arg(
        None, "K, the tokens proposed per round: B = K+1 (vLLM's num_speculative_tokens; "
        "SGLang's flag of this name counts B). Refused if it contradicts the block size or "
        "exceeds the draft's")
    speculative_config: dict | None = arg(
        None, 'vLLM\'s form: \'{"method": "dflash", "model": DIR, "num_speculative_tokens": K}\'')
    device: str = arg("cuda", "cuda or cpu (CLI default: cuda when this machine has a GPU)")
    dtype: str | None = arg(None, "auto (bfloat16 on cuda, float32 on cpu), bfloat16 or float32")
    served_model_name: str | None = arg(None, "the API's model id (default: the model dir name)")
    max_num_seqs: int = arg(64, "sequences decoded together")
    max_model_len: int | None = arg(None, "context length (default: the model's)")
    max_num_batched_tokens: int | None = arg(
        None, "prompt tokens one prefill step feeds (default 8192)")
    kv_block_size: int = arg(16, "tokens per KV page")
    num_kv_blocks: int | None = arg(None, "KV pages (default: measured from free GPU memory)")
    gpu_memory_utilization: float = arg(
        0.9, "share of each GPU for weights, activations and the KV cache")
    max_waiting: int | None = arg(
        None, "requests queued for admission before 429 (default 4 x max-num-seqs)")
    max_request_bytes: int = arg(DEFAULT_MAX_REQUEST_BYTES,
                                 "larger request bodies get 413 (default 16 MiB)")
    enforce_eager: bool = arg(False, "GPU: run every step eagerly instead of replaying CUDA "
                                     "graphs")
    load_format: str = arg("auto", "auto (the checkpoints) or dummy (random weights from the "
                                   "model dirs' config.json, for benchmarks)")
    draft_placement: str = arg("colocated", "colocated (the draft shares TP rank 0's GPU) or "
                                            "separate (a GPU of its own; aux features over NCCL)")
    control_channel: str = arg("auto", "what carries the per-step messages between the driver "
                                       "and its actors: auto (shared memory on one node), shm, "
                                       "tcp")
    control_spin_us: int | None = arg(
        None, "microseconds a process waiting on that channel spins before it sleeps "
        "(default: 50000 on GPU hosts with 8+ cores, else 0)")
    attention_backend: str = arg(
        "auto", "the kernel of decode steps, verify rounds and draft blocks: triton (the KV "
        "pages read in place), torch (pages gathered), or auto (triton on CUDA)")
    shutdown_grace_s: float = arg(
        DEFAULT_SHUTDOWN_GRACE_S, "on SIGTERM or Ctrl-C: seconds the requests in flight may "
        "run on (new ones get 503); those still running then end with an error event "
        "(default 30; a second signal stops at once)")
    api_key: str | None = arg(
        None, "require Authorization: Bearer <key> on every route but /health and /version "
        "(CLI default: $DFLASH_SERVE_API_KEY, else open)")
    allowed_origins: list[str] = arg(lambda: ["*"], 'CORS origins, a JSON list (default ["*"])')
    allowed_methods: list[str] = arg(lambda: ["*"], 'CORS methods, a JSON list (default ["*"])')
    allowed_headers: list[str] = arg(lambda: ["*"], 'CORS headers, a JSON list (default ["*"])')
    allow_credentials: bool = arg(False, "CORS credentials")
    generation_config: str = arg(
        "auto", "sampling defaults of requests that leave temperature/top_p/top_k out: auto "
        "(the model's generation_config.json), vllm (OpenAI's: temperature 1), or a "
        "directory holding a generation_config.json")
    chat_template: str | None = arg(
        None, "a Jinja chat template, or a file holding one, instead of the tokenizer's")
    seed: int = arg(0, "seeds the sampling of requests that bring no seed")

    def __post_init__(self) -> None:
        if not self.model or not isinstance(self.model, str):
            raise ValueError("model (the target checkpoint directory) is required")
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
        """The engine's settings: every EngineConfig field these args share by name, left at
        the engine's default where the arg is None; the paths resolved, the block size and
        dtype derived."""
        mine = {f.name for f in fields(ServeArgs)}
        shared = {f.name: getattr(self, f.name) for f in fields(EngineConfig)
                  if f.name in mine and getattr(self, f.name) is not None}
        return EngineConfig(**{
            **shared,
            "model": _resolve_path(self.model),
            "draft_model": _resolve_path(self.draft_model) if self.draft_model else None,
            "block_size": self.block_size,
            "dtype": self.dtype or ("bfloat16" if self.on_gpu else "float32"),
        })


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
        app = build_app(self.client, self.tokenizer, shutdown_client=True,
                        max_request_bytes=self.args.max_request_bytes,
                        options=self.args.api_options(), defaults=self.defaults)
        # /metrics' series, also in Ray's metrics export: totals across replicas.
        self.ray_metrics = RayMetricsExport(app.state.metrics.registry, self.client.refresh)
        self.ray_metrics.start()
        return app

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
