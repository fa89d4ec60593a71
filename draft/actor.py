"""The DFlash draft as its own Ray actor, colocated with TP rank 0 (a fractional GPU of the
same bundle) or on a GPU of its own. Under Ray it loads the target's embedding and lm_head
itself: the draft embeds its block and reads its logits through them; in process it borrows the
target's.

Start-up mirrors TargetWorker: construct (weights) → `open_aux` → `profile` → `allocate` (KV
pool); then `serve_steps` runs its step loop (workers/step_loop.py)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from configs.engine import EngineConfig
from configs.logs import setup_logging_if_actor
from draft.model import DFlashDraftModel
from draft.proposer import DraftRunner
from draft.replay import replay_for
from target.loader import load_embedding_and_head
from workers.aux_transport import AuxReceiver, AuxRingSpec
from workers.controls import ControlsEnv
from workers.cuda_graphs import graph_max_pages
from workers.load_report import LoadReport, load_report, weight_bytes
from workers.memory import MemoryProfile, cache_budget, gpu_id, measure_peak
from workers.messages import ContextWrite, ProposeRequest
from workers.step_loop import StepLoopEnds, run_draft_loop


class DraftWorker(StepLoopEnds):
    def __init__(self, cfg: EngineConfig, block_size: int,
                 embed: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 device: torch.device | None = None):
        super().__init__()
        setup_logging_if_actor()
        self.cfg, self.block_size = cfg, block_size
        on_gpu = cfg.device.startswith("cuda")
        self.device = device or (torch.device("cuda", 0) if on_gpu else torch.device("cpu"))
        start = time.perf_counter()
        self.model = DFlashDraftModel.from_pretrained(cfg.draft_model, dtype=cfg.torch_dtype,
                                                      device=self.device, block_size=block_size,
                                                      load_format=cfg.load_format)
        self.model.set_kernels(cfg.kernels, graphs=self.device.type == "cuda"
                               and not cfg.enforce_eager)
        embed_module = None
        if embed is None:
            embed_module, head = load_embedding_and_head(cfg.model, cfg.torch_dtype, self.device,
                                                         cfg.load_format)
            embed, lm_head = embed_module, (lambda h: head(h).float())
        self.embed, self.lm_head = embed, lm_head
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        own = (embed_module, head) if embed_module is not None else ()
        self._load = load_report("draft", self.device, weight_bytes(self.model, *own),
                                 time.perf_counter() - start)
        self.runner: DraftRunner | None = None
        # benchmarks: the proposals rewritten to a chosen acceptance (draft/replay.py)
        self.replay = replay_for(cfg.acceptance_replay, block_size, cfg.seed)
        self.controls: ControlsEnv | None = None  # grammars for its proposals (allocate)
        self.aux_receiver: AuxReceiver | None = None

    def _runner(self, num_pages: int, max_model_len: int, graphs: bool = False) -> DraftRunner:
        cfg = self.cfg
        graphs = graphs and self.device.type == "cuda" and not cfg.enforce_eager
        return DraftRunner(self.model, num_pages, cfg.page_size, self.block_size,
                           self.embed, self.lm_head, self.device,
                           graph_max_seqs=cfg.max_num_seqs if graphs else 0,
                           graph_max_pages=graph_max_pages(max_model_len, num_pages,
                                                           cfg.page_size))

    @torch.inference_mode()
    def profile(self, max_model_len: int) -> MemoryProfile | None:
        """Peak of the largest steps (`largest_steps`). None on CPU."""
        if self.device.type != "cuda":
            return None
        cfg = self.cfg
        peak = measure_peak(self.device, lambda: self.largest_steps(max_model_len))
        d = self.model.cfg
        per_page = (len(self.model.layers) * 2 * cfg.page_size * d.num_key_value_heads
                    * d.head_dim * cfg.torch_dtype.itemsize)
        return MemoryProfile(gpu_id(self.device), cache_budget(self.device,
                                                              cfg.gpu_memory_utilization),
                             peak, per_page, 0)

    def largest_steps(self, max_model_len: int) -> None:
        """A context write of max_num_batched_tokens features at the end of a max_model_len
        context, then a proposal for max_num_seqs sequences over max_model_len − B context
        tokens (tables max_model_len long over the pages one write needs: the sizes matter,
        not what the pages hold)."""
        cfg = self.cfg
        tokens = min(cfg.max_num_batched_tokens, max_model_len)
        pages = -(-tokens // cfg.page_size)
        runner = self._runner(pages, max_model_len)
        table = [i % pages for i in range(-(-max_model_len // cfg.page_size))]
        aux = torch.zeros(tokens, self.model.cfg.aux_hidden_size, dtype=cfg.torch_dtype,
                          device=self.device)
        positions = torch.arange(max_model_len - tokens, max_model_len)
        runner.write_context(ContextWrite(aux, positions, [table], [tokens]))
        context = max(max_model_len - self.block_size, 1)
        runner.propose(ProposeRequest([0] * cfg.max_num_seqs, [context] * cfg.max_num_seqs,
                                      [table] * cfg.max_num_seqs))

    def allocate(self, num_pages: int, max_model_len: int) -> None:
        """`max_model_len`: the plan's (cluster/startup.py)."""
        self.runner = self._runner(num_pages, max_model_len, graphs=True)
        self.controls = ControlsEnv.for_checkpoint(self.cfg.model, self.model.cfg.vocab_size,
                                                   self.device)

    def open_aux(self, spec: AuxRingSpec) -> None:
        self.aux_receiver = AuxReceiver.open(spec, self.device)

    def serve_steps(self) -> None:
        """The step loop; returns when the driver sends STOP."""
        run_draft_loop(self)

    def ping(self) -> bool:
        return True

    def load_report(self) -> LoadReport:
        """What the weight load (in the constructor) took."""
        return self._load
