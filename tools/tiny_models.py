"""Deterministic tiny checkpoints for tests, written by the real writers.

`python -m tools.tiny_models --out DIR` writes everything `write_all` does. Same library versions
and seed -> the same bytes. The layouts mirror the real ones: the per-expert layout is exactly
`Qwen3_5MoeForCausalLM.save_pretrained`; the published layout is that state dict rewritten the
way `Qwen/Qwen3.5-35B-A3B` ships (fused experts, `model.language_model.`, visual/mtp extras).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|mask|>"]
# Qwen3.5's tags for reasoning and tool calls: single tokens, but not special (decoding keeps
# them, as Qwen's tokenizer does), after the specials -> ids 320..325.
TAG_TOKENS = ["<tool_call>", "</tool_call>", "<think>", "</think>", "<tool_response>",
              "</tool_response>"]
BPE_VOCAB_SIZE = 316  # 256 byte symbols + 60 merges; then the 4 specials and the 6 tags
TARGET_VOCAB_SIZE = 384  # padded past the tokenizer, as real checkpoints are
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
TARGET_SEED = 1234
DRAFT_SEED = 4321

# Random-init scales (tuned so greedy continuations are varied, the top-1/top-2 logit gap is
# far above float noise, and a 2-layer draft can still learn the target; see README).
INITIALIZER_RANGE = 0.1  # ~unit gain for 64-wide projections: every block moves the logits
EMBED_STD = 4.0  # token identity survives the 8 layers: ~60% of greedy steps follow a bigram
LM_HEAD_STD = 0.6  # peaked: median top-1 prob ~0.5, median top-1/top-2 gap ~1
NORM_STD = 0.1  # zero-centred RMSNorm weights: (1 + w) bugs must show up
PADDED_ROW_SCALE = 0.1  # lm_head rows past the tokenizer: rarely argmax, as in real checkpoints

# Same pre-tokenizer regex as Qwen2Tokenizer, so `tokenizer_class: Qwen2Tokenizer` rebuilds
# exactly the tokenizer that tokenizer.json describes.
PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen3.5's published chat template, byte for byte (tests/assets/qwen3_5/README.md).
CHAT_TEMPLATE = (Path(__file__).parents[1] / "tests/assets/qwen3_5/chat_template.jinja"
                 ).read_text()

CORPUS = """\
The morning fog lifted slowly over the river, and the boats began to move again. A heron stood
in the shallow water near the bridge, waiting for a fish. On the far bank, a man was painting
his fence white, and a small dog watched him from the shade of an old oak tree.

To make bread, mix four cups of flour with a spoon of salt and a packet of yeast. Add two cups
of warm water and stir until the dough comes together. Knead it for ten minutes, then let it
rest in a warm place for one hour. Shape the loaf, bake it at 220 degrees for 35 minutes, and
let it cool before you cut it.

The library opens at nine in the morning and closes at six in the evening. Students come to
read, to write, and to think in the quiet rooms on the second floor. The oldest book in the
collection was printed in 1623, and it is kept in a glass case near the main stairs.

Trains leave the central station every fifteen minutes. The express to the coast takes two
hours and stops only twice. If you buy your ticket online, you can save a little money, but
remember to bring it with you, because the conductor will ask to see it.

In the garden, the tomatoes are ripe and the beans climb higher every day. We water the plants
early, before the sun is hot, and we pull the weeds on Saturday. The roses by the gate bloom
in June, and the apple tree gives more fruit than we can eat.

"Where are you going?" asked the girl. "To the market," said her brother. "We need eggs,
milk, and three lemons." She put on her coat and said, "Wait for me, I will come too." They
walked down the hill together, talking about the weather and the long summer ahead.

Numbers are useful for counting, measuring, and comparing. One plus one is two, two times
three is six, and ten divided by five is two. A year has 365 days, a week has 7 days, and a
day has 24 hours. The speed of sound in air is about 343 meters per second.

The city council met on Tuesday to discuss the new park. Some people wanted a playground,
others wanted a pond with ducks, and a few asked for more benches and trees. After a long
debate, they agreed to build all three, starting with the trees in the spring.

