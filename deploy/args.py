"""The application's args (`ServeArgs`): the Serve YAML's `args:`, the CLI's `serve` flags
(generated from the fields) and, by name, the engine's settings. Validated once: what needs no
file when they are made; what reads the checkpoints (`check_files`) where those are."""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from configs.engine import EngineConfig
from configs.hub import is_hub_id, resolve_model
from configs.model import TargetConfig
from deploy.openai_api import ApiOptions
from deploy.protocol import (
    DEFAULT_MAX_REQUEST_BYTES,
    DEFAULT_SHUTDOWN_GRACE_S,
    SamplingDefaults,
    load_sampling_defaults,
)
from deploy.tokenizer import chat_template_text
from deploy.tool_calls import ChatParsing
from target.kernels import selection

REPO = Path(__file__).resolve().parents[1]
# Old names of application args, still read from a YAML's `args:` (old → new).
RENAMED_ARGS = {"kv_block_size": "page_size", "num_kv_blocks": "num_pages"}


_TRUE, _FALSE = ("true", "1", "yes"), ("false", "0", "no")


def parse_arg(name: str, type_: str, value):
    """An application arg given as a string (`serve run deploy.app:app_builder tp=2` passes
    every value so) read by its field's type; a typed value (the YAML's) as it is. ValueError
    naming the field and the type expected."""
    if not isinstance(value, str) or type_ in ("str", "str | None"):
        return value
    text = value.strip()
    if type_.endswith("| None") and text.lower() in ("none", "null"):
        return None
    base = type_.removesuffix(" | None")
    try:
        if base == "int":
            return int(text)
        if base == "float":
            return float(text)
        if base == "bool":
            if text.lower() in _TRUE + _FALSE:
                return text.lower() in _TRUE
            raise ValueError
        if base in ("list[str]", "dict"):
            parsed = json.loads(text)
            if isinstance(parsed, list if base == "list[str]" else dict):
                return parsed
            raise ValueError
    except ValueError:
        expected = {"bool": "a boolean (true/false, 1/0, yes/no)",
                    "list[str]": 'a JSON list of strings such as \'["*"]\'',
                    "dict": "a JSON object", "int": "an integer", "float": "a number"}[base]
        none = " or none" if type_.endswith("| None") else ""
        raise ValueError(f"{name} must be {expected}{none}, got {value!r}") from None
    return value


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

    model: str = arg(None, "target checkpoint: a directory or a Hugging Face id (org/name)",
                     required=True)
    draft_model: str | None = arg(
        None, "DFlash draft checkpoint: a directory or a Hugging Face id (none: plain decoding)",
        "--speculative-draft-model", "--speculative-draft-model-path")
    revision: str | None = arg(
        None, "the model's Hub revision when it is an id: a branch, tag or commit (default main)")
    draft_revision: str | None = arg(
        None, "the draft's Hub revision when it is an id (default main)",
        "--speculative-draft-model-revision")
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
    served_model_name: str | None = arg(
        None, "the API's model id (default: the model's Hub id, or its directory's name)")
    max_num_seqs: int = arg(64, "sequences decoded together")
    max_model_len: int | None = arg(None, "context length (default: the model's)")
    allow_long_max_model_len: bool = arg(
        False, "allow a --max-model-len above the model's max_position_embeddings (as vLLM's "
        "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1; past it, outputs may be garbage)")
    max_num_batched_tokens: int | None = arg(
        None, "prompt tokens one prefill step feeds (default 8192)")
    page_size: int = arg(16, "tokens per KV page", "--block-size", "--kv-block-size")
    num_pages: int | None = arg(None, "KV pages (default: measured from free GPU memory)",
                                "--num-kv-blocks")
    gpu_memory_utilization: float = arg(
        0.9, "share of each GPU for weights, activations and the KV cache")
    enable_prefix_caching: bool = arg(
        True, "reuse the KV pages and Gated DeltaNet state of prompt prefixes earlier requests "
        "computed (--no-enable-prefix-caching: off)")
    prefix_cache_state_gb: float | None = arg(
        None, "GiB per GPU for the prefix cache's state snapshots (default: a tenth of the memory "
        "left for caches; on CPU 4 x max-num-seqs snapshots)")
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
    moe_backend: str = arg(
        "auto", "the routed experts' kernel: auto (on CUDA Triton GEMVs per token-expert pair "
        "for the smallest steps, sorted-pair block GEMMs for verify rounds and short chunks, "
        "grouped GEMMs for long prefill chunks; on CPU a loop over experts), or one of pairs, "
        "sorted, grouped, gathered, reference for every step")
    kernel_overrides: str = arg(
        "", "the other kernel choices as field=value[,…] (moe_routing, gdn_recurrence, "
        "gdn_prologue, attention_prologue, pdl, penalties, gdn_rounds; docs/DEPLOYMENT.md): "
        "to compare a variant with the defaults; empty: the defaults")
    speculative_adaptive: bool = arg(
        False, "with a draft: pick each round's draft length (B - 1, 7, 3 or none) for the "
        "batch from the sequences' recent acceptance and round costs measured at start-up "
        "(off: B - 1 every round)")
    acceptance_replay: str | None = arg(
        None, "benchmarks only, with a draft: replace the draft's proposals by the target's "
        "own output recorded from an earlier request with the same prompt, accepted as far as "
        "a mean acceptance length (e.g. 6.3) or a JSON list of per-position acceptance "
        "probabilities draws; outputs are unchanged, the speed becomes that acceptance's "
        "(greedy requests; send each prompt twice)")
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
    trust_request_chat_template: bool = arg(
        False, "let requests bring their own chat template (chat_template); by default only "
        "the server's is rendered")
    seed: int = arg(0, "seeds the sampling of requests that bring no seed")
    reasoning_parser: str | None = arg(
        None, "split chat responses' reasoning into reasoning_content: qwen3 (Qwen3 and "
        "Qwen3.5's <think>…</think>); structured outputs then start after the reasoning")
    enable_auto_tool_choice: bool = arg(
        False, 'let the model decide to call tools (tool_choice "auto", the default with '
        "tools); needs tool_call_parser")
    tool_call_parser: str | None = arg(
        None, "read the model's tool calls into tool_calls: qwen3_coder (Qwen3.5's XML form) "
        "or hermes (Qwen3's JSON in <tool_call>)")

    def __post_init__(self) -> None:
        if not self.model or not isinstance(self.model, str):
            raise ValueError("model (the target checkpoint: a directory or a Hugging Face id) "
                             "is required")
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
        self.chat_parsing()  # known parsers; auto tool choice with one
        if self.speculative_config is not None:
            self._merge_speculative_config(self.speculative_config)
        if self.dtype == "auto":
            object.__setattr__(self, "dtype", None)
        algo = self.speculative_algorithm
        if algo is not None and algo.lower() != "dflash":
            raise ValueError(f"speculative_algorithm must be 'dflash', got {algo!r}")
        if algo is not None and not self.draft_model:
            raise ValueError("speculative_algorithm 'dflash' needs draft_model")
        for name in ("revision", "draft_revision"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"{name} must be a non-empty string (a branch, tag or commit) "
                                 f"or null, got {value!r}")
        if self.draft_revision is not None and not self.draft_model:
            raise ValueError("draft_revision needs draft_model")
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
        unknown = sorted(set(spec) - {"method", "model", "num_speculative_tokens", "revision"})
        if unknown:
            raise ValueError(f"speculative_config: unsupported keys {unknown} (known: method, "
                             f"model, num_speculative_tokens, revision)")
        for key, name in (("method", "speculative_algorithm"), ("model", "draft_model"),
                          ("num_speculative_tokens", "speculative_num_draft_tokens"),
                          ("revision", "draft_revision")):
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

    def check_draft_block(self, draft_dir: str | None = None) -> None:
        """Refuses a K (speculative_num_draft_tokens) whose block B = K + 1 is larger than the
        one the draft was trained for: SGLang's flag of the same name counts B, so its users'
        K is one too many. `draft_dir`: the draft's directory (default: resolved here)."""
        k = self.speculative_num_draft_tokens
        if k is None or not self.draft_model or self.speculative_dflash_block_size is not None:
            return
        from draft.config import DraftConfig

        draft_dir = draft_dir or resolve_model(self.draft_model, "draft_model",
                                               self.draft_revision, relative_to=REPO)
        trained = DraftConfig.from_pretrained(draft_dir).block_size
        if k + 1 > trained:
            raise ValueError(
                f"speculative_num_draft_tokens {k} makes verify blocks of {k + 1}, but the draft "
                f"was trained for blocks of {trained}. Here K counts only the proposed tokens "
                f"(B = K + 1, as vLLM's num_speculative_tokens); SGLang's "
                f"--speculative-num-draft-tokens counts B. Pass {trained - 1}, or "
                f"--speculative-dflash-block-size {trained}")

    @classmethod
    def from_dict(cls, args: dict) -> ServeArgs:
        args = dict(args)
        for old, new in RENAMED_ARGS.items():  # a YAML written for an older release
            if old in args:
                if new in args:
                    raise ValueError(f"{old} is the old name of {new}: give only {new}")
                args[new] = args.pop(old)
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(args) - names)
        if unknown:
            raise ValueError(f"unknown application args {unknown}; known: {sorted(names)}")
        if "model" not in args:
            raise ValueError("application args need 'model' (the target checkpoint: a "
                             "directory or a Hugging Face id)")
        types = {f.name: f.type for f in fields(cls)}
        return cls(**{k: parse_arg(k, types[k], v) for k, v in args.items()})

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
        # vLLM's default: the id as given; a directory by its name. Decided by the spelling
        # alone, so the head and every replica agree whatever each has on disk.
        if self.served_model_name:
            return self.served_model_name
        return self.model if is_hub_id(self.model) else Path(self.model).name

    def chat_parsing(self) -> ChatParsing:
        return ChatParsing(self.reasoning_parser, self.enable_auto_tool_choice,
                           self.tool_call_parser)

    def api_options(self) -> ApiOptions:
        return ApiOptions(api_key=self.api_key, allowed_origins=tuple(self.allowed_origins),
                          allowed_methods=tuple(self.allowed_methods),
                          allowed_headers=tuple(self.allowed_headers),
                          allow_credentials=self.allow_credentials,
                          trust_request_chat_template=self.trust_request_chat_template)

    def model_dirs(self, download: bool = True) -> tuple[str, str | None] | None:
        """The target's and the draft's checkpoint directories on this machine (relative paths
        from the working directory, else the repository: Serve replicas do not run where `serve
        run` was started). Hub ids come from the Hugging Face cache: with `download`, fetched
        into it if missing (ValueError if that cannot be done); without, None unless both are
        here already."""
        model = resolve_model(self.model, "model", self.revision, relative_to=REPO,
                              download=download)
        draft = None
        if self.draft_model:
            draft = resolve_model(self.draft_model, "draft_model", self.draft_revision,
                                  relative_to=REPO, download=download)
            if draft is None:
                return None
        return None if model is None else (model, draft)

    def engine_config(self, dirs: tuple[str, str | None] | None = None) -> EngineConfig:
        """The engine's settings: every EngineConfig field these args share by name, left at
        the engine's default where the arg is None; the block size and dtype derived. `dirs`:
        the checkpoint directories (default: `model_dirs()`, which downloads hub ids). A
        Triton kernel asked for where it cannot run fails here too, in `serve run`."""
        model, draft = dirs or self.model_dirs()
        mine = {f.name for f in fields(ServeArgs)}
        shared = {f.name: getattr(self, f.name) for f in fields(EngineConfig)
                  if f.name in mine and getattr(self, f.name) is not None}
        replay = shared.get("acceptance_replay")
        if replay is not None and Path(replay).is_file():  # read in the draft's actor, cwd apart
            shared["acceptance_replay"] = str(Path(replay).resolve())
        cfg = EngineConfig(**{
            **shared,
            "model": model,
            "draft_model": draft,
            "block_size": self.block_size,
            "dtype": self.dtype or ("bfloat16" if self.on_gpu else "float32"),
        })
        selection.check(cfg.kernels, cfg.device)
        return cfg

    def check_files(self, cfg: EngineConfig) -> SamplingDefaults:
        """The checks that read the checkpoints' files (`cfg`'s directories): the target's
        config.json against `tp` and `max_model_len`, K against the draft's trained block, the
        chat template, generation_config.json; returns the sampling defaults. ValueError naming
        the file."""
        from cluster.startup import resolve_max_model_len

        target = TargetConfig.from_pretrained(cfg.model)
        target.check_tp(self.tp)
        resolve_max_model_len(cfg, target)  # max_model_len within the model's context
        self.check_draft_block(cfg.draft_model)
        chat_template_text(self.chat_template)
        return load_sampling_defaults(self.generation_config, cfg.model)
