"""The safetensors loader and config parsing: both checkpoint layouts load to the same numbers,
dtype rules hold, and every broken checkpoint fails with a ValueError that names the culprit."""

from __future__ import annotations

import json
import re
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from configs.model import TargetConfig
from target.distributed import SINGLE, TPGroup
from target.loader import load_target

WEIGHTS = "model.safetensors"  # the per-expert checkpoint is one file (save_pretrained)


@pytest.fixture
def ckpt(tiny_models, tmp_path) -> Path:
    """A private copy of the per-expert target, free to break."""
    return Path(shutil.copytree(tiny_models / "target", tmp_path / "target"))


def edit_weights(model_dir: Path, edit) -> None:
    tensors = load_file(model_dir / WEIGHTS)
    edit(tensors)
    save_file(tensors, model_dir / WEIGHTS, metadata={"format": "pt"})


def edit_published(model_dir: Path, key: str, edit) -> None:
    """Edits the shard of a sharded checkpoint that holds `key`."""
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    shard = model_dir / index["weight_map"][key]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def edit_config(model_dir: Path, edit) -> None:
    path = model_dir / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def raises(message: str):
    return pytest.raises(ValueError, match=re.escape(message))


# --------------------------------------------------------------------------------------------
# Layouts and dtypes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tp", [SINGLE, TPGroup(rank=1, size=2)], ids=["tp1", "tp2-rank1"])
def test_published_and_per_expert_layouts_load_identically(tiny_models, tp):
    # Without process groups a rank can still load its shard: collectives only run in forward.
    fused = dict(load_target(tiny_models / "target-published", tp=tp).named_parameters())
    split = dict(load_target(tiny_models / "target", tp=tp).named_parameters())
    assert fused.keys() == split.keys()
    assert any(".mlp.experts.gate_up_proj" in name for name in fused)
    for name, param in fused.items():
        assert param.dtype == split[name].dtype, name
        assert torch.equal(param, split[name]), name


def read_text_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint (either layout), keyed like the text model's parameters."""
    out = {}
    for path in model_dir.glob("*.safetensors"):
        for key, tensor in load_file(path).items():
            out[key.replace("model.language_model.", "model.", 1)] = tensor
    return out


def test_bf16_checkpoint_keeps_gdn_decay_params_fp32(tiny_models):
    model = load_target(tiny_models / "target-bf16", dtype=torch.bfloat16)
    on_disk = read_text_tensors(tiny_models / "target-bf16")
    decay = {n: p for n, p in model.named_parameters() if n.endswith(("A_log", "dt_bias"))}
    assert len(decay) == 2 * len(model.config.linear_attention_layers)
    for name, param in model.named_parameters():
        if name in decay:
            assert param.dtype == torch.float32, name
            assert torch.equal(param, on_disk[name].float()), name
        else:
            assert param.dtype == torch.bfloat16, name


@pytest.mark.parametrize("tp", [SINGLE, TPGroup(rank=1, size=2)], ids=["tp1", "tp2-rank1"])
def test_moe_input_weights_load_into_one_tensor(tiny_models, tp):
    """The router, the shared expert's gate and its gate/up are row views of SparseMoE.in_proj
    (one GEMM per step): their loaders must have filled it, in that order; zero rows follow,
    up to a multiple of 8 (the GEMM's output rows 16-byte aligned in bf16)."""
    model = load_target(tiny_models / "target", tp=tp)
    for layer in model.model.layers:
        moe = layer.mlp
        parts = [moe.gate.weight, moe.shared_expert_gate.weight,
                 moe.shared_expert.gate_up_proj.weight]
        assert all(p.untyped_storage().data_ptr() == moe.in_proj.untyped_storage().data_ptr()
                   for p in parts)
        used = sum(moe.in_sizes)
        assert moe.in_proj.shape[0] % 8 == 0 and 0 <= moe.in_proj.shape[0] - used < 8
        assert torch.equal(moe.in_proj[:used], torch.cat(parts))
        assert moe.in_proj[:used].abs().sum(-1).ne(0).all()  # every row loaded
        assert not moe.in_proj[used:].any()


