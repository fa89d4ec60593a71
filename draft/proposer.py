"""The draft side of a round: keep the draft's context KV in step with committed tokens and
propose a block per sequence. Shares page ids (block tables) with the target: the draft's
context KV for position p lives in the same page/offset of its own pool."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from draft.model import DFlashDraftModel
from workers.cuda_graphs import (
    MAX_GRAPH_WIDTH,
    CapturedCall,
    bucket_for,
    capture_or_log,
    graph_batch_buckets,
    num_scratch_pages,
    page_bucket,
)
from workers.messages import ContextWrite, ProposeRequest, host_tables


class DraftRunner:
    """`graph_max_seqs` > 0 (CUDA): proposals replay a CUDA graph per (batch bucket, B, page
    bucket) up to that many sequences and tables up to `graph_max_pages` wide
    (workers/cuda_graphs.py); the cache then holds scratch pages past num_pages for the
    padding sequences. Context writes of up to bucket · B rows (a round's committed tokens;
    short prefill chunks) replay one graph per row bucket too: eagerly a write is ~240 small
    ops for the 8-layer draft (fc, norm, RoPE, each layer's k/v projections and norms, the
    cache stores), all host launch time at round sizes. Longer writes run eagerly."""

    def __init__(self, model: DFlashDraftModel, num_pages: int, page_size: int, block_size: int,
                 embed: Callable[[torch.Tensor], torch.Tensor],
                 lm_head: Callable[[torch.Tensor], torch.Tensor], device: torch.device | str,
                 graph_max_seqs: int = 0, graph_max_pages: int = 0):
        self.model = model
        self.page_size = page_size
        self.block_size = block_size  # B: anchor + B−1 proposed tokens
        self.embed = embed
        self.lm_head = lm_head
        self.device = torch.device(device)
        self.graph_max_seqs, self.graph_max_pages = graph_max_seqs, graph_max_pages
        scratch = num_scratch_pages(MAX_GRAPH_WIDTH, page_size) if graph_max_seqs else 0
        self.kv_cache = model.allocate_kv_cache(num_pages + scratch, page_size)
        self.scratch_pages = torch.arange(num_pages, num_pages + scratch, dtype=torch.int32)
        self.graphs: dict[tuple[int, int, int, int], CapturedCall] = {}  # (S, B, P, top_k)
        # Context writes by padded row count; their rows past the real ones go to the first
        # scratch page's slots (never read: padding sequences have no context).
        self.write_graphs: dict[int, CapturedCall] = {}
        self.write_rows = [b * block_size for b in graph_batch_buckets(graph_max_seqs)] \
            if graph_max_seqs else []
        # shapes that run eagerly: proposals (S, B, P, top_k), writes ("write", rows)
        self.failed: dict[tuple, str] = {}
        # (off CUDA: the same static buffers, run without capture)
        self.pool = torch.cuda.graph_pool_handle() if self.device.type == "cuda" else None

    @property
    def num_draft_tokens(self) -> int:
        return self.block_size - 1

    @torch.inference_mode()
    def write_context(self, write: ContextWrite) -> None:
        """aux [N, n_aux·H] of committed tokens, `counts[i]` of them for sequence i, in order."""
        # numpy on the host copy of the positions: a fixed number of array operations, no
        # per-token Python (prefill chunks) and no per-op cost of small torch tensors (rounds)
        pos = write.positions.cpu().long().numpy()  # [N]
        if len(pos) == 0:
            return
        page_size = self.page_size
        # only the pages the written positions fall in
        tables = host_tables(write.block_tables, int(pos.max()) // page_size + 1)
        seq_of = np.repeat(np.arange(len(write.counts)), write.counts)
        slots = tables[seq_of, pos // page_size].astype(np.int64) * page_size + pos % page_size
        aux = write.aux.to(self.device)
        rows = next((r for r in self.write_rows if r >= len(pos)), None)
        if rows is None or ("write", rows) in self.failed or not self._replay_write(
                rows, aux, pos, slots):
            self.model.write_context(aux, torch.from_numpy(pos).to(self.device),
                                     torch.from_numpy(slots).to(self.device), self.kv_cache)

    def _replay_write(self, rows: int, aux: torch.Tensor, pos: np.ndarray,
                      slots: np.ndarray) -> bool:
        """The write padded to `rows` through its graph; False if it cannot be captured."""
        n = len(pos)
        padded_pos = np.zeros(rows, np.int64)
        padded_pos[:n] = pos
        # the padding rows' slots: the first scratch page's
        padded_slots = int(self.scratch_pages[0]) * self.page_size \
            + np.arange(rows, dtype=np.int64) % self.page_size
        padded_slots[:n] = slots
        pos_t, slots_t = torch.from_numpy(padded_pos), torch.from_numpy(padded_slots)
        call = self.write_graphs.get(rows)
        if call is None:
            static = {"aux": torch.zeros(rows, aux.shape[1], dtype=aux.dtype, device=self.device),
                      "positions": pos_t.to(self.device), "slots": slots_t.to(self.device)}
            static["aux"][:n] = aux

            def write(inputs: dict[str, torch.Tensor]) -> None:
                self.model.write_context(inputs["aux"], inputs["positions"], inputs["slots"],
                                         self.kv_cache)

            call = capture_or_log(lambda: CapturedCall(write, static, self.pool),
                                  "context write", ("write", rows), self.failed)
            if call is None:
                return False
            self.write_graphs[rows] = call
        call(aux=aux, positions=pos_t, slots=slots_t)  # aux fills the first n rows
        return True

    @torch.inference_mode()
    def propose(self, req: ProposeRequest, top_k: int = 0,
                block_size: int | None = None) -> torch.Tensor:
        """Returns [S, B−1] proposed tokens (argmax at every temperature); with top_k,
        [S, B−1, top_k]: each position's best top_k, best first. `block_size`: B for this
        proposal (at most the runner's; default the runner's)."""
        block = self.block_size if block_size is None else block_size
        if not 2 <= block <= self.block_size:
            raise ValueError(f"a proposal's block size must be in [2, {self.block_size}], "
                             f"got {block}")
        anchors, context_lens, block_tables = req.anchors, req.context_lens, req.block_tables
        # Only the pages holding context and the block: their count bounds the attention's
        # gather width (and holds the block's slots where the triton path writes its K/V).
        width = -(-(max(context_lens) + block) // self.page_size)
        padded = bucket_for(len(anchors), self.graph_max_seqs) if self.graph_max_seqs else None
        pages = page_bucket(max(width, len(self.scratch_pages)), self.graph_max_pages)
        out = None
        if padded is not None and pages is not None and block <= MAX_GRAPH_WIDTH \
                and (padded, block, pages, top_k) not in self.failed:
            out = self._replay(padded, pages, width, anchors, context_lens, block_tables,
                               top_k, block)
        if out is None:
            tables = torch.from_numpy(host_tables(block_tables, width))
            return self.model.propose(torch.tensor(anchors, device=self.device),
                                      torch.tensor(context_lens, device=self.device),
                                      tables.to(self.device), self.kv_cache, self.embed,
                                      self.lm_head, block, top_k)
        return out[: len(anchors)].clone()

    def _replay(self, padded: int, pages: int, width: int, anchors: list[int],
                context_lens: list[int], block_tables: list, top_k: int, block: int
                ) -> torch.Tensor | None:
        # Padding sequences: anchor 0, no context, the block in the scratch pages. The wider
        # table only adds masked keys to the attention's gather.
        n = len(anchors)
        anchors_np, lens_np = np.zeros(padded, np.int64), np.zeros(padded, np.int64)
        anchors_np[:n], lens_np[:n] = anchors, context_lens
        full = np.zeros((padded, pages), np.int32)  # past `width` pages: page 0
        full[:n, :width] = host_tables(block_tables, width)
        full[n:, : len(self.scratch_pages)] = self.scratch_pages.numpy()
        anchors, lens, full = map(torch.from_numpy, (anchors_np, lens_np, full))
        key = (padded, block, pages, top_k)
        if key not in self.graphs:
            static = {"anchors": anchors.to(self.device), "context_lens": lens.to(self.device),
                      "block_tables": full.to(self.device)}

            def propose(inputs: dict[str, torch.Tensor]) -> torch.Tensor:
                return self.model.propose(inputs["anchors"], inputs["context_lens"],
                                          inputs["block_tables"], self.kv_cache, self.embed,
                                          self.lm_head, block, top_k)

            call = capture_or_log(lambda: CapturedCall(propose, static, self.pool, staged=True),
                                  "proposal", key, self.failed)
            if call is None:
                return None
            self.graphs[key] = call
        return self.graphs[key](anchors=anchors, context_lens=lens, block_tables=full)
