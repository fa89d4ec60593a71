"""The tensor-parallel target worker: one Ray actor per GPU, holding its shard of the target,
its caches and a ModelRunner. Every rank runs the same forward and the same acceptance
(identical all-gathered logits and identically seeded generators give identical decisions),
so ranks never exchange accept results; only rank 0 returns them.

Start-up is a few Ray calls (cluster/startup.py), so the driver can size the caches from what
every GPU has left: `init_model` (process group + weights) → the aux transport → `profile`
(memory) → `allocate` (caches + runner); then `serve_steps` runs the step loop
(workers/step_loop.py) until the driver stops it. The in-process engine uses the same class
without Ray (tp 1)."""

from __future__ import annotations

import datetime
import logging
import socket
import time

import torch
import torch.distributed as dist

from configs.engine import EngineConfig, SamplingParams
from configs.logs import setup_logging_if_actor
from target.distributed import TPGroup
from target.kernels import pdl, selection
from target.loader import load_target
from target.model import Qwen3_5MoeForCausalLM
from workers.aux_transport import AuxRingSpec, AuxSender, make_aux_sender
from workers.cache import allocate_target_caches, bytes_per_state_slot, bytes_per_token
from workers.controls import ControlsEnv
from workers.cuda_graphs import MAX_GRAPH_WIDTH, RoundGraphs, graph_max_pages, num_scratch_pages
from workers.load_report import LoadReport, load_report, weight_bytes
from workers.memory import MemoryProfile, cache_budget, gpu_id, measure_peak
from workers.model_runner import ModelRunner, SeqInput
from workers.step_loop import StepLoopEnds, run_target_loop

log = logging.getLogger(__name__)

# Ring slots: put k reuses slot k % 3 once the draft has released put k − 3
# (workers/aux_transport.py). Each slot holds the largest step's rows.
AUX_RING_SLOTS = 3


# The TP group's rendezvous: how long ranks wait for each other at start-up.
STORE_TIMEOUT_S = 600