def test_moe_input_gemm_reads_the_unpadded_rows_for_one_token(tiny_models, monkeypatch):
    """A one-token step multiplies by the rows in use (cuBLAS's GEMV), a longer one by the
    padded tensor; a token's outputs are the same either way (fp32 on CPU)."""
    import target.layers.moe as moe_module

    moe = load_target(tiny_models / "target").model.layers[0].mlp
    seen, linear = [], moe_module.F.linear
    storage = moe.in_proj.untyped_storage().data_ptr()

    def record(x, w, *args):
        if w.untyped_storage().data_ptr() == storage:  # the input GEMM (not the experts')
            seen.append(w.shape[0])
        return linear(x, w, *args)

    monkeypatch.setattr(moe_module.F, "linear", record)
    x = torch.randn(3, moe.in_proj.shape[1], generator=torch.Generator().manual_seed(0))
    alone, batch = moe(x[:1]), moe(x)
    assert seen == [sum(moe.in_sizes), moe.in_proj.shape[0]] and seen[1] > seen[0]
    torch.testing.assert_close(alone[0], batch[0])


# --------------------------------------------------------------------------------------------
# Broken checkpoints → readable ValueErrors
# --------------------------------------------------------------------------------------------


def test_missing_model_dir(tmp_path):
    with raises(f"model directory {tmp_path / 'nope'} does not exist"):
        load_target(tmp_path / "nope")


def test_missing_config_json(ckpt):
    (ckpt / "config.json").unlink()
    with raises("has no config.json"):
        load_target(ckpt)


def test_config_json_not_json(ckpt):
    (ckpt / "config.json").write_text('{"vocab_size": 384,')
    with raises("config.json is not valid JSON"):
        load_target(ckpt)


def test_unknown_architecture(ckpt):
    edit_config(ckpt, lambda raw: raw.update(architectures=["LlamaForCausalLM"]))
    with pytest.raises(ValueError, match=r"LlamaForCausalLM.*not supported"):
        load_target(ckpt)


@pytest.mark.parametrize("field", ["num_experts", "linear_num_value_heads", "vocab_size"])
def test_missing_required_config_field(ckpt, field):
    edit_config(ckpt, lambda raw: raw.pop(field))
    with raises(f"config.json lacks the field '{field}'"):
        load_target(ckpt)


def test_no_safetensors_files(ckpt):
    (ckpt / WEIGHTS).unlink()
    with raises("has no *.safetensors files"):
        load_target(ckpt)