A good question is the start of a good answer. When you are not sure, ask, listen, and then
try again. Learning is slow at first, but each small step makes the next one easier, and
after a while you will see how far you have come.

The computer reads the input, runs the program, and writes the output. If the program has a
bug, the output may be wrong, so we write tests that check the results. A test that passes
today should still pass tomorrow, unless the code or the data has changed.
"""


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------


def build_tokenizer():
    from tokenizers import (
        AddedToken,
        Regex,
        Tokenizer,
        decoders,
        models,
        normalizers,
        pre_tokenizers,
        processors,
        trainers,
    )

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=BPE_VOCAB_SIZE,
        min_frequency=2,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    tok.train_from_iterator(CORPUS.split("\n\n"), trainer=trainer)
    # Specials after the BPE vocab, as in Qwen (ids 316..319).
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in TAG_TOKENS])
    assert tok.get_vocab_size() == BPE_VOCAB_SIZE + len(SPECIAL_TOKENS) + len(TAG_TOKENS)
    return tok


def special_token_ids() -> dict[str, int]:
    return {t: BPE_VOCAB_SIZE + i for i, t in enumerate(SPECIAL_TOKENS)}


def tag_token_ids() -> dict[str, int]:
    first = BPE_VOCAB_SIZE + len(SPECIAL_TOKENS)
    return {t: first + i for i, t in enumerate(TAG_TOKENS)}


def write_tokenizer(out_dir: str | Path) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    tok.save(str(out / "tokenizer.json"))
    ids = special_token_ids()
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": special,
            }
            for tokens, special in ((ids, True), (tag_token_ids(), False))
            for t, i in tokens.items()
        },
        "bos_token": None,
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 1024,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    _write_json(out / "tokenizer_config.json", config)


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n")


# --------------------------------------------------------------------------------------------
# Target
# --------------------------------------------------------------------------------------------


def tiny_target_text_config():
    from transformers import Qwen3_5MoeTextConfig

    ids = special_token_ids()
    return Qwen3_5MoeTextConfig(
        vocab_size=TARGET_VOCAB_SIZE,
        hidden_size=64,
        num_hidden_layers=8,  # full attention at 3 and 7: (i + 1) % 4 == 0
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e6,
            "partial_rotary_factor": 0.25,
            "mrope_section": [1, 1, 0],  # sums to rotary_dim / 2 = 2
            "mrope_interleaved": True,
        },
        linear_num_key_heads=4,
        linear_num_value_heads=8,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        initializer_range=INITIALIZER_RANGE,
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        bos_token_id=ids["<|endoftext|>"],
    )


ZERO_CENTRED_NORMS = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")


def build_tiny_target(seed: int = TARGET_SEED, dtype: torch.dtype = torch.float32):
    from transformers import Qwen3_5MoeForCausalLM

    config = tiny_target_text_config()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen3_5MoeForCausalLM(config)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(ZERO_CENTRED_NORMS):
                param.copy_(torch.randn(param.shape, generator=gen) * NORM_STD)  # (1 + w) norms
            elif name.endswith("linear_attn.norm.weight"):  # gated norm: plain w
                param.copy_(1 + torch.randn(param.shape, generator=gen) * NORM_STD)
            elif name.endswith("linear_attn.dt_bias"):  # all-ones would hide head mix-ups
                param.copy_(torch.rand(param.shape, generator=gen) * 2 - 1)
        emb = model.model.embed_tokens.weight
        emb.copy_(torch.randn(emb.shape, generator=gen) * EMBED_STD)
        head = model.lm_head.weight
        head.copy_(torch.randn(head.shape, generator=gen) * LM_HEAD_STD)
        head[BPE_VOCAB_SIZE + len(SPECIAL_TOKENS) :] *= PADDED_ROW_SCALE
    return model.to(dtype).eval()


def write_tiny_target(
    out_dir: str | Path,
    layout: str = "per_expert",
    num_shards: int = 1,
    dtype: torch.dtype = torch.float32,
    seed: int = TARGET_SEED,
) -> None:
    """`per_expert`: exactly `Qwen3_5MoeForCausalLM.save_pretrained` (keys under `model.`,
    `mlp.experts.{e}.{gate,up,down}_proj.weight`). `published`: the same numbers in the layout of
    `Qwen/Qwen3.5-35B-A3B` (see `_published_state_dict`)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model = build_tiny_target(seed)
    if layout == "per_expert":
        if num_shards != 1:
            raise ValueError("per_expert is save_pretrained's own output: use num_shards=1")
        model.to(dtype).save_pretrained(out)
    elif layout == "published":
        _write_published(model, out, num_shards, dtype, seed)
    else:
        raise ValueError(f"layout must be 'per_expert' or 'published', got {layout!r}")
    write_tokenizer(out)  # every target dir is self-contained, like a hub repo


