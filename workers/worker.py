"""The tensor-parallel target worker: one Ray actor per GPU, holding its shard of the target,
its caches and a ModelRunner. Every rank runs the same forward and the same acceptance
(identical all-gathered logits and identically seeded generators give identical decisions),
so ranks never exchange accept results; only rank 0 returns them."""

from __future__ import annotations

import socket

import torch
import torch.distributed as dist

from configs.engine import EngineConfig
from target.distributed import TPGroup
from target.loader import load_target
from workers.cache import allocate_target_caches
from workers.model_runner import ModelRunner, SeqInput, StepOutput


class TargetWorker:
    def __init__(self, cfg: EngineConfig, num_kv_blocks: int, aux_layer_ids: tuple[int, ...],
                 rank: int, tp: int):
        self.cfg, self.rank, self.tp = cfg, rank, tp
        self.num_kv_blocks = num_kv_blocks
        self.aux_layer_ids = aux_layer_ids
        # Ray narrows CUDA_VISIBLE_DEVICES to this actor's GPU, so it is always cuda:0 here.
        on_gpu = cfg.device.startswith("cuda")
        self.device = torch.device("cuda", 0) if on_gpu else torch.device("cpu")
        self.runner: ModelRunner | None = None

    def address(self) -> tuple[str, int]:
        """Rank 0's node IP and a free port for the process-group rendezvous."""
        import ray

        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def init_model(self, master_addr: str, master_port: int) -> int:
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.tp > 1:
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=self.rank, world_size=self.tp)
        group = TPGroup(rank=self.rank, size=self.tp)
        model = load_target(self.cfg.model, tp=group, dtype=self.cfg.torch_dtype,
                            device=self.device)
        caches = allocate_target_caches(model, self.num_kv_blocks, self.cfg.kv_block_size,
                                        self.cfg.max_num_seqs, self.device)
        self.runner = ModelRunner(model, caches, self.aux_layer_ids, self.device, self.cfg.seed)
        return self.rank

    def prefill(self, seqs: list[SeqInput]) -> StepOutput | None:
        return self._only_rank0(self.runner.prefill(seqs))

    def verify(self, seqs: list[SeqInput]) -> StepOutput | None:
        return self._only_rank0(self.runner.verify(seqs))

    def release(self, seq_id: int) -> None:
        self.runner.release(seq_id)

    def ping(self) -> int:
        return self.rank

    def _only_rank0(self, out: StepOutput) -> StepOutput | None:
        if self.rank != 0:
            return None
        out.aux, out.aux_positions = out.aux.cpu(), out.aux_positions.cpu()
        return out

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
