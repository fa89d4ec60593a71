"""Qwen3.5 sparse MoE: softmax router (fp32) → top-k → renormalise; SwiGLU experts; a shared
expert scaled by sigmoid(shared_expert_gate). Tensor-parallel on the intermediate dim of every
expert, so routed and shared outputs are partial sums reduced by one all-reduce."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from configs.model import TargetConfig
from target.distributed import TPGroup, all_reduce
from target.kernels import fused
from target.kernels.moe import gathered_experts, grouped_experts, grouped_mm_available
from target.kernels.moe_route import route_topk
from target.kernels.moe_sorted import SORTED_MAX, sorted_experts, sorted_experts_available
from target.kernels.moe_triton import PAIR_MAX, pair_experts, pair_experts_available
from target.layers.linear import (
    ColumnParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
    stack_rows,
    stacked_linear,
)
from target.weights import WeightSource, copy_into, expect_shape


class MoEOutput(NamedTuple):
    """A MoE layer's output before its combine: fused.moe_combine's arguments (the routed
    rows [T, k, H], their weights [T, k], the shared expert's output [T, H] and its gate
    logit [T, 1]). At TP 1 the next norm folds the combine in (RMSNorm: one kernel for the
    combine, the residual add and the norm)."""

    rows: torch.Tensor
    weights: torch.Tensor
    shared: torch.Tensor
    gate_logit: torch.Tensor

    def value(self) -> torch.Tensor:
        return fused.moe_combine(*self)


class FusedExperts(nn.Module):
    """gate_up_proj [E, 2·I/tp, H] (this rank's gate rows, then its up rows); down_proj
    [E, H, I/tp]. Loads both the fused on-disk layout and per-expert tensors."""

    def __init__(self, cfg: TargetConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.tp = tp
        self.num_experts = e = cfg.num_experts
        self.hidden = h = cfg.hidden_size
        self.full_inter = cfg.moe_intermediate_size
        self.inter = i = tp.shard(cfg.moe_intermediate_size, "moe_intermediate_size")
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i, dtype=dtype), False)
        # configs/kernels.py MOE_BACKENDS, set by the model's set_kernels. "auto": on CUDA, one
        # Triton GEMV per (token, slot) pair up to PAIR_MAX pairs (small decode steps), the
        # sorted-pair block GEMMs up to SORTED_MAX (verify rounds, short prefill chunks);
        # above that, or without Triton, grouped GEMMs where torch._grouped_mm runs fast
        # (sm90+, bf16) and gathered expert weights elsewhere (no host sync: capturable); on
        # CPU the reference loop.
        self.kernel = "auto"
        self.gate_up_proj.weight_loader = self._load_gate_up
        self.down_proj.weight_loader = self._load_down

    def _rows(self) -> slice:
        return slice(self.tp.rank * self.inter, (self.tp.rank + 1) * self.inter)

    def _load_gate_up(self, param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
        i, full, r = self.inter, self.full_inter, self._rows()
        if shard_id is None:  # fused [E, 2·I, H], gate rows first
            expect_shape(src, (self.num_experts, 2 * full, self.hidden))
            up = slice(full + r.start, full + r.stop)
            copy_into(param.data[:, :i], src.read(slice(None), r), src)
            copy_into(param.data[:, i:], src.read(slice(None), up), src)
            return
        expert, which = shard_id  # per-expert gate_proj / up_proj [I, H]
        expect_shape(src, (full, self.hidden))
        dst = param.data[expert, :i] if which == "gate" else param.data[expert, i:]
        copy_into(dst, src.read(r), src)

    def _load_down(self, param: nn.Parameter, src: WeightSource, shard_id=None) -> None:
        r = self._rows()
        if shard_id is None:  # fused [E, H, I]
            expect_shape(src, (self.num_experts, self.hidden, self.full_inter))
            copy_into(param.data, src.read(slice(None), slice(None), r), src)
            return
        expert, _ = shard_id
        expect_shape(src, (self.hidden, self.full_inter))
        copy_into(param.data[expert], src.read(slice(None), r), src)

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                shared: torch.Tensor | None = None, shared_gate: torch.Tensor | None = None,
                combine: bool = True) -> torch.Tensor | MoEOutput:
        """x [T, H]; topk_ids/topk_weights [T, k] → the routed output [T, H]. With `shared`
        [T, H] and its `shared_gate` logit [T, 1], the shared expert's part is added as
        fused.shared_expert_combine adds it: on the kernel paths in the same compiled graph
        as the slots' weighted sum (fused.moe_combine), or, `combine` False, left to the
        caller (a MoEOutput; the reference path combines all the same)."""
        kernel = self.resolve(x, topk_ids.numel())
        if kernel == "reference":
            routed = self.reference(x, topk_ids, topk_weights)
            if shared is None:
                return routed
            return fused.shared_expert_combine(routed, shared, shared_gate)
        fn = {"pairs": pair_experts, "sorted": sorted_experts, "grouped": grouped_experts,
              "gathered": gathered_experts}
        rows = fn[kernel](x, self.gate_up_proj, self.down_proj, topk_ids, topk_weights,
                          reduce=False)  # [T, k, H]
        if shared is None:
            return fused.weighted_slot_sum(rows, topk_weights)
        out = MoEOutput(rows, topk_weights, shared, shared_gate)
        return out.value() if combine else out

    def resolve(self, x: torch.Tensor, pairs: int) -> str:
        """The path a step of `pairs` (token, slot) pairs takes: `kernel`, or auto's choice."""
        return self.kernel if self.kernel != "auto" else self._auto(x, pairs)

    @staticmethod
    def _auto(x: torch.Tensor, pairs: int) -> str:
        if not x.is_cuda:
            return "reference"
        if pair_experts_available(x) and sorted_experts_available(x):
            if pairs <= PAIR_MAX:
                return "pairs"
            if pairs <= SORTED_MAX:
                return "sorted"
        return "grouped" if grouped_mm_available(x) else "gathered"

    def reference(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor):
        # One matmul pair per expert hit, and a host sync for the counts: the CPU path.
        out = torch.zeros_like(x)
        flat_ids = topk_ids.flatten()
        order = flat_ids.argsort(stable=True)
        counts = torch.bincount(flat_ids, minlength=self.num_experts).tolist()
        token_of = order // topk_ids.shape[1]
        start = 0
        for expert, n in enumerate(counts):
            if n == 0:
                continue
            idx = order[start : start + n]
            tokens = token_of[start : start + n]
            gate, up = F.linear(x[tokens], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert])
            w = topk_weights.flatten()[idx].unsqueeze(-1)
            out.index_add_(0, tokens, (y * w).to(out.dtype))
            start += n
        return out


