"""DraftConfig parsing (nested/top-level, fallbacks, reference parity) and validation errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from dflash.model import DFlashDraftModel as RefDraft
from dflash.model import build_target_layer_ids as ref_build_ids
from transformers import Qwen3Config

from configs.model import TargetConfig
from draft.attention import rope_inv_freq
from draft.config import DraftConfig, build_target_layer_ids


def _raw(**over) -> dict:
    raw = {
        "architectures": ["DFlashDraftModel"],
        "model_type": "qwen3",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "vocab_size": 384,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e6},
        "num_target_layers": 8,
        "dflash_config": {"block_size": 16, "mask_token_id": 380, "target_layer_ids": [1, 6]},
    }
    raw.update(over)
    return raw


def _target(**over) -> TargetConfig:
    fields = dict(
        vocab_size=384, hidden_size=64, num_hidden_layers=8,
        layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention")
        * 2,
        rms_norm_eps=1e-6, tie_word_embeddings=False, max_position_embeddings=4096,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=1e7,
        partial_rotary_factor=0.25, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
    )
    fields.update(over)
    if fields["num_hidden_layers"] != 8:
        fields["layer_types"] = ("linear_attention",) * fields["num_hidden_layers"]
    return TargetConfig(**fields)


def test_nested_fields_win_over_top_level():
    raw = _raw(block_size=4, mask_token_id=7)
    raw["dflash_config"]["block_size"] = 8
    cfg = DraftConfig.from_dict(raw)
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_draft_tokens) == (8, 380, 7)


def test_top_level_fallback_and_defaults():
    raw = _raw(block_size=12, mask_token_id=9, target_layer_ids=[0, 7])
    raw["dflash_config"] = {}
    cfg = DraftConfig.from_dict(raw)
    assert (cfg.block_size, cfg.mask_token_id, cfg.target_layer_ids) == (12, 9, (0, 7))
    assert (cfg.input_embedding_scale, cfg.output_multiplier) == (1.0, 1.0)
    assert cfg.final_logit_softcapping is None and cfg.sliding_window is None
    assert cfg.layer_types == ("full_attention",) * 2 and cfg.layer_causal == (False, False)


def test_missing_mask_token_id_is_an_error():
    raw = _raw()
    del raw["dflash_config"]["mask_token_id"]
    with pytest.raises(ValueError, match="mask_token_id"):
        DraftConfig.from_dict(raw)


@pytest.mark.parametrize("layers,draft_layers", [(40, 5), (40, 8), (41, 6), (10, 3), (12, 1)])
def test_fallback_layer_ids_are_the_reference(layers, draft_layers):
    assert build_target_layer_ids(layers, draft_layers) == ref_build_ids(layers, draft_layers)
    raw = _raw(num_hidden_layers=draft_layers, num_target_layers=layers)
    del raw["dflash_config"]["target_layer_ids"]
    assert DraftConfig.from_dict(raw).target_layer_ids == tuple(ref_build_ids(layers, draft_layers))


def test_fallback_reproduces_published_ids():
    assert build_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]
    assert build_target_layer_ids(40, 8) == [1, 6, 11, 16, 22, 27, 32, 37]


SLIDING = ["sliding_attention", "full_attention", "sliding_attention"]
PARITY = {
    "default": {},
    "sliding": dict(layer_types=SLIDING, sliding_window=7, use_sliding_window=True),
    "sliding_flag_off": dict(layer_types=SLIDING, sliding_window=7),  # window dropped
    "causal_override": dict(is_causal=True),
    "noncausal_override": dict(layer_types=SLIDING, sliding_window=7, use_sliding_window=True,
                               is_causal=False),
    "derived_types": dict(use_sliding_window=True, sliding_window=9, max_window_layers=1),
    "no_head_dim": dict(head_dim=None),
    "legacy_rope": dict(rope_parameters=None, rope_theta=5e5),
}


@pytest.mark.parametrize("case", sorted(PARITY))
def test_attention_pattern_matches_reference(case):
    raw = _raw(num_hidden_layers=3, **PARITY[case])
    raw = {k: v for k, v in raw.items() if v is not None}
    cfg = DraftConfig.from_dict(raw)
    ref = RefDraft(Qwen3Config.from_dict(raw))
    attn = [layer.self_attn for layer in ref.layers]
    assert cfg.layer_causal == tuple(a.is_causal for a in attn)
    assert cfg.layer_windows == tuple(a.sliding_window for a in attn)
    assert cfg.head_dim == attn[0].head_dim
    assert torch.equal(rope_inv_freq(cfg.head_dim, cfg.rope_theta), ref.rotary_emb.inv_freq)


def test_non_default_rope_is_rejected():
    raw = _raw(rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0})
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        DraftConfig.from_dict(raw)


@pytest.mark.parametrize("archs", [["DFlash2DraftModel"], ["Qwen3ForCausalLM"], None])
def test_wrong_architecture(archs):
    with pytest.raises(ValueError, match="architectures"):
        DraftConfig.from_dict(_raw(architectures=archs))


def test_from_pretrained_errors_name_the_path(tmp_path):
    with pytest.raises(ValueError, match=str(tmp_path / "nope")):
        DraftConfig.from_pretrained(tmp_path / "nope")
    with pytest.raises(ValueError, match="config.json"):
        DraftConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match=str(tmp_path / "config.json")):
        DraftConfig.from_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_raw()))
    assert DraftConfig.from_pretrained(tmp_path).hidden_size == 64


def test_validate_against_accepts_matching_target():
    DraftConfig.from_dict(_raw()).validate_against(_target())


@pytest.mark.parametrize(
    "draft_over,target_over,pattern",
    [
        ({}, {"hidden_size": 128}, r"hidden_size is 64 but the target's is 128"),
        ({}, {"vocab_size": 500}, r"vocab_size is 384 but the target's is 500"),
        ({"num_target_layers": 6}, {}, r"num_target_layers is 6 but the target's is 8"),
        ({"target_layer_ids": [1, 8]}, {}, r"target_layer_ids \[1, 8\] hold \[8\]"),
        ({"target_layer_ids": [-1, 3]}, {}, r"target_layer_ids .* hold \[-1\]"),
        ({"mask_token_id": 384}, {}, r"mask_token_id 384 is not below the target's vocab_size"),
    ],
)
def test_validate_against_errors_name_the_field(draft_over, target_over, pattern):
    raw = _raw()
    for key in ("target_layer_ids", "mask_token_id"):
        if key in draft_over:
            raw["dflash_config"][key] = draft_over.pop(key)
    raw.update(draft_over)
    with pytest.raises(ValueError, match=pattern):
        DraftConfig.from_dict(raw).validate_against(_target(**target_over))


def test_block_size_override():
    cfg = DraftConfig.from_dict(_raw())
    small = cfg.with_block_size(4)
    assert (small.block_size, small.num_draft_tokens, cfg.block_size) == (4, 3, 16)
    assert cfg.with_block_size(64).num_draft_tokens == 63
    for bad in (1, 0, 65, 2.5, "8", True):
        with pytest.raises(ValueError, match="--speculative-dflash-block-size"):
            cfg.with_block_size(bad)
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.block_size = 3