def tiny_vision_config():
    from transformers import Qwen3_5MoeVisionConfig

    return Qwen3_5MoeVisionConfig(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        patch_size=4,
        spatial_merge_size=2,
        temporal_patch_size=2,
        out_hidden_size=64,  # = text hidden
        num_position_embeddings=16,
    )


# Vision/video ids live in the padded vocab range (no tokenizer entry), unused by text tests.
VISION_TOKEN_IDS = dict(
    vision_start_token_id=380, vision_end_token_id=381, image_token_id=382, video_token_id=383
)


def _published_state_dict(model, dtype: torch.dtype, seed: int) -> dict[str, torch.Tensor]:
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeVisionModel

    sd: dict[str, torch.Tensor] = {}
    # In memory transformers keeps experts fused exactly as the release stores them:
    # gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I], no ".weight".
    for name, tensor in model.state_dict().items():
        if name.startswith("model."):
            name = "model.language_model." + name[len("model.") :]
        keep_fp32 = name.endswith("linear_attn.A_log")  # the release keeps A_log in fp32
        sd[name] = tensor.to(torch.float32 if keep_fp32 else dtype).contiguous()
    # Real vision-tower keys (a loader must skip them), from a 1-block vision model.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 2)
        visual = Qwen3_5MoeVisionModel._from_config(tiny_vision_config())
    for name, tensor in visual.state_dict().items():
        sd["model.visual." + name] = tensor.to(dtype).contiguous()
    # MTP head keys as in the release (also skipped); fused experts here too, on purpose.
    h, i, e = model.config.hidden_size, model.config.moe_intermediate_size, model.config.num_experts
    gen = torch.Generator().manual_seed(seed + 3)
    mtp_shapes = {
        "mtp.fc.weight": (h, 2 * h),
        "mtp.norm.weight": (h,),
        "mtp.pre_fc_norm_embedding.weight": (h,),
        "mtp.pre_fc_norm_hidden.weight": (h,),
        "mtp.layers.0.input_layernorm.weight": (h,),
        "mtp.layers.0.self_attn.q_proj.weight": (2 * 4 * 16, h),
        "mtp.layers.0.mlp.gate.weight": (e, h),
        "mtp.layers.0.mlp.experts.gate_up_proj": (e, 2 * i, h),
        "mtp.layers.0.mlp.experts.down_proj": (e, h, i),
    }
    for name, shape in mtp_shapes.items():
        sd[name] = (torch.randn(shape, generator=gen) * 0.02).to(dtype)
    return sd


