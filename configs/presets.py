"""Architectures by name, as `config.json` dicts, for building models with random weights
(benchmarks on the real shapes without downloading a checkpoint).

`qwen3.5-35b-a3b`: the target's text config as the published checkpoint's `config.json`
holds it. `qwen3.5-35b-a3b-dflash`: the first published revision of its DFlash
draft (8 full-attention layers, 4 kv heads, mask 248070, aux layers [1, 10, 19, 28, 37]);
its attention head count, head dim and MLP width were not available when this was written and
are ASSUMED here (Qwen3-8B's: 32 heads of 128, intermediate 12288 → we use 6144, the width
DFlash drafts of 2048-wide targets use); benchmark a real draft with `--draft-model DIR`.
`tiny`: a CPU-sized model of the same family for smoke runs."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

_QWEN35_TEXT: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 40,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 2,
    "head_dim": 256,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                        "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "max_position_embeddings": 262144,
}

_QWEN35_DRAFT: dict[str, Any] = {
    "architectures": ["DFlashDraftModel"],
    "vocab_size": 248320,
    "hidden_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 32,  # assumed
    "num_key_value_heads": 4,
    "head_dim": 128,  # assumed
    "intermediate_size": 6144,  # assumed
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e7},
    "max_position_embeddings": 262144,
    "tie_word_embeddings": False,
    "num_target_layers": 40,
    "dflash_config": {"block_size": 16, "mask_token_id": 248070,
                      "target_layer_ids": [1, 10, 19, 28, 37]},
}

_TINY_TEXT: dict[str, Any] = {
    **_QWEN35_TEXT,
    "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
    "head_dim": 16, "linear_num_key_heads": 4, "linear_num_value_heads": 8,
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32,
    "max_position_embeddings": 4096,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
}

_TINY_DRAFT: dict[str, Any] = {
    **_QWEN35_DRAFT,
    "vocab_size": 512, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128,
    "max_position_embeddings": 4096, "num_target_layers": 8,
    "dflash_config": {"block_size": 16, "mask_token_id": 500, "target_layer_ids": [1, 6]},
}

TARGETS = {"qwen3.5-35b-a3b": _QWEN35_TEXT, "tiny": _TINY_TEXT}
DRAFTS = {"qwen3.5-35b-a3b": _QWEN35_DRAFT, "tiny": _TINY_DRAFT}


def target_preset(name: str) -> dict[str, Any]:
    if name not in TARGETS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(TARGETS)}")
    return dict(TARGETS[name])


def draft_preset(name: str) -> dict[str, Any]:
    if name not in DRAFTS:
        raise ValueError(f"unknown preset {name!r}; known: {sorted(DRAFTS)}")
    return dict(DRAFTS[name])


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def write_preset_dirs(name: str, root: Path, tokenizer_from: Path | None = None
                      ) -> tuple[Path, Path]:
    """root/target and root/draft holding the preset's config.json files, to load with
    `load_format="dummy"`; with `tokenizer_from`, the target gets that directory's tokenizer
    files (text prompts; its vocabulary need only fit the preset's)."""
    dirs = []
    for kind, raw in (("target", target_preset(name)), ("draft", draft_preset(name))):
        d = root / kind
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(raw))
        dirs.append(d)
    if tokenizer_from is not None:
        for f in TOKENIZER_FILES:
            if (tokenizer_from / f).is_file():
                shutil.copy(tokenizer_from / f, dirs[0] / f)
    return dirs[0], dirs[1]


if __name__ == "__main__":  # python -m configs.presets NAME ROOT [--tokenizer-from DIR]
    p = argparse.ArgumentParser(description=write_preset_dirs.__doc__.split("\n")[0])
    p.add_argument("name", choices=sorted(TARGETS))
    p.add_argument("root", type=Path)
    p.add_argument("--tokenizer-from", type=Path)
    a = p.parse_args()
    print(*write_preset_dirs(a.name, a.root, a.tokenizer_from))
