"""DFlash draft (Qwen3 layers) with a paged context-KV cache; inference only.

Parameter names match the checkpoint 1:1. The context (aux features of committed target
tokens) is projected once per layer into the paged cache by `write_context`; each round,
`forward_block` runs the block [anchor, mask x (B-1)] against it and discards the block's KV.
Legend: S sequences, B block length, N committed tokens, H hidden, V vocab.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor, nn

from configs.engine import check_load_format
from configs.kernels import KernelConfig
from draft import fused
from draft.attention import (
    paged_block_attention,
    paged_block_attention_triton,
    rope_inv_freq,
    write_kv,
)
from draft.config import DraftConfig
from target import dummy
from target.kernels import fused as target_fused
from target.kernels import pdl, selection
from target.weights import read_safetensors

# per draft layer (k_cache, v_cache), each [num_pages, page_size, Hkv, D]
KVCache = list[tuple[Tensor, Tensor]]


class RMSNorm(nn.Module):
    # Qwen3 RMSNorm: plain weight (not zero-centred), statistics in fp32
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """norm(x); with `residual`: the stream residual + x and its norm, in one graph."""
        if residual is None:
            return fused.rms_norm(x, self.weight, self.eps)
        return fused.add_rms_norm(x, residual, self.weight, self.eps)


class DraftMLP(nn.Module):
    def __init__(self, cfg: DraftConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.up_proj = nn.Linear(h, i, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(i, h, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(fused.silu_mul(self.gate_proj(x), self.up_proj(x)))


class DraftAttention(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        # How a block attends over [context ; block]: "gathered" copies the context's pages
        # out (draft/attention.py); "triton" writes the block's K/V into its own slots and
        # reads the pages in place (target/kernels/attention_triton.py). Chosen per model by
        # set_block_attention (DFlashDraftModel.set_kernels: KernelConfig.block_attention).
        self.block_attention = "gathered"
        self.triton_launch = None  # the triton kind's launch shape (set_block_attention)
        h, d, bias = cfg.hidden_size, cfg.head_dim, cfg.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads, cfg.num_key_value_heads, d
        )
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=bias, dtype=dtype)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=bias, dtype=dtype)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps, dtype)
        self.is_causal = cfg.layer_causal[layer_idx]
        self.window = cfg.layer_windows[layer_idx]
        self.scale = d**-0.5

    def project_kv(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        # x [..., H] -> k (normed, RoPE'd), v [..., Hkv, D]
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        return fused.norm_rope(k, self.k_norm.weight, self.k_norm.eps, cos, sin), v

    def forward(
        self,
        x: Tensor,
        cos: Tensor,
        sin: Tensor,
        kv: tuple[Tensor, Tensor],
        block_tables: Tensor,
        context_lens: Tensor,
        meta: dict,
    ) -> Tensor:
        # x [S, B, H] (already input-normed); cos/sin [S, B, D] at the block positions; meta:
        # the forward's values every layer shares (made by the first)
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        q = fused.norm_rope(q, self.q_norm.weight, self.q_norm.eps, cos, sin)
        k, v = self.project_kv(x, cos, sin)
        attend = BLOCK_ATTENTION[self.block_attention]
        out = attend(
            q, k, v, kv[0], kv[1], block_tables, context_lens,
            is_causal=self.is_causal, window=self.window, scale=self.scale, meta=meta,
            launch=self.triton_launch,
        )
        return self.o_proj(out.flatten(-2))


class DraftDecoderLayer(nn.Module):
    def __init__(self, cfg: DraftConfig, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = DraftAttention(cfg, layer_idx, dtype)
        self.mlp = DraftMLP(cfg, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(
        self,
        x: Tensor,
        residual: Tensor | None,
        cos: Tensor,
        sin: Tensor,
        kv: tuple[Tensor, Tensor],
        block_tables: Tensor,
        context_lens: Tensor,
        meta: dict,
    ) -> tuple[Tensor, Tensor]:
        """x: the previous layer's MLP output (or the block's embeddings, residual None).
        Returns this layer's MLP output and the stream before it; the next norm adds them."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv, block_tables, context_lens, meta)
        residual, h = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


