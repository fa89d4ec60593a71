"""load_format="dummy" (target/dummy.py): random weights from config.json alone, the same
for every rank and process, with the draft's copy of the embedding and lm_head equal to the
target's; the engine runs on them, and speculative greedy equals target-only greedy."""

from __future__ import annotations

import shutil

import pytest
import torch

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from draft.model import DFlashDraftModel
from target.loader import load_embedding_and_head, load_target


@pytest.fixture(scope="module")
def config_only(tiny_demo, tmp_path_factory):
    """The tiny demo pair's config.json files without any weights."""
    root = tmp_path_factory.mktemp("config_only")
    for name, src in zip(("target", "draft"), tiny_demo, strict=True):
        (root / name).mkdir()
        shutil.copy(src / "config.json", root / name / "config.json")
    return root


def test_dummy_target_is_deterministic_and_in_range(config_only):
    a = load_target(config_only / "target", load_format="dummy")
    b = load_target(config_only / "target", load_format="dummy")
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q), name
        assert torch.isfinite(p).all(), name
    gdn = a.model.layers[0].linear_attn
    assert (gdn.A_log >= 0).all() and (gdn.A_log <= 2.7).all()
    assert torch.equal(gdn.norm.weight, torch.ones_like(gdn.norm.weight))
    assert torch.equal(a.model.norm.weight, torch.zeros_like(a.model.norm.weight))
    w = a.model.layers[0].mlp.experts.down_proj
    assert 0.015 < w.float().std().item() < 0.025


def test_the_drafts_embedding_and_head_are_the_targets(config_only):
    target = dict(load_target(config_only / "target", load_format="dummy").named_parameters())
    embed, head = load_embedding_and_head(config_only / "target", load_format="dummy")
    assert torch.equal(embed.weight, target["model.embed_tokens.weight"])
    assert torch.equal(head.weight, target["lm_head.weight"])
    draft = DFlashDraftModel.from_pretrained(config_only / "draft", dtype=torch.float32,
                                             load_format="dummy")
    assert all(torch.isfinite(p).all() for p in draft.parameters())


def test_a_bad_load_format_names_the_field(config_only):
    with pytest.raises(ValueError, match="load_format"):
        EngineConfig(model=str(config_only / "target"), load_format="safetensors")
    with pytest.raises(ValueError, match="load_format"):
        load_target(config_only / "target", load_format="pt")
    with pytest.raises(ValueError, match="safetensors"):  # a real load still needs weights
        load_target(config_only / "target")


def test_the_engine_runs_on_dummy_weights_losslessly(config_only):
    common = dict(model=str(config_only / "target"), load_format="dummy", max_num_seqs=4,
                  page_size=4)
    prompts = [[5, 17, 200, 3], list(range(30, 52))]
    params = [SamplingParams(max_tokens=12, ignore_eos=True)] * 2
    want = [o.output_ids for o in LLMEngine(EngineConfig(**common)).generate(prompts, params)]
    spec = LLMEngine(EngineConfig(**common, draft_model=str(config_only / "draft"),
                                  block_size=4))
    got = [o.output_ids for o in spec.generate(prompts, params)]
    assert got == want and all(len(w) == 12 for w in want)
