"""Cache tensors of one rank: paged KV for the target's full-attention layers and one Gated
DeltaNet slot (conv + recurrent state) per running sequence."""

from __future__ import annotations

import torch

from configs.model import TargetConfig
from target.batch import TargetCaches
from target.model import Qwen3_5MoeForCausalLM


def allocate_target_caches(
    model: Qwen3_5MoeForCausalLM, num_pages: int, page_size: int, num_slots: int,
    device: torch.device | str,
) -> TargetCaches:
    cfg, shapes, dtype = model.config, model.cache_shapes(), model.dtype
    kv = {
        i: (torch.zeros(num_pages, page_size, *shapes["kv"], dtype=dtype, device=device),
            torch.zeros(num_pages, page_size, *shapes["kv"], dtype=dtype, device=device))
        for i in cfg.full_attention_layers
    }
    conv = {i: torch.zeros(num_slots, *shapes["conv"], dtype=dtype, device=device)
            for i in cfg.linear_attention_layers}
    ssm = {i: torch.zeros(num_slots, *shapes["ssm"], dtype=torch.float32, device=device)
           for i in cfg.linear_attention_layers}
    return TargetCaches(kv=kv, conv=conv, ssm=ssm)


def reset_state_slot(caches: TargetCaches, slot: int) -> None:
    # A reused slot must start from zero state: a stale state silently corrupts the next sequence.
    for t in caches.conv.values():
        t[slot].zero_()
    for t in caches.ssm.values():
        t[slot].zero_()


def bytes_per_token(model: Qwen3_5MoeForCausalLM) -> int:
    shapes = model.cache_shapes()
    elem = torch.tensor([], dtype=model.dtype).element_size()
    per_layer = 2 * shapes["kv"][0] * shapes["kv"][1] * elem if "kv" in shapes else 0
    return per_layer * len(model.config.full_attention_layers)


def bytes_per_state_slot(model: Qwen3_5MoeForCausalLM) -> int:
    shapes = model.cache_shapes()
    if "ssm" not in shapes:
        return 0
    elem = torch.tensor([], dtype=model.dtype).element_size()
    n = len(model.config.linear_attention_layers)
    conv = shapes["conv"][0] * shapes["conv"][1] * elem
    ssm = shapes["ssm"][0] * shapes["ssm"][1] * shapes["ssm"][2] * 4
    return n * (conv + ssm)


def state_slot_bytes(cfg: TargetConfig, dtype: torch.dtype) -> int:
    """bytes_per_state_slot at TP 1 from the config alone (the conv state in the model's dtype
    over q, k and v, the recurrent state in fp32): where no model is at hand."""
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    elem = torch.tensor([], dtype=dtype).element_size()
    conv = (2 * key + value) * (cfg.linear_conv_kernel_dim - 1) * elem
    ssm = cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    return len(cfg.linear_attention_layers) * (conv + ssm)
