"""Random weights in place of a checkpoint (`load_format="dummy"`, vLLM's name): the real
architecture from a config.json alone, for benchmarks and tensor-parallel checks on machines
without the weights.

Every full (unsharded) tensor is a function of its parameter name and the seed, drawn on the
parameter's device; each rank draws the full tensor and keeps its slice through the same
weight loaders a checkpoint goes through. So TP 1, 2, 4 … hold one model, and the draft's copy
of the target's embedding and lm_head equals the target's.

Values: N(0, 0.02); norms at identity (zero-centred RMSNorm weights 0, the Gated DeltaNet
output norm's plain weight 1); the GDN decay parameters in their trained ranges (A_log in
[0, 2.7], dt_bias 0), so the recurrence neither explodes nor vanishes."""

from __future__ import annotations

import zlib

import torch
from torch import nn

from target.distributed import SINGLE
from target.weights import TensorSource

STD = 0.02


@torch.no_grad()
def fill_(name: str, t: torch.Tensor, gen: torch.Generator, std: float = STD) -> torch.Tensor:
    """t filled by the rule for parameter `name` (see the module docstring)."""
    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("linear_attn.norm.weight"):
        return t.fill_(1.0)
    if "norm" in name:
        return t.zero_()
    if leaf == "A_log":
        return t.copy_(torch.empty_like(t, dtype=torch.float32).uniform_(0, 2.7, generator=gen))
    if leaf == "dt_bias":
        return t.zero_()
    return t.normal_(0.0, std, generator=gen)


def tensor(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
           seed: int = 0) -> torch.Tensor:
    """The full tensor of parameter `name`: the same on every device type and rank."""
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return fill_(name, torch.empty(shape, dtype=dtype, device=device), gen)


@torch.no_grad()
def init_(module: nn.Module, seed: int = 0) -> nn.Module:
    """Every parameter of an unsharded module (the draft, or a TP 1 target) by the rule."""
    for name, p in module.named_parameters():
        p.copy_(tensor(name, tuple(p.shape), p.dtype, p.device, seed))
    return module


def target_tensor(name: str, cfg, shape: tuple[int, ...], dtype: torch.dtype,
                  device: torch.device, seed: int = 0) -> torch.Tensor:
    """The full tensor of the target's parameter `name`: a tied lm_head is the embedding."""
    if cfg.tie_word_embeddings and name == "lm_head.weight":
        name = "model.embed_tokens.weight"
    return tensor(name, shape, dtype, device, seed)


@torch.no_grad()
def load_target_dummy(model: nn.Module, seed: int = 0) -> None:
    """Fill a (possibly sharded) target: each parameter's full tensor, drawn as for TP 1, goes
    through the parameter's own weight loader, which keeps this rank's slice."""
    cfg = model.config
    with torch.device("meta"):  # full shapes, no memory
        full = dict(type(model)(cfg, SINGLE, model.dtype).named_parameters())
    for name, p in model.named_parameters():
        value = target_tensor(name, cfg, tuple(full[name].shape), p.dtype, p.device, seed)
        p.weight_loader(p, TensorSource(name, value), None)
