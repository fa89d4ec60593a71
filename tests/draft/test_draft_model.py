"""The paged draft against the reference `dflash.model.DFlashDraftModel`, cache-free, in fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dflash.model import DFlashDraftModel as RefDraft
from torch.nn import functional as F
from transformers import Qwen3Config

from draft.model import DFlashDraftModel

VOCAB, HIDDEN, PAGE_SIZE, NUM_PAGES = 384, 64, 4, 40
CONTEXT_LENS = (3, 11, 23, 6)  # window 5: shorter and longer than it

REVISIONS = {
    # all full attention, dflash fields nested, explicit ids (one = last target layer)
    "full": dict(
        config=dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        num_target_layers=8,
        dflash={"block_size": 16, "mask_token_id": 380, "target_layer_ids": [1, 4, 7]},
        top={},
    ),
    # sliding + full, block_size top level, fallback ids, legacy top-level rope_theta,
    # embedding scale / output multiplier / softcap nested
    "sliding": dict(
        config=dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=16, sliding_window=5, use_sliding_window=True,
                    layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        num_target_layers=10,
        dflash={"mask_token_id": 383, "input_embedding_scale": 0.5, "output_multiplier": 2.0,
                "final_logit_softcapping": 3.0},
        top={"block_size": 8},
        legacy_rope=True,
    ),
    # published variant: `is_causal: false` makes the sliding layers bidirectionally windowed
    "sliding_noncausal": dict(
        config=dict(num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=4,
                    head_dim=16, sliding_window=5, use_sliding_window=True, is_causal=False,
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
        num_target_layers=6,
        dflash={"block_size": 16, "mask_token_id": 1, "target_layer_ids": [0, 5]},
        top={},
    ),
}


def _write_draft(root: Path, rev: dict, seed: int) -> RefDraft:
    torch.manual_seed(seed)
    config = Qwen3Config(hidden_size=HIDDEN, intermediate_size=128, vocab_size=VOCAB,
                         rms_norm_eps=1e-6, **rev["config"])
    config.num_target_layers = rev["num_target_layers"]
    config.dflash_config = dict(rev["dflash"])
    ref = RefDraft(config).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            # random norms (they default to ones) and weights big enough that layers matter
            p.copy_(1 + 0.3 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    ref.save_pretrained(root)
    path = root / "config.json"
    raw = json.loads(path.read_text())
    raw["architectures"] = ["DFlashDraftModel"]
    raw.update(rev["top"])
    if rev.get("legacy_rope"):  # older layout: rope_theta at the top level
        raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
    path.write_text(json.dumps(raw))
    return ref


@pytest.fixture(scope="module", params=sorted(REVISIONS))
def draft_pair(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    ref = _write_draft(root, REVISIONS[request.param], seed=len(request.param))
    ours = DFlashDraftModel.from_pretrained(root, dtype=torch.float32, device="cpu")
    return ref, ours, root


@pytest.fixture(scope="module")
def target_head():
    g = torch.Generator().manual_seed(7)
    embed_w = torch.randn(VOCAB, HIDDEN, generator=g)
    head_w = torch.randn(VOCAB, HIDDEN, generator=g) * 0.2
    return (lambda ids: F.embedding(ids, embed_w)), (lambda h: h @ head_w.T)


def _layout(seed: int):
    # random non-contiguous pages per sequence; unused table entries hold garbage
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(NUM_PAGES, generator=g)
    max_pages = 8
    tables = torch.full((len(CONTEXT_LENS), max_pages), 10**6, dtype=torch.int32)
    used = 0
    for s, n in enumerate(CONTEXT_LENS):
        pages = -(-n // PAGE_SIZE)
        tables[s, :pages] = perm[used: used + pages].to(torch.int32)
        used += pages
    return tables


def _slots(tables: torch.Tensor, s: int, positions: torch.Tensor) -> torch.Tensor:
    return tables[s].long()[positions // PAGE_SIZE] * PAGE_SIZE + positions % PAGE_SIZE


def _aux(ours: DFlashDraftModel, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, ours.cfg.aux_hidden_size, generator=g) for n in CONTEXT_LENS]


def _write_all(ours, aux, tables, rounds: int):
    """Context written in `rounds` increments; each call holds every sequence's new tokens."""
    cache = ours.allocate_kv_cache(NUM_PAGES, PAGE_SIZE)
    for r in range(rounds):
        feats, positions, slots = [], [], []
        for s, n in enumerate(CONTEXT_LENS):
            lo, hi = n * r // rounds, n * (r + 1) // rounds
            pos = torch.arange(lo, hi)
            feats.append(aux[s][lo:hi])
            positions.append(pos)
            slots.append(_slots(tables, s, pos))
        ours.write_context(torch.cat(feats), torch.cat(positions), torch.cat(slots), cache)
    return cache


