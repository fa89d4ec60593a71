"""Typed view of a Qwen3.5-MoE target checkpoint's `config.json`.

Parsed once, validated once; model code reads these fields and never the raw JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

TARGET_ARCHITECTURES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM")
LAYER_TYPES = ("linear_attention", "full_attention")


@dataclass(frozen=True)
class TargetConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    layer_types: tuple[str, ...]  # "linear_attention" (Gated DeltaNet) | "full_attention"
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    # gated full attention
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_theta: float
    partial_rotary_factor: float
    # Gated DeltaNet
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    # MoE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    eos_token_ids: tuple[int, ...] = ()

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def full_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def linear_attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == "linear_attention")

    def __post_init__(self) -> None:
        check_layer_types(self.layer_types, self.num_hidden_layers, LAYER_TYPES)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError("num_experts_per_tok is larger than num_experts")
        if self.rotary_dim % 2 or not 0 < self.rotary_dim <= self.head_dim:
            raise ValueError(
                f"partial_rotary_factor {self.partial_rotary_factor} gives rotary dim "
                f"{self.rotary_dim} for head_dim {self.head_dim}; it must be even and in "
                "(0, head_dim]"
            )

    def check_tp(self, tp: int) -> None:
        """Raises ValueError when this model cannot be split over `tp` ranks."""
        need = {
            "num_attention_heads": self.num_attention_heads,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "moe_intermediate_size": self.moe_intermediate_size,
            "shared_expert_intermediate_size": self.shared_expert_intermediate_size,
        }
        for name, value in need.items():
            if value % tp:
                raise ValueError(f"tp={tp} does not divide {name}={value}")
        kv = self.num_key_value_heads
        if kv % tp and tp % kv:
            raise ValueError(f"tp={tp} and num_key_value_heads={kv}: one must divide the other")

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TargetConfig:
        text = raw.get("text_config", raw)
        rope = dict(text.get("rope_parameters") or text.get("rope_scaling") or {})
        rope_theta = rope.get("rope_theta", text.get("rope_theta", 10000.0))
        partial = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", 0.25))
        n_layers = _req(text, "num_hidden_layers")
        layer_types = text.get("layer_types")
        if layer_types is None:
            interval = text.get("full_attention_interval", 4)
            layer_types = [
                "full_attention" if (i + 1) % interval == 0 else "linear_attention"
                for i in range(n_layers)
            ]
        eos = text.get("eos_token_id", raw.get("eos_token_id"))
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        return cls(
            vocab_size=_req(text, "vocab_size"),
            hidden_size=_req(text, "hidden_size"),
            num_hidden_layers=n_layers,
            layer_types=tuple(layer_types),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            tie_word_embeddings=bool(
                text.get("tie_word_embeddings", raw.get("tie_word_embeddings", False))
            ),
            max_position_embeddings=int(text.get("max_position_embeddings", 32768)),
            num_attention_heads=_req(text, "num_attention_heads"),
            num_key_value_heads=_req(text, "num_key_value_heads"),
            head_dim=int(text.get("head_dim", 256)),
            rope_theta=float(rope_theta),
            partial_rotary_factor=float(partial),
            linear_num_key_heads=_req(text, "linear_num_key_heads"),
            linear_num_value_heads=_req(text, "linear_num_value_heads"),
            linear_key_head_dim=_req(text, "linear_key_head_dim"),
            linear_value_head_dim=_req(text, "linear_value_head_dim"),
            linear_conv_kernel_dim=int(text.get("linear_conv_kernel_dim", 4)),
            num_experts=_req(text, "num_experts"),
            num_experts_per_tok=_req(text, "num_experts_per_tok"),
            moe_intermediate_size=_req(text, "moe_intermediate_size"),
            shared_expert_intermediate_size=_req(text, "shared_expert_intermediate_size"),
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> TargetConfig:
        raw = read_config_json(model_dir)
        archs = raw.get("architectures") or []
        if archs and not any(a in TARGET_ARCHITECTURES for a in archs):
            raise ValueError(
                f"{model_dir}: architecture {archs} is not supported as a target; "
                f"expected one of {TARGET_ARCHITECTURES}"
            )
        try:
            return cls.from_dict(raw)
        except (TypeError, ValueError) as e:  # a field of the wrong type or value
            raise ValueError(f"{Path(model_dir) / 'config.json'}: {e}") from None


def check_layer_types(layer_types: tuple[str, ...], num_layers: int,
                      allowed: tuple[str, ...]) -> None:
    if len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types has {len(layer_types)} entries but num_hidden_layers is {num_layers}"
        )
    bad = sorted(set(layer_types) - set(allowed))
    if bad:
        raise ValueError(f"layer_types holds unsupported types {bad}; expected {allowed}")


def read_config_json(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if Path(model_dir).is_file():
        raise ValueError(f"{model_dir} is a file; a model is a directory (config.json and "
                         f"the weights)")
    if not Path(model_dir).is_dir():
        raise ValueError(f"model directory {model_dir} does not exist")
    if not path.is_file():
        raise ValueError(f"{model_dir} has no config.json")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e


def _req(d: dict[str, Any], key: str) -> int:
    """A required size: a positive integer (JSON true is not one)."""
    if key not in d:
        raise ValueError(f"config.json lacks the field {key!r}")
    value = d[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key} must be a positive integer, got {value!r}")
    return value
