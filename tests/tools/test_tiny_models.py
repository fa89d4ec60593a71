import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from tools import tiny_models as tm  # `tiny_models` is the fixture

H, E, I, L = 64, 8, 32, 8  # hidden, experts, expert intermediate, layers  # noqa: E741
MASK_ID = tm.special_token_ids()["<|mask|>"]


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


# --------------------------------------------------------------------------------------------
# Determinism
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, write",
    [
        ("target", lambda d: tm.write_tiny_target(d)),
        ("target-published", lambda d: tm.write_tiny_target(d, "published", 2)),
        ("draft-swa", lambda d: tm.write_tiny_draft(d, "swa")),
    ],
)
def test_writing_twice_gives_identical_bytes(tiny_models, tmp_path, name, write):
    write(tmp_path)
    first = sorted(p.name for p in (tiny_models / name).iterdir())
    assert first == sorted(p.name for p in tmp_path.iterdir())
    for fname in first:
        assert (tiny_models / name / fname).read_bytes() == (tmp_path / fname).read_bytes(), fname


# --------------------------------------------------------------------------------------------
# Target, per-expert layout (save_pretrained's own output)
# --------------------------------------------------------------------------------------------


def test_per_expert_layout_keys(tiny_models):
    sd = _tensors(tiny_models / "target")
    assert f"model.layers.0.mlp.experts.{E - 1}.gate_proj.weight" in sd
    assert sd["model.layers.0.mlp.experts.0.gate_proj.weight"].shape == (I, H)
    assert sd["model.layers.0.mlp.experts.0.down_proj.weight"].shape == (H, I)
    assert not any(k.endswith(("gate_up_proj", "experts.down_proj")) for k in sd)
    assert "model.layers.3.self_attn.q_proj.weight" in sd  # (i + 1) % 4 == 0: full attention
    assert "model.layers.0.linear_attn.in_proj_qkv.weight" in sd
    assert {k.split(".")[0] for k in sd} == {"model", "lm_head"}
    bf16 = _tensors(tiny_models / "target-bf16")
    assert bf16.keys() == sd.keys()
    assert all(t.dtype == torch.bfloat16 for t in bf16.values())