def _reference_logits(ref, aux, anchors, embed, lm_head, block_size, scale):
    hidden, logits = [], []
    for s, n in enumerate(CONTEXT_LENS):
        ids = torch.full((1, block_size), ref.mask_token_id, dtype=torch.long)
        ids[0, 0] = anchors[s]
        out = ref(
            target_hidden=aux[s][None], noise_embedding=embed(ids) * scale,
            position_ids=torch.arange(n + block_size)[None], past_key_values=None,
        )
        hidden.append(out[0])
        logits.append(ref.compute_logits(out[:, 1:], lm_head)[0])
    return torch.stack(hidden), torch.stack(logits)


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("rounds", [1, 3])
@torch.inference_mode()
def test_block_matches_reference(draft_pair, target_head, block_size, rounds):
    ref, ours, _ = draft_pair
    embed, lm_head = target_head
    tables = _layout(block_size + rounds)
    aux = _aux(ours, seed=block_size)
    cache = _write_all(ours, aux, tables, rounds)
    anchors = torch.tensor([5, 17, 200, 383])
    lens = torch.tensor(CONTEXT_LENS, dtype=torch.int32)
    scale = ours.cfg.input_embedding_scale

    ids = torch.full((len(CONTEXT_LENS), block_size), ours.cfg.mask_token_id)
    ids[:, 0] = anchors
    hidden = ours.forward_block(embed(ids) * scale, lens, tables, cache)
    logits = ours.propose_logits(anchors, lens, tables, cache, embed, lm_head, block_size)
    ref_hidden, ref_logits = _reference_logits(ref, aux, anchors, embed, lm_head, block_size,
                                               scale)
    # fp32 throughout; ours and the reference sum attention in different orders (explicit
    # score matmuls + softmax vs the reference's SDPA), a few ulps apart after two layers
    torch.testing.assert_close(hidden, ref_hidden, atol=5e-5, rtol=5e-5)
    torch.testing.assert_close(logits, ref_logits, atol=5e-5, rtol=5e-5)
    tokens = ours.propose(anchors, lens, tables, cache, embed, lm_head, block_size)
    assert tokens.shape == (len(CONTEXT_LENS), block_size - 1) and tokens.dtype == torch.long
    assert torch.equal(tokens, ref_logits.argmax(-1))


@torch.inference_mode()
def test_incremental_context_equals_one_write(draft_pair):
    _, ours, _ = draft_pair
    tables = _layout(0)
    aux = _aux(ours, seed=1)
    once, rounds = _write_all(ours, aux, tables, 1), _write_all(ours, aux, tables, 4)
    for (k1, v1), (k4, v4) in zip(once, rounds, strict=True):
        torch.testing.assert_close(k1, k4, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(v1, v4, atol=1e-5, rtol=1e-5)


@torch.inference_mode()
def test_block_kv_is_not_written(draft_pair, target_head):
    _, ours, _ = draft_pair
    tables = _layout(2)
    cache = _write_all(ours, _aux(ours, seed=2), tables, 1)
    before = [(k.clone(), v.clone()) for k, v in cache]
    lens = torch.tensor(CONTEXT_LENS)
    ours.propose(torch.tensor([1, 2, 3, 4]), lens, tables, cache, *target_head)
    for (k0, v0), (k1, v1) in zip(before, cache, strict=True):
        assert torch.equal(k0, k1) and torch.equal(v0, v1)


def test_sharded_checkpoint_and_block_override(draft_pair):
    ref, ours, root = draft_pair
    sharded = root.parent / f"{root.name}-sharded"
    ref.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").is_file()
    (sharded / "config.json").write_text((root / "config.json").read_text())
    other = DFlashDraftModel.from_pretrained(sharded, torch.float32, "cpu", block_size=4)
    assert other.cfg.block_size == 4 and other.cfg.num_draft_tokens == 3
    for (name, a), (_, b) in zip(ours.named_parameters(), other.named_parameters(), strict=True):
        assert torch.equal(a, b), name


def test_fp16_keeps_feature_fusion_out_of_fp16(draft_pair):
    _, _, root = draft_pair
    model = DFlashDraftModel.from_pretrained(root, torch.float16, "cpu")
    assert model.fc.weight.dtype == model.hidden_norm.weight.dtype == torch.float32
    assert model.layers[0].self_attn.k_proj.weight.dtype == torch.float16
    cache = model.allocate_kv_cache(NUM_PAGES, PAGE_SIZE)
    aux = torch.full((2, model.cfg.aux_hidden_size), 1e3)  # fc output would overflow fp16
    with torch.inference_mode():
        model.write_context(aux, torch.arange(2), torch.arange(2), cache)
    assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in cache)


def _checkpoint_copy(root: Path, dst: Path, edit) -> Path:
    from safetensors.torch import load_file, save_file

    dst.mkdir()
    (dst / "config.json").write_text((root / "config.json").read_text())
    tensors = load_file(root / "model.safetensors")
    edit(tensors)
    save_file(tensors, dst / "model.safetensors")
    return dst


def test_load_errors_name_the_tensor(draft_pair, tmp_path):
    _, _, root = draft_pair
    missing = _checkpoint_copy(root, tmp_path / "missing",
                               lambda t: t.pop("layers.0.self_attn.k_norm.weight"))
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.k_norm\.weight"):
        DFlashDraftModel.from_pretrained(missing, torch.float32, "cpu")

    def shrink(t):
        t["fc.weight"] = t["fc.weight"][:, :HIDDEN].contiguous()

    bad = _checkpoint_copy(root, tmp_path / "bad", shrink)
    with pytest.raises(ValueError, match=r"fc\.weight"):
        DFlashDraftModel.from_pretrained(bad, torch.float32, "cpu")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "config.json").write_text((root / "config.json").read_text())
    with pytest.raises(ValueError, match="safetensors"):
        DFlashDraftModel.from_pretrained(empty, torch.float32, "cpu")
