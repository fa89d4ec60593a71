"""The Qwen3.5-MoE text model (target), tensor-parallel, over a flat varlen batch."""

from __future__ import annotations

import torch
from torch import nn

from configs.kernels import KernelConfig
from configs.model import TargetConfig
from target.batch import ForwardBatch, TargetCaches
from target.distributed import SINGLE, TPGroup
from target.kernels import fused, pdl, selection
from target.kernels.gdn_slots import Taps
from target.layers.attention import GatedAttention, set_round_attention
from target.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from target.layers.gdn import GatedDeltaNet
from target.layers.moe import MoEOutput, SparseMoE
from target.layers.norm import RMSNorm
from target.layers.rotary import RotaryEmbedding


class DecoderLayer(nn.Module):
    def __init__(self, cfg: TargetConfig, idx: int, tp: TPGroup, dtype: torch.dtype,
                 rotary: RotaryEmbedding):
        super().__init__()
        self.is_linear = cfg.layer_types[idx] == "linear_attention"
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, idx, tp, dtype)
        else:
            self.self_attn = GatedAttention(cfg, idx, tp, dtype, rotary)
        self.mlp = SparseMoE(cfg, tp, dtype)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor | MoEOutput, residual: torch.Tensor | None,
                batch: ForwardBatch, caches: TargetCaches
                ) -> tuple[torch.Tensor | MoEOutput, torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (or the embeddings, residual None). Returns this
        layer's MLP output (at TP 1 uncombined: SparseMoE), the stream before it, and the
        stream entering this layer. The stream after the layer is the sum of the first two,
        which the next norm adds (a residual add is no kernel of its own)."""
        mixer = self.linear_attn if self.is_linear else self.self_attn
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            residual, h = self.input_layernorm(x, residual)
        entering = residual
        residual, h = self.post_attention_layernorm(mixer(h, batch, caches), residual)
        return self.mlp(h), residual, entering


class Qwen3_5MoeTextModel(nn.Module):
    def __init__(self, cfg: TargetConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp, dtype)
        rotary = RotaryEmbedding(cfg.rotary_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, tp, dtype, rotary) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype)


class Qwen3_5MoeForCausalLM(nn.Module):
    def __init__(self, cfg: TargetConfig, tp: TPGroup = SINGLE, dtype: torch.dtype = torch.float32):
        super().__init__()
        cfg.check_tp(tp.size)
        self.config = cfg
        self.tp = tp
        self.dtype = dtype
        self.model = Qwen3_5MoeTextModel(cfg, tp, dtype)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, tp, dtype)

    def set_kernels(self, kernels: KernelConfig, graphs: bool) -> None:
        """Every layer's kernels (target/kernels/selection.py), resolved for the device the
        weights are on. graphs: rounds replay CUDA graphs, so their attention may read no host
        values; it also decides whether the elementwise chains compile, unless `kernels`
        says."""
        device = self.lm_head.weight.device
        set_round_attention(self, selection.round_attention(kernels, device, graphs))
        routing = selection.routing_kernel(kernels, device)
        recurrence = selection.recurrence_kernel(kernels, device)
        gdn_prologue = selection.gdn_prologue_kernel(kernels, device)
        experts = selection.experts_kernel(kernels, device)
        launch = selection.ATTENTION_LAUNCH
        attention_prologue = selection.attention_prologue_kernel(kernels, device)
        for m in self.modules():
            if isinstance(m, GatedAttention):
                m.triton_launch, m.prologue = launch, attention_prologue
            elif isinstance(m, GatedDeltaNet):
                m.batched_rounds = kernels.gdn_rounds == "batched"
                m.recurrence, m.prologue = recurrence, gdn_prologue
            elif isinstance(m, SparseMoE):
                m.routing = routing
                m.experts.kernel = experts
        fused.enable(selection.compiles_elementwise(kernels, graphs))
        pdl.enable(selection.pdl_launch(kernels, device), selection.pdl_compiled(kernels, device))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model.embed_tokens(input_ids)

    def forward(self, batch: ForwardBatch, caches: TargetCaches
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the final-normed hidden states [T, H] and the aux features [T, n_aux·H]: the
        residual stream after each layer in batch.aux_layer_ids (before the final norm)."""
        x, residual = self.embed(batch.input_ids), None
        wanted = set(batch.aux_layer_ids)
        aux: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.model.layers):
            x, residual, entering = layer(x, residual, batch, caches)
            if i - 1 in wanted:  # the stream after layer i − 1, as layer i's norm summed it
                aux[i - 1] = entering
        stream, hidden = self.model.norm(x, residual)
        aux[len(self.model.layers) - 1] = stream
        feats = [aux[i] for i in batch.aux_layer_ids]
        aux_out = torch.cat(feats, dim=-1) if feats else hidden.new_empty(hidden.shape[0], 0)
        return hidden, aux_out

    def compute_logits(self, hidden: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """[T, V] logits, in fp32 unless not `fp32` (then the model's dtype: an argmax needs
        no more, and the conversion is exact, so it picks the same token)."""
        logits = self.lm_head(hidden)
        return logits.float() if fp32 else logits

    def commit_verify(self, batch: ForwardBatch, caches: TargetCaches,
                      num_kept: list[int] | torch.Tensor,
                      tap_slots: torch.Tensor | None = None,
                      tap_ends: torch.Tensor | None = None) -> None:
        """After acceptance: advance each verify sequence's GDN state over its first
        num_kept[i] block tokens (the anchor plus the accepted drafts). The journal stays (a
        captured round replays its commit over the same one); a device tensor num_kept is for
        uniform rounds. tap_slots, tap_ends [S] (device; a slot −1 for none): each sequence's
        boundary slot, which also receives its state at the last page boundary the kept
        tokens reach, and the position its tokens end at (gdn_slots.Taps)."""
        taps = None
        if tap_slots is not None:
            width = batch.query_lens[0]
            starts = (batch.positions.view(-1, width)[:, 0]
                      if all(n == width for n in batch.query_lens)
                      else batch.positions[batch.cu_seqlens[:-1]])
            taps = Taps(tap_slots, starts, tap_ends, caches.page_size)
        for layer in self.model.layers:
            if layer.is_linear:
                layer.linear_attn.commit(batch, caches, num_kept, taps)

    def cache_shapes(self) -> dict[str, tuple[int, ...]]:
        """Per-layer cache entry shapes on this rank (without the block / slot dim)."""
        layers = self.model.layers
        attn = next((layer.self_attn for layer in layers if not layer.is_linear), None)
        gdn = next((layer.linear_attn for layer in layers if layer.is_linear), None)
        shapes = {}
        if attn is not None:
            shapes["kv"] = (attn.num_kv_heads, attn.head_dim)
        if gdn is not None:
            shapes["conv"] = (gdn.conv_dim, gdn.kernel - 1)
            shapes["ssm"] = (gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim)
        return shapes