BLOCK_ATTENTION = {"gathered": paged_block_attention, "triton": paged_block_attention_triton}


def set_block_attention(model: nn.Module, kind: str, launch=None) -> None:
    """Every DraftAttention of `model` attends its blocks with `kind` (BLOCK_ATTENTION), the
    triton kind at `launch` (attention_triton.Launch; None: the kernel's default)."""
    if kind not in BLOCK_ATTENTION:
        raise ValueError(f"block attention must be one of {sorted(BLOCK_ATTENTION)}, got "
                         f"{kind!r}")
    for m in model.modules():
        if isinstance(m, DraftAttention):
            m.block_attention, m.triton_launch = kind, launch


class DFlashDraftModel(nn.Module):
    def __init__(self, cfg: DraftConfig, dtype: torch.dtype = torch.float32, device="cpu") -> None:
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        # feature fusion never in fp16: wide concatenated aux features overflow it
        self.fusion_dtype = torch.float32 if dtype == torch.float16 else dtype
        # built on meta and materialised uninitialised: every parameter comes from load_weights
        with torch.device("meta"):
            self.layers = nn.ModuleList(
                DraftDecoderLayer(cfg, i, dtype) for i in range(cfg.num_hidden_layers)
            )
            self.fc = nn.Linear(
                cfg.aux_hidden_size, cfg.hidden_size, bias=False, dtype=self.fusion_dtype
            )
            self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, self.fusion_dtype)
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.to_empty(device=device)
        self.requires_grad_(False)
        # fp32 and not a module buffer, so `.to(dtype)` can never round it
        self.inv_freq = rope_inv_freq(cfg.head_dim, cfg.rope_theta).to(device)

    @property
    def device(self) -> torch.device:
        return self.norm.weight.device

    def set_kernels(self, kernels: KernelConfig, graphs: bool) -> None:
        """The block attention (target/kernels/selection.py), resolved for the weights'
        device; and, as the target's set_kernels does, whether the elementwise chains compile
        (graphs: proposals replay CUDA graphs) and whether the Triton kernels launch with PDL.
        Process-wide: a draft actor's process has no target model to set them."""
        device = self.device
        set_block_attention(self, selection.block_attention(kernels, device),
                            selection.ATTENTION_LAUNCH)
        target_fused.enable(selection.compiles_elementwise(kernels, graphs))
        pdl.enable(selection.pdl_launch(kernels, device), selection.pdl_compiled(kernels, device))

    # ---- weights -------------------------------------------------------------------------

    def load_weights(self, model_dir: str | Path) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for file in _safetensors_files(Path(model_dir)):
            with read_safetensors(file) as f:
                for name in f.keys():
                    param = params.get(name)
                    if param is None:
                        continue  # e.g. extra heads of other draft variants
                    tensor = f.get_tensor(name)
                    if tuple(tensor.shape) != tuple(param.shape):
                        raise ValueError(
                            f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, the draft "
                            f"config implies {tuple(param.shape)}"
                        )
                    param.copy_(tensor)
                    loaded.add(name)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(
                f"{model_dir}: checkpoint lacks {len(missing)} draft tensors, e.g. {missing[:5]}"
            )

    @classmethod
    def from_pretrained(
        cls,
        model_dir: str | Path,
        dtype: torch.dtype = torch.bfloat16,
        device: str | torch.device = "cpu",
        block_size: int | None = None,
        load_format: str = "auto",
    ) -> DFlashDraftModel:
        """load_format "dummy": random weights (target/dummy.py) from config.json alone."""
        check_load_format(load_format)
        cfg = DraftConfig.from_pretrained(model_dir)
        if block_size is not None:
            cfg = cfg.with_block_size(block_size)
        model = cls(cfg, dtype=dtype, device=device)
        if load_format == "dummy":
            dummy.init_(model)
        else:
            with torch.no_grad():
                model.load_weights(model_dir)
        return model.eval()

    # ---- cache ---------------------------------------------------------------------------

    def allocate_kv_cache(self, num_pages: int, page_size: int) -> KVCache:
        shape = (num_pages, page_size, self.cfg.num_key_value_heads, self.cfg.head_dim)
        return [
            (
                torch.zeros(shape, dtype=self.dtype, device=self.device),
                torch.zeros(shape, dtype=self.dtype, device=self.device),
            )
            for _ in self.layers
        ]

    def write_context(
        self, aux: Tensor, positions: Tensor, slot_mapping: Tensor, kv_cache: KVCache
    ) -> None:
        # aux [N, len(target_layer_ids) * H] of committed tokens; positions, slot_mapping [N]
        ctx = self.hidden_norm(self.fc(aux.to(self.fusion_dtype))).to(self.dtype)  # [N, H]
        cos, sin = fused.rope_cos_sin(positions, self.inv_freq, self.dtype)  # [N, D]
        slots = slot_mapping.long()
        for layer, (k_cache, v_cache) in zip(self.layers, kv_cache, strict=True):
            k, v = layer.self_attn.project_kv(ctx, cos, sin)
            write_kv(k, v, k_cache, v_cache, slots)

    # ---- block ---------------------------------------------------------------------------

    def forward_block(
        self, noise_embeds: Tensor, context_lens: Tensor, block_tables: Tensor, kv_cache: KVCache
    ) -> Tensor:
        # noise_embeds [S, B, H] (already scaled); block of sequence s at L_s .. L_s + B - 1
        x = noise_embeds.to(self.dtype)
        positions = context_lens.long()[:, None] + torch.arange(x.shape[1], device=x.device)
        cos, sin = fused.rope_cos_sin(positions, self.inv_freq, self.dtype)  # [S, B, D]
        residual, meta = None, {}
        for layer, kv in zip(self.layers, kv_cache, strict=True):
            x, residual = layer(x, residual, cos, sin, kv, block_tables, context_lens, meta)
        return self.norm(x, residual)[1]  # [S, B, H]

    def compute_logits(self, hidden: Tensor, lm_head: Callable[[Tensor], Tensor]) -> Tensor:
        logits = lm_head(hidden) * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def propose_logits(
        self,
        anchor_ids: Tensor,
        context_lens: Tensor,
        block_tables: Tensor,
        kv_cache: KVCache,
        embed: Callable[[Tensor], Tensor],
        lm_head: Callable[[Tensor], Tensor],
        block_size: int | None = None,
    ) -> Tensor:
        # anchor_ids [S] -> logits [S, B - 1, V] for block positions 1 .. B - 1
        block_size = self.cfg.block_size if block_size is None else block_size
        ids = torch.full(
            (anchor_ids.shape[0], block_size), self.cfg.mask_token_id,
            dtype=torch.long, device=anchor_ids.device,
        )
        ids[:, 0] = anchor_ids
        noise = embed(ids) * self.cfg.input_embedding_scale  # the TARGET's embedding
        hidden = self.forward_block(noise, context_lens, block_tables, kv_cache)
        return self.compute_logits(hidden[:, 1:], lm_head)

    def propose(
        self,
        anchor_ids: Tensor,
        context_lens: Tensor,
        block_tables: Tensor,
        kv_cache: KVCache,
        embed: Callable[[Tensor], Tensor],
        lm_head: Callable[[Tensor], Tensor],
        block_size: int | None = None,
        top_k: int = 0,
    ) -> Tensor:
        # argmax at every temperature (the draft proposes greedily) -> draft tokens [S, B - 1] long;
        # top_k > 0: each position's top_k tokens, best first -> [S, B - 1, top_k] (a grammar
        # then picks among them: workers/controls.py)
        logits = self.propose_logits(
            anchor_ids, context_lens, block_tables, kv_cache, embed, lm_head, block_size
        )
        return logits.topk(top_k, dim=-1).indices if top_k else logits.argmax(dim=-1)


def _safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ValueError(f"{index} is not a valid safetensors index: {e}") from e
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        absent = [str(f) for f in files if not f.is_file()]
        if absent:
            raise ValueError(f"{index} names shards that do not exist: {absent}")
        return files
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"{model_dir} holds no *.safetensors weights")
    return files