class TargetWorker(StepLoopEnds):
    def __init__(self, cfg: EngineConfig, aux_layer_ids: tuple[int, ...], rank: int, tp: int,
                 aux_ring_rows: int = 0):
        """`aux_ring_rows` > 0 (rank 0 under Ray, with a draft): aux features go to the draft
        through a ring of that many rows per slot, shared once at start-up."""
        super().__init__()
        setup_logging_if_actor()
        self.cfg, self.rank, self.tp = cfg, rank, tp
        self.aux_layer_ids = aux_layer_ids
        self.aux_ring_rows = aux_ring_rows if rank == 0 and aux_layer_ids else 0
        self.aux_sender: AuxSender | None = None
        # Under Ray, CUDA_VISIBLE_DEVICES holds only this actor's GPU: cuda:0 is it.
        on_gpu = cfg.device.startswith("cuda")
        self.device = torch.device(cfg.device if tp == 1 else "cuda:0") if on_gpu \
            else torch.device("cpu")
        self.model: Qwen3_5MoeForCausalLM | None = None
        self.runner: ModelRunner | None = None
        self.controls: ControlsEnv | None = None  # the sampling controls' (allocate)

    def address(self) -> tuple[str, int]:
        """Rank 0: the process-group rendezvous's address, its node IP and a port listening on
        that IP only (not every interface); the store takes the socket over in init_model."""
        import ray

        host = ray.util.get_node_ip_address()
        self._store_socket = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        self._store_socket.bind((host, 0))
        self._store_socket.listen()
        return host, self._store_socket.getsockname()[1]

    def init_model(self, master_addr: str | None = None,
                   master_port: int | None = None) -> LoadReport:
        """Joins the TP group and loads this rank's shard; returns what the load took."""
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        if self.tp > 1:
            timeout = datetime.timedelta(seconds=STORE_TIMEOUT_S)
            if self.rank == 0:  # serves the store on the socket address() bound
                store = dist.TCPStore(master_addr, master_port, self.tp, True, timeout=timeout,
                                      wait_for_workers=False,
                                      master_listen_fd=self._store_socket.fileno())
            else:
                store = dist.TCPStore(master_addr, master_port, self.tp, False, timeout=timeout)
            dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.tp,
                                    timeout=timeout)
        group = TPGroup(rank=self.rank, size=self.tp)
        start = time.perf_counter()
        self.model = load_target(self.cfg.model, tp=group, dtype=self.cfg.torch_dtype,
                                 device=self.device, load_format=self.cfg.load_format)
        self._sync()
        report = load_report(f"target rank {self.rank}", self.device,
                             weight_bytes(self.model), time.perf_counter() - start)
        self.model.set_kernels(self.cfg.kernels, graphs=self._graphs())
        if self.rank == 0 and self.device.type == "cuda":
            compiled = selection.pdl_compiled(self.cfg.kernels, self.device)
            chains = " and the compiled chains" if compiled else ""
            log.info("Triton kernels%s: %s", chains, "programmatic dependent launch (pdl)"
                     if pdl.enabled() else "plain launches (pdl off)")
        if self.aux_ring_rows:  # before the memory profile, so the ring counts as used
            width = len(self.aux_layer_ids) * self.model.config.hidden_size
            self.aux_sender = make_aux_sender(
                self.device, AUX_RING_SLOTS, self.aux_ring_rows, width, self.model.dtype,
                pair=self.cfg.draft_placement == "separate")
        return report

    def _graphs(self) -> bool:
        """Rounds replay CUDA graphs: on CUDA unless enforce_eager."""
        return self.device.type == "cuda" and not self.cfg.enforce_eager

    def aux_spec(self) -> AuxRingSpec:
        return self.aux_sender.spec()

    def connect_aux(self) -> None:
        """Joins the draft's end of the transport (called together with its open_aux)."""
        self.aux_sender.connect()

    def seal_aux(self) -> None:
        """The draft has opened the ring: drop its shared-memory names."""
        self.aux_sender.seal()

    @torch.inference_mode()
    def profile(self, block_size: int, max_model_len: int) -> MemoryProfile | None:
        """The activation peak of the largest steps the scheduler can issue, at the longest
        context (`largest_steps`), and the GPU memory left. All ranks must call it together
        (the dummy steps run collectives). None on CPU, where nothing is measured."""
        if self.device.type != "cuda":
            return None
        cfg = self.cfg
        peak = measure_peak(self.device, lambda: self.largest_steps(block_size, max_model_len))
        return MemoryProfile(gpu_id(self.device), cache_budget(self.device,
                                                              cfg.gpu_memory_utilization),
                             peak, bytes_per_token(self.model) * cfg.page_size,
                             bytes_per_state_slot(self.model))

    def largest_steps(self, block_size: int, max_model_len: int) -> None:
        """What the profile measures: the last prefill chunk of a max_model_len prompt (a
        full max_num_batched_tokens over the longest cached prefix), then a verify round of
        max_num_seqs blocks at that context through the attention captured rounds use, and
        verify-sized logits + probabilities. The tables run max_model_len long over the few
        pages one chunk needs (entries repeat: the values read do not matter, the sizes do),
        every sequence on one state slot (a verify only reads it)."""
        cfg, model, page_size = self.cfg, self.model, self.cfg.page_size
        tokens = min(cfg.max_num_batched_tokens, max_model_len)
        pages = -(-tokens // page_size)
        table = [i % pages for i in range(-(-max_model_len // page_size))]
        caches = allocate_target_caches(model, pages, page_size, 1, self.device)
        runner = ModelRunner(model, caches, self.aux_layer_ids, self.device)
        runner.prefill([SeqInput(0, [0] * tokens, max_model_len - tokens, table, 0,
                                 SamplingParams())])
        width = min(block_size, max_model_len)
        rounds = [SeqInput(i, [0] * width, max_model_len - width, table, 0, SamplingParams())
                  for i in range(cfg.max_num_seqs)]
        runner.verify(rounds)  # through the round attention allocate chose (init_model)
        del runner, caches
        hidden = torch.zeros(cfg.max_num_seqs * block_size, model.config.hidden_size,
                             dtype=model.dtype, device=self.device)
        torch.softmax(model.compute_logits(hidden).float(), dim=-1)

    def allocate(self, num_pages: int, max_model_len: int, num_snapshots: int = 0) -> None:
        """Caches and runner; on CUDA (unless enforce_eager) rounds replay CUDA graphs with the
        elementwise chains compiled (target/kernels/fused.py), and the caches hold scratch
        pages and a scratch state slot for their padding sequences. `max_model_len`: the
        plan's (cluster/startup.py), which bounds the captured tables' width; `num_snapshots`:
        the prefix cache's state snapshot slots, after the padding slot
        (EnginePlan.snapshot_slots)."""
        cfg, page_size = self.cfg, self.cfg.page_size
        graphs = self._graphs()
        scratch = num_scratch_pages(MAX_GRAPH_WIDTH, page_size) if graphs else 0
        caches = allocate_target_caches(self.model, num_pages + scratch, page_size,
                                        cfg.max_num_seqs + int(graphs or num_snapshots > 0)
                                        + num_snapshots, self.device)
        round_graphs = None
        if graphs:  # (the elementwise chains compile with them: set_kernels in init_model)
            round_graphs = RoundGraphs(
                self.model, caches, self.aux_layer_ids, self.device, cfg.max_num_seqs,
                graph_max_pages(max_model_len, num_pages, page_size),
                list(range(num_pages, num_pages + scratch)), cfg.max_num_seqs)
        self.runner = ModelRunner(self.model, caches, self.aux_layer_ids, self.device,
                                  cfg.seed, round_graphs)
        self.controls = ControlsEnv.for_checkpoint(
            cfg.model, self.model.config.vocab_size, self.device,
            selection.penalties_kernel(cfg.kernels, self.device))

    def serve_steps(self) -> None:
        """The step loop; returns when the driver sends STOP."""
        run_target_loop(self)

    def ping(self) -> int:
        return self.rank

    def time_all_reduce(self, token_counts: list[int], iters: int,
                        bus_bytes: int) -> dict[str, object]:
        """For bench/engine.py --tp (every rank calls it at once): the mean µs of one
        all-reduce of [T, H] in the model dtype for each T (a decoder layer issues two per
        step), back to back as a step issues them, and the bus bandwidth of an all-reduce of
        `bus_bytes` (nccl-tests' busbw: 2(n − 1)/n · bytes / t) over the same group."""
        if self.tp == 1:
            return {}
        hidden, dtype = self.model.config.hidden_size, self.model.dtype

        def mean_us(x: torch.Tensor, n: int) -> float:
            for _ in range(3):
                dist.all_reduce(x)
            self._sync()
            t = time.perf_counter()
            for _ in range(n):
                dist.all_reduce(x)
            self._sync()
            return (time.perf_counter() - t) / n * 1e6

        per_call = {str(t): mean_us(torch.ones(t, hidden, dtype=dtype, device=self.device),
                                    iters) for t in token_counts}
        big = torch.ones(bus_bytes // 2, dtype=torch.bfloat16, device=self.device)
        us = mean_us(big, max(3, iters // 10))
        busbw = 2 * (self.tp - 1) / self.tp * big.numel() * 2 / (us * 1e-6) / 1e9
        return {"all_reduce_us": per_call, "bus_GBps": busbw, "bus_bytes": big.numel() * 2}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def shutdown(self) -> None:
        self.close_channels()
        if self.aux_sender is not None:
            self.aux_sender.close()
        if dist.is_initialized():
            dist.destroy_process_group()