def _write_published(model, out: Path, num_shards: int, dtype: torch.dtype, seed: int) -> None:
    from transformers import Qwen3_5MoeConfig

    if num_shards < 1:
        raise ValueError("num_shards must be >= 1")
    sd = _published_state_dict(model, dtype, seed)
    names = sorted(sd)
    total = sum(t.numel() * t.element_size() for t in sd.values())
    # Contiguous runs of sorted names, cut at ~equal byte counts.
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    seen = 0
    for name in names:
        k = min(num_shards - 1, seen * num_shards // total)
        shards[k].append(name)
        seen += sd[name].numel() * sd[name].element_size()
    if any(not s for s in shards):
        raise ValueError(f"too many shards ({num_shards}) for {len(names)} tensors")
    weight_map = {}
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{num_shards:05d}.safetensors"
        save_file({n: sd[n] for n in shard}, str(out / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    _write_json(out / "model.safetensors.index.json", index)

    text = model.config.to_dict()
    config = Qwen3_5MoeConfig(
        text_config=text, vision_config=tiny_vision_config().to_dict(), **VISION_TOKEN_IDS
    ).to_diff_dict()  # the compact form save_pretrained writes
    config.update(architectures=["Qwen3_5MoeForConditionalGeneration"], dtype=_dtype_name(dtype))
    config["text_config"].update(
        dtype=_dtype_name(dtype), mtp_num_hidden_layers=1, mtp_use_dedicated_embeddings=False
    )
    config.pop("transformers_version", None)  # keep the bytes independent of the version
    _write_json(out / "config.json", config)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


# --------------------------------------------------------------------------------------------
# DFlash drafts
# --------------------------------------------------------------------------------------------

# The two published Qwen3.5-35B-A3B draft revisions, scaled down.
DRAFT_REVISIONS = {
    # 1st revision: all full attention; ids include the target's LAST layer on purpose.
    "full": dict(num_hidden_layers=2, num_key_value_heads=2, target_layer_ids=[1, 4, 7]),
    # 2nd revision: sliding-window layers + one full; block_size at the top level (older style).
    "swa": dict(
        num_hidden_layers=3,
        num_key_value_heads=4,
        target_layer_ids=[1, 3, 5, 7],
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        sliding_window=8,
        use_sliding_window=True,
    ),
}


def tiny_draft_config(revision: str = "full", block_size: int = 16):
    from transformers import Qwen3Config

    if revision not in DRAFT_REVISIONS:
        raise ValueError(f"revision must be one of {sorted(DRAFT_REVISIONS)}, got {revision!r}")
    spec = dict(DRAFT_REVISIONS[revision])
    target_layer_ids = spec.pop("target_layer_ids")
    config = Qwen3Config(
        vocab_size=TARGET_VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        max_position_embeddings=1024,
        tie_word_embeddings=False,
        **spec,
    )
    config.num_target_layers = tiny_target_text_config().num_hidden_layers
    config.dflash_config = {
        "block_size": block_size,
        "mask_token_id": special_token_ids()["<|mask|>"],
        "target_layer_ids": target_layer_ids,
    }
    return config


def build_tiny_draft(revision: str = "full", seed: int = DRAFT_SEED, block_size: int = 16):
    from dflash.model import DFlashDraftModel

    config = tiny_draft_config(revision, block_size)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return DFlashDraftModel(config).eval()


def save_draft(model, out_dir: str | Path, revision: str) -> None:
    out = Path(out_dir)
    model.save_pretrained(out)
    path = out / "config.json"
    config = json.loads(path.read_text())
    config["architectures"] = ["DFlashDraftModel"]
    if revision == "swa":  # older checkpoints keep block_size at the top level
        config["block_size"] = config["dflash_config"].pop("block_size")
    _write_json(path, config)


def write_tiny_draft(out_dir: str | Path, revision: str = "full", seed: int = DRAFT_SEED) -> None:
    save_draft(build_tiny_draft(revision, seed), out_dir, revision)


# --------------------------------------------------------------------------------------------


def write_all(out_dir: str | Path) -> dict[str, Path]:
    out = Path(out_dir)
    paths = {
        "target": out / "target",
        "target-published": out / "target-published",
        "target-bf16": out / "target-bf16",
        "draft-full": out / "draft-full",
        "draft-swa": out / "draft-swa",
    }
    write_tiny_target(paths["target"], "per_expert")
    write_tiny_target(paths["target-published"], "published", num_shards=2)
    write_tiny_target(paths["target-bf16"], "per_expert", dtype=torch.bfloat16)
    write_tiny_draft(paths["draft-full"], "full")
    write_tiny_draft(paths["draft-swa"], "swa")
    return paths


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Write the tiny test checkpoints.")
    parser.add_argument("--out", required=True, help="directory to create (e.g. .tiny)")
    args = parser.parse_args(argv)
    for name, path in write_all(args.out).items():
        print(f"{name}: {path}")


if __name__ == "__main__":
    main()
