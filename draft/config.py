"""Typed view of a DFlash draft checkpoint's `config.json` (reference: `dflash` 0.1.0).

The reference builds a `transformers.Qwen3Config` and reads DFlash fields with
`dflash_config.get(name, getattr(config, name, default))`; the parsing below reproduces both,
including Qwen3Config's quirks (head_dim defaults to 128, `sliding_window` is dropped unless
`use_sliding_window` is true), so the draft sees exactly the attention pattern it was run with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from configs.model import TargetConfig, check_layer_types, read_config_json

DRAFT_ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
MAX_BLOCK_SIZE = 64
_MISSING = object()


@dataclass(frozen=True)
class DraftConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    attention_bias: bool
    vocab_size: int
    # DFlash fields (nested `dflash_config` first, then top level)
    block_size: int  # anchor + (block_size - 1) proposed tokens
    mask_token_id: int
    target_layer_ids: tuple[int, ...]  # aux = residual stream after each of these target layers
    num_target_layers: int
    layer_types: tuple[str, ...] = ()  # empty = all "full_attention"
    sliding_window: int | None = None  # window of the sliding layers; None = unwindowed
    is_causal: bool | None = None  # top-level override of every layer's causality
    input_embedding_scale: float = 1.0
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None  # None (or <= 0 in the JSON) = off

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full_attention",) * self.num_hidden_layers)
        check_layer_types(self.layer_types, self.num_hidden_layers, LAYER_TYPES)
        if "sliding_attention" not in self.layer_types:
            object.__setattr__(self, "sliding_window", None)
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {self.sliding_window}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty; the draft needs at least one aux layer")
        if not 2 <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size must be in [2, {MAX_BLOCK_SIZE}], got {self.block_size}")
        if self.mask_token_id < 0:
            raise ValueError(f"mask_token_id must be >= 0, got {self.mask_token_id}")
        if self.final_logit_softcapping is not None and self.final_logit_softcapping <= 0:
            object.__setattr__(self, "final_logit_softcapping", None)

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    @property
    def aux_hidden_size(self) -> int:
        return len(self.target_layer_ids) * self.hidden_size

    @property
    def layer_causal(self) -> tuple[bool, ...]:
        # reference: sliding layers causal, full layers non-causal, unless `is_causal` is set
        if self.is_causal is not None:
            return (self.is_causal,) * self.num_hidden_layers
        return tuple(t == "sliding_attention" for t in self.layer_types)

    @property
    def layer_windows(self) -> tuple[int | None, ...]:
        return tuple(
            self.sliding_window if t == "sliding_attention" else None for t in self.layer_types
        )

    def with_block_size(self, block_size: int) -> DraftConfig:
        if isinstance(block_size, bool) or not isinstance(block_size, int):
            raise ValueError(
                f"--speculative-dflash-block-size must be an integer, got {block_size!r}"
            )
        if not 2 <= block_size <= MAX_BLOCK_SIZE:
            raise ValueError(
                f"--speculative-dflash-block-size {block_size} is out of range: use a value in "
                f"[2, {MAX_BLOCK_SIZE}] (the draft proposes block size - 1 tokens per round; "
                f"this checkpoint was trained with {self.block_size})"
            )
        return dataclasses.replace(self, block_size=block_size)

    def validate_against(self, target: TargetConfig) -> None:
        pairs = (
            ("hidden_size", self.hidden_size, target.hidden_size),
            ("vocab_size", self.vocab_size, target.vocab_size),
            ("num_target_layers", self.num_target_layers, target.num_hidden_layers),
        )
        for name, mine, theirs in pairs:
            if mine != theirs:
                raise ValueError(
                    f"draft {name} is {mine} but the target's is {theirs}: this draft was "
                    f"trained for another target; use the DFlash draft made for this target"
                )
        bad = [i for i in self.target_layer_ids if not 0 <= i < target.num_hidden_layers]
        if bad:
            raise ValueError(
                f"draft target_layer_ids {list(self.target_layer_ids)} hold {bad}, outside "
                f"[0, {target.num_hidden_layers}) for a target with num_hidden_layers "
                f"{target.num_hidden_layers}: fix target_layer_ids in the draft's config.json"
            )
        if self.mask_token_id >= target.vocab_size:
            raise ValueError(
                f"draft mask_token_id {self.mask_token_id} is not below the target's vocab_size "
                f"{target.vocab_size}: set dflash_config.mask_token_id to the target "
                f"tokenizer's mask token"
            )

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json") -> DraftConfig:
        archs = raw.get("architectures") or []
        if DRAFT_ARCHITECTURE not in archs:
            raise ValueError(
                f"{source}: architectures {archs} does not contain {DRAFT_ARCHITECTURE!r}; "
                f"only DFlash drafts are supported (DFlash2DraftModel is not)"
            )
        nested = raw.get("dflash_config") or {}

        def dflash(name: str, default: Any = _MISSING) -> Any:
            value = nested.get(name, raw.get(name, default))
            if value is _MISSING:
                raise ValueError(f"{source} lacks {name!r} (in dflash_config or at top level)")
            return value

        def req(name: str) -> Any:
            if name not in raw:
                raise ValueError(f"{source} lacks the field {name!r}")
            return raw[name]

        n_layers = int(req("num_hidden_layers"))
        n_heads = int(req("num_attention_heads"))
        num_target_layers = int(dflash("num_target_layers"))
        ids = dflash("target_layer_ids", None)
        if ids is None:
            ids = build_target_layer_ids(num_target_layers, n_layers)

        # transformers Qwen3Config: sliding_window only counts with use_sliding_window
        window = raw.get("sliding_window", 4096) if raw.get("use_sliding_window", False) else None
        layer_types = raw.get("layer_types")
        if layer_types is None:
            first_sliding = raw.get("max_window_layers", 28)
            layer_types = [
                "sliding_attention" if window is not None and i >= first_sliding
                else "full_attention"
                for i in range(n_layers)
            ]

        rope = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"{source}: rope_type {rope_type!r} is not supported for the draft; only "
                f"'default' RoPE is implemented"
            )
        rope_theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported")
        softcap = dflash("final_logit_softcapping", None)
        is_causal = raw.get("is_causal")
        return cls(
            hidden_size=int(req("hidden_size")),
            num_hidden_layers=n_layers,
            num_attention_heads=n_heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or n_heads),
            head_dim=int(raw.get("head_dim") or 128),  # Qwen3Config's default, as the reference
            intermediate_size=int(req("intermediate_size")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            attention_bias=bool(raw.get("attention_bias", False)),
            vocab_size=int(req("vocab_size")),
            block_size=int(dflash("block_size", 16)),
            mask_token_id=int(dflash("mask_token_id")),
            target_layer_ids=tuple(int(i) for i in ids),
            num_target_layers=num_target_layers,
            layer_types=tuple(layer_types),
            sliding_window=None if window is None else int(window),
            is_causal=None if is_causal is None else bool(is_causal),
            input_embedding_scale=float(dflash("input_embedding_scale", 1.0)),
            output_multiplier=float(dflash("output_multiplier", 1.0)),
            final_logit_softcapping=None if softcap is None else float(softcap),
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> DraftConfig:
        raw = read_config_json(model_dir)
        return cls.from_dict(raw, source=str(Path(model_dir) / "config.json"))


def build_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    # the reference's fallback, Python's round() (half to even) included
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 4
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]