def test_index_names_a_missing_shard(tiny_models, tmp_path):
    ckpt = Path(shutil.copytree(tiny_models / "target-published", tmp_path / "published"))
    shard = sorted(ckpt.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with raises(f"names {shard.name}, which does not exist"):
        load_target(ckpt)


@pytest.mark.parametrize(
    "key, param",
    [
        ("model.layers.0.linear_attn.A_log", "model.layers.0.linear_attn.A_log"),
        # (loaded into in_proj's z rows: the message names the checkpoint tensor)
        ("model.layers.1.linear_attn.in_proj_z.weight",
         "model.layers.1.linear_attn.in_proj_z.weight"),
        ("model.layers.2.mlp.experts.5.up_proj.weight", "model.layers.2.mlp.experts.gate_up_proj"),
        ("model.layers.6.mlp.experts.0.down_proj.weight", "model.layers.6.mlp.experts.down_proj"),
        ("model.layers.3.self_attn.q_norm.weight", "model.layers.3.self_attn.q_norm.weight"),
        ("model.layers.5.mlp.shared_expert.up_proj.weight",
         "model.layers.5.mlp.shared_expert.gate_up_proj.weight"),
        ("lm_head.weight", "lm_head.weight"),
    ],
)
def test_missing_tensor_names_the_parameter(ckpt, key, param):
    edit_weights(ckpt, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=r"lacks tensors for: .*" + re.escape(param)):
        load_target(ckpt)


@pytest.mark.parametrize(
    "key, param",
    [
        ("model.language_model.layers.4.mlp.experts.down_proj",
         "model.layers.4.mlp.experts.down_proj"),
        ("model.language_model.layers.1.linear_attn.dt_bias", "model.layers.1.linear_attn.dt_bias"),
        ("model.language_model.embed_tokens.weight", "model.embed_tokens.weight"),
    ],
)
def test_published_missing_tensor_names_the_parameter(tiny_models, tmp_path, key, param):
    ckpt = Path(shutil.copytree(tiny_models / "target-published", tmp_path / "published"))
    edit_published(ckpt, key, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=r"lacks tensors for: .*" + re.escape(param)):
        load_target(ckpt)


@pytest.mark.parametrize("tp", [SINGLE, TPGroup(rank=1, size=2)], ids=["tp1", "tp2-rank1"])
@pytest.mark.parametrize(
    "key, bad_shape, good_shape",
    [
        ("model.language_model.layers.4.mlp.experts.gate_up_proj", (8, 32, 64), (8, 64, 64)),
        ("model.language_model.layers.4.mlp.experts.down_proj", (8, 64, 64), (8, 64, 32)),
        ("model.language_model.layers.4.mlp.experts.down_proj", (4, 64, 32), (8, 64, 32)),
    ],
)
def test_published_misshaped_fused_experts(tiny_models, tmp_path, tp, key, bad_shape, good_shape):
    ckpt = Path(shutil.copytree(tiny_models / "target-published", tmp_path / "published"))
    edit_published(ckpt, key, lambda t: t.__setitem__(key, torch.zeros(bad_shape)))
    message = f"checkpoint tensor {key} has shape {list(bad_shape)}, expected {list(good_shape)}"
    with raises(message):
        load_target(ckpt, tp=tp)


@pytest.mark.parametrize("tp", [SINGLE, TPGroup(rank=0, size=2)], ids=["tp1", "tp2-rank0"])
@pytest.mark.parametrize(
    "key, bad_shape, good_shape",
    [
        ("model.layers.3.self_attn.k_proj.weight", (48, 64), (32, 64)),
        ("model.layers.1.linear_attn.in_proj_qkv.weight", (256, 32), (256, 64)),
        ("model.layers.1.linear_attn.conv1d.weight", (512, 1, 4), (256, 1, 4)),
        ("model.layers.4.linear_attn.A_log", (16,), (8,)),
        ("model.layers.7.self_attn.o_proj.weight", (64, 128), (64, 64)),
        ("model.layers.0.mlp.experts.1.down_proj.weight", (64, 64), (64, 32)),
        ("model.layers.0.mlp.experts.1.gate_proj.weight", (16, 64), (32, 64)),
        ("model.layers.2.mlp.gate.weight", (4, 64), (8, 64)),
        ("model.embed_tokens.weight", (400, 64), (384, 64)),
        ("model.norm.weight", (65,), (64,)),
    ],
)
def test_misshaped_tensor_names_key_and_shapes(ckpt, tp, key, bad_shape, good_shape):
    # At tp 2 an oversized tensor still holds every slice rank 0 reads: only a full-shape check
    # catches it.
    edit_weights(ckpt, lambda t: t.__setitem__(key, torch.zeros(bad_shape)))
    message = f"checkpoint tensor {key} has shape {list(bad_shape)}, expected {list(good_shape)}"
    with raises(message):
        load_target(ckpt, tp=tp)


@pytest.mark.parametrize(
    "key",
    [
        "model.layers.1.linear_attn.bogus.weight",
        "model.layers.3.self_attn.q_proj.bias",
        "model.layers.5.mlp.experts.3.extra_proj.weight",
    ],
)
def test_unexpected_text_tensor_is_named(ckpt, key):
    edit_weights(ckpt, lambda t: t.__setitem__(key, torch.zeros(4)))
    with raises(f"tensor {key} matches no parameter"):
        load_target(ckpt)


def test_vision_and_mtp_tensors_are_skipped(tiny_models):
    index = json.loads((tiny_models / "target-published" / "model.safetensors.index.json")
                       .read_text())
    keys = index["weight_map"]
    assert any(k.startswith("model.visual.") for k in keys)
    assert any(k.startswith("mtp.") for k in keys)
    load_target(tiny_models / "target-published")  # would raise on an unmatched text key


@pytest.mark.parametrize(
    "tp, message",
    [
        (3, "tp=3 does not divide num_attention_heads=4"),
        (8, "tp=8 does not divide num_attention_heads=4"),
    ],
)
def test_check_tp_rejects_sizes_that_do_not_divide_heads(tiny_models, tp, message):
    cfg = TargetConfig.from_pretrained(tiny_models / "target")
    with raises(message):
        cfg.check_tp(tp)
    with raises(message):
        load_target(tiny_models / "target", tp=TPGroup(rank=0, size=tp))


def test_check_tp_kv_and_gdn_head_rules(tiny_models):
    cfg = TargetConfig.from_pretrained(tiny_models / "target")
    for tp in (1, 2, 4):  # 4 > 2 kv heads: replicated, allowed
        cfg.check_tp(tp)
    # Every other dim divisible by 6, so only the kv-head rule can fire.
    wide = replace(cfg, num_attention_heads=12, num_key_value_heads=4, linear_num_key_heads=6,
                   linear_num_value_heads=6, moe_intermediate_size=48,
                   shared_expert_intermediate_size=48)
    with raises("tp=6 and num_key_value_heads=4: one must divide the other"):
        wide.check_tp(6)
    gdn = replace(cfg, linear_num_key_heads=2, linear_num_value_heads=4)
    with raises("tp=4 does not divide linear_num_key_heads=2"):
        gdn.check_tp(4)


# --------------------------------------------------------------------------------------------
# Config parsing
# --------------------------------------------------------------------------------------------


def _flat(tiny_models) -> dict:
    return json.loads((tiny_models / "target" / "config.json").read_text())


def test_nested_text_config_equals_flat(tiny_models):
    flat = TargetConfig.from_pretrained(tiny_models / "target")
    nested = TargetConfig.from_pretrained(tiny_models / "target-published")
    assert nested == flat
    wrapped = {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
               "text_config": _flat(tiny_models)}
    assert TargetConfig.from_dict(wrapped) == flat


def test_rope_from_rope_parameters_or_legacy_fields(tiny_models):
    raw = _flat(tiny_models)
    reference = TargetConfig.from_dict(raw)
    assert (reference.rope_theta, reference.partial_rotary_factor) == (1e6, 0.25)
    assert reference.rotary_dim == 4

    legacy = {k: v for k, v in raw.items() if k != "rope_parameters"}
    legacy.update(rope_theta=1e6, partial_rotary_factor=0.25)
    assert TargetConfig.from_dict(legacy) == reference

    other = {**legacy, "rope_theta": 5e5, "partial_rotary_factor": 0.5}
    cfg = TargetConfig.from_dict(other)
    assert (cfg.rope_theta, cfg.partial_rotary_factor, cfg.rotary_dim) == (5e5, 0.5, 8)

    nested_other = {**raw, "rope_parameters": {"rope_type": "default", "rope_theta": 2e5,
                                               "partial_rotary_factor": 0.5}}
    cfg = TargetConfig.from_dict(nested_other)
    assert (cfg.rope_theta, cfg.rotary_dim) == (2e5, 8)


def test_layer_types_default_from_full_attention_interval(tiny_models):
    raw = _flat(tiny_models)
    reference = TargetConfig.from_dict(raw)
    assert reference.full_attention_layers == (3, 7)
    no_types = {k: v for k, v in raw.items() if k != "layer_types"}
    assert TargetConfig.from_dict(no_types) == reference  # interval defaults to 4
    assert TargetConfig.from_dict({**no_types, "full_attention_interval": 4}) == reference
    every_other = TargetConfig.from_dict({**no_types, "full_attention_interval": 2})
    assert every_other.full_attention_layers == (1, 3, 5, 7)
    assert every_other.linear_attention_layers == (0, 2, 4, 6)


def test_layer_types_must_match_num_layers(tiny_models):
    raw = {**_flat(tiny_models), "num_hidden_layers": 6}
    with raises("layer_types has 8 entries but num_hidden_layers is 6"):
        TargetConfig.from_dict(raw)


def test_loading_reports_its_progress_and_what_it_loaded(tmp_path):
    """Off a terminal (Ray actors' logs): a line per shard of a sharded checkpoint, then one
    summary line with the files, bytes, time and where the weights went."""
    import logging
    from pathlib import Path

    from target.loader import load_target
    from target.weights import ShardProgress

    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logger = logging.getLogger("target.weights")
    old_level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        demo = Path(__file__).resolve().parents[1] / "assets" / "tiny" / "target"
        load_target(demo)
        (summary,) = [line for line in lines if line.startswith("loaded")]
        assert f"loaded the target from {demo}: 1 file(s)" in summary
        assert "TP rank 0 of 1" in summary

        lines.clear()
        files = [tmp_path / f"model-0000{i}.safetensors" for i in (1, 2)]
        for f in files:
            f.write_bytes(b"x" * 1000)
        progress = ShardProgress("a test", files, "cpu")
        progress.shard_done(0)
        progress.shard_done(1)
        progress.finish()
        assert [line.split(" (")[0] for line in lines[:2]] == [
            "loading a test: shard 1/2", "loading a test: shard 2/2"]
        assert lines[2].startswith(f"loaded a test from {tmp_path}: 2 file(s)")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
