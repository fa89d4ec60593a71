"""Loads HF safetensors checkpoints of Qwen3.5-MoE into the tensor-parallel target.

Accepted layouts: the published `Qwen3_5MoeForConditionalGeneration` one (text keys
under `model.language_model.`, fused experts, vision/MTP keys skipped) and the
`Qwen3_5MoeForCausalLM.save_pretrained` one (keys under `model.`, per-expert tensors); single
file or sharded with `model.safetensors.index.json`. Each rank reads only its slices.
"""

from __future__ import annotations

import json
import re
from contextlib import ExitStack
from pathlib import Path

import torch

from configs.engine import check_load_format
from configs.model import TargetConfig
from target import dummy
from target.distributed import SINGLE, TPGroup
from target.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from target.layers.gdn import IN_PROJ_PARTS
from target.model import Qwen3_5MoeForCausalLM
from target.weights import SafetensorsSource, ShardProgress, WeightSource, read_safetensors

SKIP_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")
_PER_EXPERT = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$")
_SHARED = re.compile(r"^(.*\.mlp\.shared_expert)\.(gate|up)_proj\.weight$")
_GDN_IN = re.compile(r"^(.*\.linear_attn)\.(in_proj_(?:qkv|z|b|a))\.weight$")


def checkpoint_files(model_dir: str | Path) -> list[Path]:
    model_dir = Path(model_dir)
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = [model_dir / f for f in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise ValueError(f"{index} names {f.name}, which does not exist in {model_dir}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} has no *.safetensors files")
    return files


def param_target(key: str) -> tuple[str, object] | None:
    """Checkpoint key → (parameter name, shard id), or None for keys the text model skips."""
    if key.startswith(SKIP_PREFIXES):
        return None
    if key.startswith("model.language_model."):
        key = "model." + key[len("model.language_model.") :]
    if m := _PER_EXPERT.match(key):
        prefix, expert, which = m.group(1), int(m.group(2)), m.group(3)
        name = "down_proj" if which == "down" else "gate_up_proj"
        return f"{prefix}.{name}", (expert, which)
    if m := _SHARED.match(key):
        return f"{m.group(1)}.gate_up_proj.weight", 0 if m.group(2) == "gate" else 1
    if m := _GDN_IN.match(key):
        return f"{m.group(1)}.in_proj.weight", IN_PROJ_PARTS[m.group(2)]
    return key, None


def _expected_shards(name: str, cfg: TargetConfig) -> set | None:
    """Shard ids that complete a parameter loaded piecewise (per-expert or split tensors);
    None for parameters that only load whole."""
    experts = range(cfg.num_experts)
    if name.endswith("mlp.experts.gate_up_proj"):
        return {(e, w) for e in experts for w in ("gate", "up")}
    if name.endswith("mlp.experts.down_proj"):
        return {(e, "down") for e in experts}
    if name.endswith("shared_expert.gate_up_proj.weight"):
        return {0, 1}
    if name.endswith("linear_attn.in_proj.weight"):
        return set(IN_PROJ_PARTS.values())
    return None


def load_weights(model: Qwen3_5MoeForCausalLM, model_dir: str | Path) -> None:
    cfg = model.config
    params = dict(model.named_parameters())
    loaded: dict[str, set] = {}
    files = checkpoint_files(model_dir)
    device = next(model.parameters()).device
    progress = ShardProgress("the target", files,
                             f"{device}, TP rank {model.tp.rank} of {model.tp.size}")
    with ExitStack() as stack:
        for i, path in enumerate(files):
            if i:
                progress.shard_done(i - 1)
            handle = stack.enter_context(read_safetensors(path))
            for key in handle.keys():
                target = param_target(key)
                if target is None:
                    continue
                name, shard_id = target
                if name not in params:
                    raise ValueError(
                        f"{path.name}: tensor {key} matches no parameter of the Qwen3.5-MoE text "
                        f"model (looked for {name})"
                    )
                _load_one(params[name], SafetensorsSource(key, handle, key), shard_id)
                loaded.setdefault(name, set()).add(shard_id)
                if cfg.tie_word_embeddings and name == "model.embed_tokens.weight":
                    _load_one(params["lm_head.weight"], SafetensorsSource(key, handle, key), None)
                    loaded.setdefault("lm_head.weight", set()).add(None)
        progress.shard_done(len(files) - 1)
    progress.finish()
    missing = []
    for name in params:
        got = loaded.get(name, set())
        need = _expected_shards(name, cfg)
        if None in got or (need is not None and need <= got):
            continue
        if name.endswith("linear_attn.in_proj.weight"):  # name the checkpoint's tensors
            prefix = name.removesuffix("in_proj.weight")
            missing += [f"{prefix}{part}.weight" for part, seg in IN_PROJ_PARTS.items()
                        if seg not in got]
        elif need is not None and got:
            gaps = sorted(need - got, key=str)[:4]
            missing.append(f"{name} (missing parts: {', '.join(map(str, gaps))})")
        else:
            missing.append(name)
    if missing:
        more = f" (+{len(missing) - 6} more)" if len(missing) > 6 else ""
        shown = ", ".join(missing[:6]) + more
        raise ValueError(f"checkpoint {model_dir} lacks tensors for: {shown}")


def _load_one(param: torch.nn.Parameter, src: WeightSource, shard_id) -> None:
    with torch.no_grad():
        param.weight_loader(param, src, shard_id)


def load_target(
    model_dir: str | Path,
    tp: TPGroup = SINGLE,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
) -> Qwen3_5MoeForCausalLM:
    """load_format "auto": the safetensors in model_dir; "dummy": random weights
    (target/dummy.py), model_dir needs only its config.json."""
    check_load_format(load_format)
    cfg = TargetConfig.from_pretrained(model_dir)
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(cfg, tp, dtype)
    if load_format == "dummy":
        dummy.load_target_dummy(model)
    else:
        load_weights(model, model_dir)
    return model.eval()


def load_embedding_and_head(
    model_dir: str | Path, dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu", load_format: str = "auto",
) -> tuple[VocabParallelEmbedding, ParallelLMHead]:
    """Only the target's input embedding and lm_head, unsharded: what a draft running in its
    own process needs (it embeds its block and reads logits through the target's)."""
    cfg = TargetConfig.from_pretrained(model_dir)
    with torch.device(device):
        embed = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, SINGLE, dtype)
        head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, SINGLE, dtype)
    if check_load_format(load_format) == "dummy":  # the values the dummy target holds
        for name, param in (("model.embed_tokens.weight", embed.weight),
                            ("lm_head.weight", head.weight)):
            with torch.no_grad():
                param.copy_(dummy.target_tensor(name, cfg, tuple(param.shape), param.dtype,
                                                param.device))
        return embed.eval(), head.eval()
    wanted = {"model.embed_tokens.weight": [embed.weight], "lm_head.weight": [head.weight]}
    if cfg.tie_word_embeddings:
        wanted["model.embed_tokens.weight"].append(head.weight)
    done = set()
    with ExitStack() as stack:
        for path in checkpoint_files(model_dir):
            handle = stack.enter_context(read_safetensors(path))
            for key in handle.keys():
                target = param_target(key)
                if target is None or target[0] not in wanted:
                    continue
                for param in wanted[target[0]]:
                    _load_one(param, SafetensorsSource(key, handle, key), None)
                    done.add(id(param))
    for name, param in (("model.embed_tokens.weight", embed.weight),
                        ("lm_head.weight", head.weight)):
        if id(param) not in done:
            raise ValueError(f"checkpoint {model_dir} lacks tensors for: {name}")
    return embed.eval(), head.eval()