class SparseMoE(nn.Module):
    """The router, its shared-expert gate and the shared expert's gate/up all read x: their
    weights are row views of one [E + 1 + 2·I_shared/tp, H] tensor, in that order
    (`in_proj`, filled by their own loaders; zero rows after them up to a multiple of 8), and
    a step runs them as one GEMM. A step on the pair GEMVs (decode) runs only the first E + 1
    rows and the shared expert as one more slot of the pair kernels (where its weights are
    shaped as a routed expert's): two launches for all experts, shared one included."""

    def __init__(self, cfg: TargetConfig, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.routing = "torch"  # KernelConfig.moe_routing: fused.moe_route, or "triton"
        self.tp = tp
        self.top_k = cfg.num_experts_per_tok
        h, shared = cfg.hidden_size, cfg.shared_expert_intermediate_size
        self.gate = ReplicatedLinear(h, cfg.num_experts, dtype)  # the router
        self.experts = FusedExperts(cfg, tp, dtype)
        self.shared_expert = SharedExpert(h, shared, tp, dtype)
        self.shared_expert_gate = ReplicatedLinear(h, 1, dtype)
        in_proj, self.in_sizes = stack_rows(
            [self.gate, self.shared_expert_gate, self.shared_expert.gate_up_proj])
        self.register_buffer("in_proj", in_proj, persistent=False)
        self.shared_in_pairs = (
            self.shared_expert.gate_up_proj.weight.shape == self.experts.gate_up_proj.shape[1:]
            and self.shared_expert.down_proj.weight.shape == self.experts.down_proj.shape[1:])

    def forward(self, x: torch.Tensor) -> torch.Tensor | MoEOutput:
        route = route_topk if self.routing == "triton" else fused.moe_route
        if self.shared_in_pairs and self.experts.resolve(x, x.shape[0] * self.top_k) == "pairs":
            return self._pairs_with_shared(x, route)
        y = stacked_linear(x, self.in_proj, sum(self.in_sizes))
        logits, shared_gate, gate_up = y.split(self.in_sizes, dim=-1)  # [T, E], [T, 1], [T, 2·I/tp]
        topk_weights, topk_ids = route(logits, self.top_k, x.dtype)  # [T, k]
        shared = self.shared_expert.down_proj(fused.silu_mul(gate_up))
        return self._output(self.experts(x, topk_ids, topk_weights, shared, shared_gate,
                                         combine=False))

    def _output(self, out: torch.Tensor | MoEOutput) -> torch.Tensor | MoEOutput:
        """At TP 1 the output as it comes (uncombined, a MoEOutput, from the kernel paths: the
        next norm combines it); above, combined and all-reduced."""
        if self.tp.size == 1:
            return out
        return all_reduce(out.value() if isinstance(out, MoEOutput) else out, self.tp)

    def _pairs_with_shared(self, x: torch.Tensor, route) -> torch.Tensor | MoEOutput:
        """The router and the shared-expert gate (the first E + 1 rows of in_proj), then the
        routed experts and the shared one in the pair kernels' two launches."""
        logits, shared_gate = stacked_linear(x, self.in_proj, sum(self.in_sizes[:2])).split(
            self.in_sizes[:2], dim=-1)
        topk_weights, topk_ids = route(logits, self.top_k, x.dtype)
        shared = (self.shared_expert.gate_up_proj.weight, self.shared_expert.down_proj.weight)
        rows = pair_experts(x, self.experts.gate_up_proj, self.experts.down_proj, topk_ids,
                            topk_weights, reduce=False, shared=shared)  # [T, k + 1, H]
        return self._output(MoEOutput(rows[:, : self.top_k], topk_weights, rows[:, self.top_k],
                                      shared_gate))


class SharedExpert(nn.Module):
    """The shared expert's weights; SparseMoE runs them (gate_up inside its one input GEMM)."""

    def __init__(self, hidden: int, inter: int, tp: TPGroup, dtype: torch.dtype):
        super().__init__()
        self.gate_up_proj = ColumnParallelLinear(hidden, [inter, inter], tp, dtype)
        self.down_proj = RowParallelLinear(inter, hidden, tp, dtype, reduce=False)
