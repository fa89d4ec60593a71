"""Memory-bound floors: the bytes a step must move (weights it touches, caches it reads and
writes), over the HBM bandwidth measured in the same run. Experts count once per layer if any
token of the step routed to them (the routing observed in that step), so a 16-token verify
touches more experts than a 1-token decode."""

from __future__ import annotations

import time
from contextlib import contextmanager

import torch

from target.model import Qwen3_5MoeForCausalLM


def measure_bandwidth(device: torch.device, nbytes: int = 2 << 30, iters: int = 10) -> float:
    """Bytes/s of a device-to-device copy (read + write counted), median of `iters`."""
    n = nbytes // 2
    src = torch.empty(n, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    samples = []
    for _ in range(iters + 2):
        sync(device)
        t = time.perf_counter()
        dst.copy_(src)
        sync(device)
        samples.append(time.perf_counter() - t)
    samples = sorted(samples[2:])
    return 2 * n * src.element_size() / samples[len(samples) // 2]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def record_routing(model: Qwen3_5MoeForCausalLM):
    """Collects, per MoE layer, the set of experts any token of the forward was routed to."""
    routed: dict[int, set[int]] = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        moe = layer.mlp
        k = model.config.num_experts_per_tok

        def hook(mod, args, out, i=i, moe=moe, k=k):
            x = args[0]
            logits = torch.nn.functional.linear(x, moe.gate.weight).float()
            routed.setdefault(i, set()).update(logits.topk(k, dim=-1).indices.unique().tolist())

        hooks.append(moe.register_forward_hook(hook))
    try:
        yield routed
    finally:
        for h in hooks:
            h.remove()


def weight_bytes(model: Qwen3_5MoeForCausalLM, routed: dict[int, set[int]],
                 num_tokens: int) -> int:
    """Bytes of weights a forward of `num_tokens` tokens reads, lm_head included (every row:
    logits for every verified position), the embedding only for its rows."""
    total = 0
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        if ".mlp.experts." in name:
            layer = int(name.split(".layers.")[1].split(".")[0])
            size = size // model.config.num_experts * len(routed.get(layer, ()))
        elif name.endswith("embed_tokens.weight"):
            size = num_tokens * p.shape[1] * p.element_size()
        total += size
    return total


def cache_bytes(model: Qwen3_5MoeForCausalLM, context_lens: list[int], query_len: int) -> int:
    """KV read over each sequence's context + written for its new tokens; GDN state read and
    written once per sequence per layer (a verify's replay writes it again: counted twice)."""
    shapes, elem = model.cache_shapes(), model.dtype.itemsize
    cfg = model.config
    kv_per_token = 2 * shapes["kv"][0] * shapes["kv"][1] * elem * len(cfg.full_attention_layers)
    kv = sum(kv_per_token * (n + query_len) for n in context_lens)
    heads, dk, dv = shapes["ssm"]
    state = heads * dk * dv * 4 * len(cfg.linear_attention_layers)
    passes = 3 if query_len > 1 else 2  # read + write (+ the replay's write)
    return kv + passes * state * len(context_lens)