def test_target_loads_in_transformers_with_peaked_logits(tiny_models):
    from transformers import Qwen3_5MoeForCausalLM

    model, info = Qwen3_5MoeForCausalLM.from_pretrained(
        tiny_models / "target", output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"]
    config = model.config
    assert config.layer_types[3] == config.layer_types[7] == "full_attention"
    assert config.vocab_size == 384 and config.eos_token_id == tm.special_token_ids()["<|im_end|>"]
    norms = [p for n, p in model.named_parameters() if n.endswith("input_layernorm.weight")]
    assert all(0 < p.abs().mean() < 0.5 for p in norms)  # small, zero-centred, not zero

    ids = torch.randint(0, 316, (4, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    assert torch.isfinite(logits).all()
    top2 = logits.topk(2, dim=-1).values
    gap = (top2[..., 0] - top2[..., 1]).flatten()
    assert gap.median() > 0.3 and gap.min() > 1e-5
    assert logits.softmax(-1).amax(-1).median() > 0.2
    with torch.no_grad():
        out = model.generate(ids[:2, :8], max_new_tokens=24, do_sample=False, min_new_tokens=24)
    for row in out[:, 8:]:
        assert len(set(row.tolist())) >= 8  # greedy continuations are not a constant token


# --------------------------------------------------------------------------------------------
# Target, published layout
# --------------------------------------------------------------------------------------------


def test_published_layout(tiny_models):
    root = tiny_models / "target-published"
    config = json.loads((root / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5MoeForConditionalGeneration"]
    assert config["model_type"] == "qwen3_5_moe"
    assert config["text_config"]["model_type"] == "qwen3_5_moe_text"
    assert config["vision_config"]["model_type"] == "qwen3_5_moe_vision"

    index = json.loads((root / "model.safetensors.index.json").read_text())
    shards = sorted(root.glob("model-*.safetensors"))
    assert [p.name for p in shards] == [f"model-0000{k}-of-00002.safetensors" for k in (1, 2)]
    seen, total = {}, 0
    for shard in shards:
        with safe_open(str(shard), "pt") as f:
            for k in f.keys():
                seen[k] = shard.name
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    assert seen == index["weight_map"]
    assert index["metadata"]["total_size"] == total

    sd = _tensors(root)
    lm = "model.language_model.layers"
    assert sd[f"{lm}.0.mlp.experts.gate_up_proj"].shape == (E, 2 * I, H)
    assert sd[f"{lm}.0.mlp.experts.down_proj"].shape == (E, H, I)
    assert f"{lm}.0.linear_attn.in_proj_qkv.weight" in sd
    assert "lm_head.weight" in sd and "model.language_model.embed_tokens.weight" in sd
    assert not any(re.search(r"experts\.\d+\.", k) for k in sd)
    assert any(k.startswith("model.visual.") for k in sd)
    assert any(k.startswith("mtp.") for k in sd)
    text = {k for k in sd if not k.startswith(("model.visual.", "mtp."))}
    assert all(k == "lm_head.weight" or k.startswith("model.language_model.") for k in text)


def test_published_has_the_per_expert_numbers(tiny_models):
    fused, split = _tensors(tiny_models / "target-published"), _tensors(tiny_models / "target")
    for i in range(L):
        p, q = f"model.language_model.layers.{i}.mlp.experts", f"model.layers.{i}.mlp.experts"
        gate_up = torch.stack(
            [
                torch.cat([split[f"{q}.{e}.gate_proj.weight"], split[f"{q}.{e}.up_proj.weight"]])
                for e in range(E)
            ]
        )
        down = torch.stack([split[f"{q}.{e}.down_proj.weight"] for e in range(E)])
        assert torch.equal(fused[f"{p}.gate_up_proj"], gate_up)  # gate rows first
        assert torch.equal(fused[f"{p}.down_proj"], down)
    for k, t in split.items():
        if ".mlp.experts." not in k:
            assert torch.equal(fused[k.replace("model.", "model.language_model.", 1)], t), k


def test_published_bf16_keeps_a_log_fp32(tmp_path):
    tm.write_tiny_target(tmp_path, "published", num_shards=3, dtype=torch.bfloat16)
    sd = _tensors(tmp_path)
    assert len(list(tmp_path.glob("model-*-of-00003.safetensors"))) == 3
    a_log = [k for k in sd if k.endswith("A_log")]
    assert len(a_log) == 6
    for k, t in sd.items():
        assert t.dtype == (torch.float32 if k in a_log else torch.bfloat16), k


def test_transformers_reads_published_like_per_expert(tiny_models):
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeForConditionalGeneration

    published = Qwen3_5MoeForConditionalGeneration.from_pretrained(tiny_models / "target-published")
    per_expert = Qwen3_5MoeForCausalLM.from_pretrained(tiny_models / "target")
    ids = torch.randint(0, 316, (2, 20), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a = published(input_ids=ids, use_cache=False).logits
        b = per_expert(ids, use_cache=False).logits
    torch.testing.assert_close(a, b, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def test_tokenizer_round_trips_and_renders_qwen3_5s_template(tiny_models):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_models / "target")
    assert len(tok) == 326
    ids, tags = tm.special_token_ids(), tm.tag_token_ids()
    assert tok.convert_tokens_to_ids(list(ids)) == list(ids.values())
    assert tok.convert_tokens_to_ids(list(tags)) == list(tags.values())
    assert tok.eos_token_id == ids["<|im_end|>"] and tok.pad_token_id == ids["<|endoftext|>"]
    for text in ["Hello, world!", "  two  spaces\n\nand lines", "naïve café ☕ 12345", "x" * 50]:
        assert tok.decode(tok.encode(text)) == text
    # the tags are single tokens that decoding keeps, as in Qwen's tokenizer
    tagged = "<think>\nhm</think>\n\n<tool_call>\n<function=f>"
    assert tok.encode("</think>") == [tags["</think>"]]
    assert tok.decode(tok.encode(tagged), skip_special_tokens=True) == tagged
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    quiet = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                    enable_thinking=False)
    assert quiet.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    encoded = tok.apply_chat_template(messages, add_generation_prompt=True)["input_ids"]
    assert encoded[0] == ids["<|im_start|>"] and encoded.count(ids["<|im_end|>"]) == 2
    assert encoded[-2:] == [tags["<think>"], tok.encode("\n")[0]]


# --------------------------------------------------------------------------------------------
# Drafts
# --------------------------------------------------------------------------------------------


def test_drafts_reload_with_the_reference(tiny_models):
    from dflash.model import DFlashDraftModel

    full = json.loads((tiny_models / "draft-full" / "config.json").read_text())
    assert full["architectures"] == ["DFlashDraftModel"]
    assert full["dflash_config"] == {
        "block_size": 16,
        "mask_token_id": MASK_ID,
        "target_layer_ids": [1, 4, 7],
    }
    swa = json.loads((tiny_models / "draft-swa" / "config.json").read_text())
    assert swa["architectures"] == ["DFlashDraftModel"]
    assert swa["block_size"] == 16 and "block_size" not in swa["dflash_config"]
    assert swa["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert swa["sliding_window"] == 8 and swa["use_sliding_window"] is True

    for name, layers, kv, ids in (("full", 2, 2, [1, 4, 7]), ("swa", 3, 4, [1, 3, 5, 7])):
        draft = DFlashDraftModel.from_pretrained(tiny_models / f"draft-{name}")
        assert len(draft.layers) == layers and draft.config.num_key_value_heads == kv
        assert draft.target_layer_ids == ids and draft.block_size == 16
        assert draft.mask_token_id == MASK_ID and draft.config.num_target_layers == L
        ctx, block = torch.randn(1, 5, len(ids) * H), torch.randn(1, 16, H)
        with torch.no_grad():
            out = draft(
                position_ids=torch.arange(21)[None], noise_embedding=block, target_hidden=ctx
            )
        assert out.shape == (1, 16, H) and torch.isfinite(out).all()


# --------------------------------------------------------------------------------------------
# Committed demo pair
# --------------------------------------------------------------------------------------------


def test_demo_draft_predicts_the_demo_target(tiny_demo):
    from dflash.model import DFlashDraftModel
    from transformers import Qwen3_5MoeForCausalLM

    from tools.train_tiny_draft import TargetTap, greedy, make_prompts, speculative_greedy

    target_dir, draft_dir = tiny_demo
    target = Qwen3_5MoeForCausalLM.from_pretrained(target_dir).eval()
    draft = DFlashDraftModel.from_pretrained(draft_dir).eval()
    assert draft.mask_token_id == MASK_ID and draft.target_layer_ids == [1, 4, 7]
    tap = TargetTap(target, draft.target_layer_ids)
    prompts = make_prompts(1, 24, seed=123)[1:]  # a random-token and a ChatML prompt
    reference = greedy(target, prompts, 24)
    committed = []
    for i in range(len(prompts)):
        out, per_round = speculative_greedy(tap, draft, prompts[i : i + 1], 24, block_size=16)
        assert torch.equal(out[0], reference[i])
        committed += per_round
    assert sum(committed) / len(committed) > 2.0
