"""Models with the real architecture and random weights, made on the device (no checkpoint;
values by target/dummy.py, as `load_format="dummy"` gives): our target and draft, and
transformers' `Qwen3_5MoeForCausalLM` sharing our target's tensors (so the baseline is the
same weights at the cost of one extra copy of nothing but views). Also the benchmarks' kernel
switches (add_kernel_args, set_kernels)."""

from __future__ import annotations

import argparse
import dataclasses

import torch
from torch import nn

from configs.kernels import (
    ATTENTION_BACKENDS,
    GDN_RECURRENCE,
    GDN_ROUNDS,
    MOE_BACKENDS,
    MOE_ROUTING,
    KernelConfig,
    parse_choices,
)
from configs.model import TargetConfig
from draft.config import DraftConfig
from draft.model import DFlashDraftModel
from target import dummy
from target.layers.gdn import IN_PROJ_PARTS
from target.model import Qwen3_5MoeForCausalLM


def build_target(raw: dict, dtype: torch.dtype, device: torch.device,
                 seed: int = 0) -> Qwen3_5MoeForCausalLM:
    cfg = TargetConfig.from_dict(raw)
    with torch.device(device):
        model = Qwen3_5MoeForCausalLM(cfg, dtype=dtype)
    dummy.init_(model, seed)
    return model.eval()


def build_draft(raw: dict, dtype: torch.dtype, device: torch.device, block_size: int,
                seed: int = 1) -> DFlashDraftModel:
    cfg = DraftConfig.from_dict(raw, source="preset").with_block_size(block_size)
    model = DFlashDraftModel(cfg, dtype=dtype, device=device)
    dummy.init_(model, seed)
    return model.eval()


def transformers_twin(ours: Qwen3_5MoeForCausalLM, raw: dict) -> nn.Module:
    """transformers' Qwen3_5MoeForCausalLM over our tensors: built on the meta device, then every
    parameter points at ours (the shared expert's gate/up are views of our fused weight)."""
    from transformers import Qwen3_5MoeForCausalLM as HFModel
    from transformers import Qwen3_5MoeTextConfig

    skip = {"architectures", "full_attention_interval"}
    hcfg = Qwen3_5MoeTextConfig(**{k: v for k, v in raw.items() if k not in skip})
    with torch.device("meta"):
        hf = HFModel(hcfg)
    ours_params = dict(ours.named_parameters())
    for name, p in list(hf.named_parameters()):
        owner_name, leaf = name.rsplit(".", 1)
        owner = hf.get_submodule(owner_name)
        part = owner_name.rsplit(".", 1)[-1]
        if ".shared_expert." in name and leaf == "weight" and (
                owner_name.endswith(("gate_proj", "up_proj"))):
            fused = ours_params[owner_name.rsplit(".", 1)[0] + ".gate_up_proj.weight"]
            half = fused.shape[0] // 2
            src = fused[:half] if owner_name.endswith("gate_proj") else fused[half:]
        elif part in IN_PROJ_PARTS:  # our GDN in_proj rows: [q | k | v | z | b | a]
            gdn = ours.get_submodule(owner_name.rsplit(".", 1)[0])
            sizes, segs = gdn.in_proj.local_sizes, IN_PROJ_PARTS[part]
            start = sum(sizes[: segs[0]])
            src = gdn.in_proj.weight[start : start + sum(sizes[i] for i in segs)]
        else:
            src = ours_params[name]
        if src.shape != p.shape:
            raise ValueError(f"{name}: transformers {tuple(p.shape)} vs ours {tuple(src.shape)}")
        owner._parameters[leaf] = nn.Parameter(src, requires_grad=False)
    device = next(ours.parameters()).device
    with torch.device(device):  # its inv_freq buffers are computed, not loaded
        hf.model.rotary_emb = type(hf.model.rotary_emb)(hcfg)
    for name, b in hf.named_buffers():
        if b.is_meta:
            raise ValueError(f"transformers buffer {name} was left on the meta device")
    return hf.eval()


def add_kernel_args(p: argparse.ArgumentParser) -> None:
    """The benchmarks' kernel switches (configs/kernels.py), to measure each path against the
    others in the same build."""
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="auto",
                   help="decode, rounds and draft blocks: EngineConfig.attention_backend")
    p.add_argument("--moe", choices=MOE_BACKENDS, default="auto",
                   help="routed-expert kernel: EngineConfig.moe_backend")
    p.add_argument("--moe-routing", choices=MOE_ROUTING, default="auto",
                   help="the router's softmax/top-k: compiled torch or one Triton kernel")
    p.add_argument("--gdn-rounds", choices=GDN_ROUNDS, default="batched")
    p.add_argument("--gdn-recurrence", choices=GDN_RECURRENCE, default="auto",
                   help="rounds' recurrence on gathered states (fla) or in place by slot")
    p.add_argument("--no-fuse", action="store_true",
                   help="leave the elementwise chains uncompiled (target/kernels/fused.py; the "
                        "engine compiles them whenever it captures CUDA graphs)")
    p.add_argument("--enforce-eager", action="store_true",
                   help="no CUDA graphs (rounds and proposals run eagerly)")


def kernel_config(args: argparse.Namespace, variant: str = "") -> KernelConfig:
    """The kernels add_kernel_args chose, with a variant's changes: "field=value[,…]" over
    KernelConfig's fields (e.g. "moe=sorted", "moe=pairs,moe_routing=torch"; "" for none)."""
    kernels = KernelConfig(attention=args.attention, moe=args.moe,
                           moe_routing=args.moe_routing, gdn_rounds=args.gdn_rounds,
                           gdn_recurrence=args.gdn_recurrence,
                           compile_elementwise=False if args.no_fuse else None)
    try:
        return dataclasses.replace(kernels, **parse_choices(variant, f"variant {variant!r}"))
    except ValueError as e:  # (compile_elementwise: --no-fuse)
        raise SystemExit(str(e)) from None


def set_kernels(target: Qwen3_5MoeForCausalLM, draft: DFlashDraftModel,
                args: argparse.Namespace, device: torch.device, variant: str = "") -> bool:
    """The kernels of kernel_config(args, variant), set as the workers set theirs; returns
    whether rounds and proposals replay CUDA graphs."""
    graphs = device.type == "cuda" and not args.enforce_eager
    kernels = kernel_config(args, variant)
    target.set_kernels(kernels, graphs)
    draft.set_kernels(kernels, graphs)
    return graphs
