"""CUDA graphs for the fixed-shape steps: the target's round (S sequences × W tokens: the
forward to the final hidden states, then the commit of the accepted prefix) and the draft's
proposal. Uniform rounds make
the shapes depend only on (S, W) and the block-table width P, so each is captured once per
(batch bucket, W, page bucket) on first use (the engine's warm-up runs every batch bucket at
start-up), and replayed with its inputs copied into static
buffers: one launch instead of thousands. Attention gathers all P pages of every sequence
(masked past its length), so P is bucketed by powers of two.

A batch is padded up to its bucket with dummy sequences that read and write only scratch
pages and a scratch GDN state slot, reserved past what the block manager hands out. Every
graph shares one memory pool (steps never overlap), and a step's outputs are the graph's own
tensors: they are read (or copied) before the next replay.

Capture needs kernels that read no host lists and never sync: the gathered paged attention
(target/kernels/attention.py), batched GDN rounds, grouped-GEMM MoE."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

import numpy as np
import torch

from target.batch import ForwardBatch, TargetCaches
from target.layers.attention import GatedAttention
from target.model import Qwen3_5MoeForCausalLM
from workers.messages import host_tables

logger = logging.getLogger(__name__)

# Batch sizes captured (a batch runs in the smallest bucket that holds it; larger ones eager).
BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
# Widest round (tokens per sequence) captured; scratch pages cover a dummy block this wide.
MAX_GRAPH_WIDTH = 64
# Round shapes kept captured at once (least recently used evicted): each holds its journal
# (GDN keys/values/gates of the block, ~1.4 GB for 64 sequences × 16 tokens of 35B-A3B).
MAX_ROUND_GRAPHS = 16


def bucket_for(n: int, max_seqs: int) -> int | None:
    """The smallest bucket holding n sequences, up to the first bucket ≥ max_seqs; None past
    it (the batch runs eagerly)."""
    top = next((b for b in BUCKETS if b >= max_seqs), BUCKETS[-1])
    return next((b for b in BUCKETS if n <= b <= top), None)


def graph_batch_buckets(max_seqs: int) -> list[int]:
    """Every batch bucket a step of up to max_seqs sequences may run in."""
    top = bucket_for(max_seqs, max_seqs)
    return [b for b in BUCKETS if b <= top]


def page_bucket(pages: int, max_pages: int) -> int | None:
    """The power of two ≥ pages (at least 8) a table is widened to; None past max_pages."""
    if pages > max_pages:
        return None
    return min(max(8, 1 << (max(pages, 1) - 1).bit_length()), max_pages)


def num_scratch_pages(max_width: int, page_size: int) -> int:
    """Pages a dummy sequence's block (W tokens from position 0) occupies."""
    return -(-max_width // page_size)


def graph_max_pages(max_model_len: int, num_pages: int, page_size: int) -> int:
    """The widest block table a captured step takes: a full-length sequence plus a round's
    lookahead, and never more than the pool holds."""
    return max(min(num_pages, -(-(max_model_len + MAX_GRAPH_WIDTH) // page_size)),
               num_scratch_pages(MAX_GRAPH_WIDTH, page_size))


class CapturedCall:
    """fn(inputs) captured once over static device inputs; each call copies new values into
    them and replays. `warmup` runs fn once first (Triton autotuning, compiled FlexAttention,
    cuBLAS handles) — only where running it twice is harmless. Off CUDA nothing is captured:
    each call runs fn on the static inputs (the same padding and buffers, testable on CPU).

    `staged`: every call passes every input, whole, from host memory. The inputs then live
    in one device buffer with a pinned host twin: a call fills the twin and copies it over
    in one transfer, queued without waiting, rather than one pageable copy per input (each
    a driver call that waits for its staging, on the path between a step's sync and its
    launch)."""

    def __init__(self, fn: Callable[[dict[str, torch.Tensor]], object],
                 inputs: dict[str, torch.Tensor], pool, warmup: bool = True,
                 staged: bool = False):
        self.inputs, self.fn, self.graph, self.outputs = inputs, fn, None, None
        self._staging: tuple[torch.Tensor, torch.Tensor, dict] | None = None
        self._copied: torch.cuda.Event | None = None
        if next(iter(inputs.values())).device.type != "cuda":
            return
        if staged:
            self.inputs = inputs = self._stage(inputs)
        if warmup:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                fn(inputs)
            torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(self.graph, pool=pool):
                self.outputs = fn(inputs)
        except RuntimeError:
            # A failed capture leaves the allocator routing this thread's allocations into the
            # pool (capture_end raises before ending that): end it, so later steps and
            # captures work.
            try:
                torch.cuda.memory._cuda_endAllocateToPool(torch.cuda.current_device(), pool)
            except RuntimeError:
                pass  # (not recording: nothing to end)
            raise

    def _stage(self, inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The inputs' values moved into views of one device buffer (each 16-byte aligned);
        its pinned twin's numpy views by name."""
        offsets, size = {}, 0
        for name, t in inputs.items():
            offsets[name] = size = -(-size // 16) * 16
            size += t.numel() * t.element_size()
        device = next(iter(inputs.values())).device
        device_buf = torch.empty(size, dtype=torch.uint8, device=device)
        host_buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        views, host_views = {}, {}
        for name, t in inputs.items():
            at = slice(offsets[name], offsets[name] + t.numel() * t.element_size())
            views[name] = device_buf[at].view(t.dtype).view(t.shape)
            views[name].copy_(t)
            host_views[name] = host_buf[at].view(t.dtype).view(t.shape).numpy()
        self._staging = (device_buf, host_buf, host_views)
        return views

    def __call__(self, **values: torch.Tensor):
        if self._staging is not None:
            self._transfer(values)
        else:
            # A value may be smaller than its buffer (block tables: the pages in use): it
            # fills the leading corner, and what lies past it is never read (masked by the
            # lengths).
            for name, value in values.items():
                dst = self.inputs[name]
                if value.shape != dst.shape:
                    dst = dst[tuple(slice(0, n) for n in value.shape)]
                dst.copy_(value, non_blocking=True)
        if self.graph is None:
            self.outputs = self.fn(self.inputs)
        else:
            self.graph.replay()
        return self.outputs

    def _transfer(self, values: dict[str, torch.Tensor]) -> None:
        """A staged call's inputs: into the pinned twin, then over in one transfer."""
        device_buf, host_buf, host_views = self._staging
        if values.keys() != host_views.keys() or any(
                v.shape != host_views[k].shape for k, v in values.items()):
            raise ValueError("a staged call takes every input whole: "
                             f"{sorted(host_views)}, got {sorted(values)}")
        if self._copied is not None:  # the last call's transfer has read the twin
            self._copied.synchronize()
        else:
            self._copied = torch.cuda.Event()
        for name, value in values.items():
            host_views[name][...] = value.numpy()
        device_buf.copy_(host_buf, non_blocking=True)
        self._copied.record()


def capture_or_log(capture: Callable[[], object], what: str, key: tuple, failed: dict):
    """capture(), or None after logging why (recorded in failed[key]): a shape that cannot be
    captured runs eagerly rather than failing the step."""
    try:
        return capture()
    except RuntimeError as e:  # torch.AcceleratorError included
        failed[key] = f"{type(e).__name__}: {e}"
        logger.warning("CUDA graph capture of the %s %s failed; it runs eagerly", what, key,
                       exc_info=True)
        return None


class _RoundStep:
    """One (S, W) bucket: the forward graph and the commit graph reading its journal (none for
    W = 1: those rounds commit in the forward)."""

    def __init__(self, forward: CapturedCall, commit: CapturedCall | None):
        self.forward, self.commit = forward, commit


class RoundGraphs:
    """The target's uniform verify rounds as CUDA graphs per (S bucket, W, P bucket).
    `forward` returns the bucket-sized final hidden states [S'·W, H] (logits are one GEMM the
    caller runs over the real rows: a graph's own [S'·W, V] fp32 logits would pin ~1 GB per
    large shape), aux [S'·W, n_aux·H] and the static ForwardBatch (its first S sequences are
    the real ones); `commit` then advances the GDN states of those S. At most `max_graphs`
    shapes stay captured (least recently used evicted: their memory returns to the pool)."""

    def __init__(self, model: Qwen3_5MoeForCausalLM, caches: TargetCaches,
                 aux_layer_ids: tuple[int, ...], device: torch.device, max_seqs: int,
                 max_pages: int, scratch_pages: list[int], scratch_slot: int,
                 max_graphs: int = MAX_ROUND_GRAPHS):
        for m in model.modules():  # a paged attention that reads only device tensors
            if isinstance(m, GatedAttention) and m.round_attention == "reference":
                m.round_attention = "gathered"
        self.model, self.caches, self.aux_layer_ids = model, caches, aux_layer_ids
        self.device, self.max_seqs, self.max_pages = device, max_seqs, max_pages
        self.page_size = caches.page_size
        self.scratch_pages = torch.tensor(scratch_pages, dtype=torch.int32)
        self.scratch_slot = scratch_slot
        self.pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        self.steps: OrderedDict[tuple[int, int, int], _RoundStep] = OrderedDict()
        self.max_graphs, self.evictions = max_graphs, 0
        # Shapes whose capture failed (key → error): they run eagerly from then on.
        self.failed: dict[tuple[int, int, int], str] = {}
        self._current: tuple[_RoundStep, int, int] | None = None

    def fits(self, n_seqs: int, width: int, table_width: int) -> bool:
        return (bucket_for(n_seqs, self.max_seqs) is not None
                and page_bucket(max(table_width, len(self.scratch_pages)), self.max_pages)
                is not None and width <= len(self.scratch_pages) * self.page_size)

    def forward(self, seqs: list, width: int
                ) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch] | None:
        """seqs: ModelRunner's SeqInputs, `width` tokens each. None if this shape could not be
        captured (the caller runs it eagerly)."""
        n_seqs = len(seqs)
        padded = bucket_for(n_seqs, self.max_seqs)
        table_width = max(len(s.block_table) for s in seqs)
        pages = page_bucket(max(table_width, len(self.scratch_pages)), self.max_pages)
        key = (padded, width, pages)
        if key in self.failed:
            return None
        host = self._inputs(seqs, padded, width, pages)
        step = self.steps.get(key)
        if step is None:
            while len(self.steps) >= self.max_graphs:
                self.steps.popitem(last=False)
                self.evictions += 1
            step = capture_or_log(lambda: self._capture(padded, width, host), "round", key,
                                  self.failed)
            if step is None:
                return None
            self.steps[key] = step
        self.steps.move_to_end(key)
        hidden, aux, batch = step.forward(**host)
        self._current = (step, n_seqs, padded)
        return hidden, aux, batch

    def commit(self, num_kept: list[int] | torch.Tensor) -> None:
        """num_kept per real sequence: a host list, or a device tensor (no sync: the GPU goes
        on from acceptance to the commit)."""
        step, n_seqs, padded = self._current
        self._current = None
        if step.commit is None:
            return
        if isinstance(num_kept, torch.Tensor):
            kept = torch.nn.functional.pad(num_kept.long(), (0, padded - n_seqs))
        else:
            kept = torch.tensor(num_kept + [0] * (padded - n_seqs), dtype=torch.long)
        step.commit(num_kept=kept)

    def _inputs(self, seqs: list, padded: int, width: int, pages: int
                ) -> dict[str, torch.Tensor]:
        """The step's CPU inputs padded to the bucket, built in numpy from Python lists in a
        fixed number of array operations whatever the bucket (a torch op on a small CPU tensor
        costs several µs, a numpy one well under one; the host work lies between a step's
        sync and the next launch). Padding sequences: W tokens from position 0 in the scratch
        pages, the scratch state slot."""
        page_size, n = self.page_size, len(seqs)
        tables = np.zeros((padded, pages), np.int32)  # entries past a table: page 0
        tables[:n] = host_tables([s.block_table if s.block_table_t is None else s.block_table_t
                                  for s in seqs], pages)
        tables[n:, : len(self.scratch_pages)] = self.scratch_pages.numpy()
        starts = np.zeros(padded, np.int64)  # padding sequences start at position 0
        starts[:n] = [s.start_pos for s in seqs]
        pos = (starts[:, None] + np.arange(width)).reshape(-1)  # [S'·W]
        seq_of = np.repeat(np.arange(padded), width)  # [S'·W]
        input_ids = np.zeros(padded * width, np.int64)
        input_ids[: n * width] = [t for s in seqs for t in s.token_ids]
        state_slots = np.full(padded, self.scratch_slot, np.int64)
        state_slots[:n] = [s.state_slot for s in seqs]
        tap_slots = np.full(padded, -1, np.int64)  # (the commit's; padding taps nothing)
        tap_slots[:n] = [s.tap_slot for s in seqs]
        tap_ends = np.zeros(padded, np.int64)
        tap_ends[:n] = [s.tap_end for s in seqs]
        arrays = {
            "input_ids": input_ids,
            "positions": pos,
            "slot_mapping": (tables[seq_of, pos // page_size].astype(np.int64) * page_size
                             + pos % page_size),
            "block_tables": tables,
            "seq_lens": starts + width,
            "state_slots": state_slots,
            "tap_slots": tap_slots,
            "tap_ends": tap_ends,
        }
        return {name: torch.from_numpy(a) for name, a in arrays.items()}

    def _capture(self, padded: int, width: int, host: dict[str, torch.Tensor]) -> _RoundStep:
        static = {name: t.to(self.device, copy=True) for name, t in host.items()}
        # Warm-up, capture and the journal-filling replay run on these inputs before the real
        # call: every sequence points at the scratch GDN slot, so a one-token round (which
        # commits its states in place) cannot advance a real sequence's state early.
        static["state_slots"].fill_(self.scratch_slot)
        static["tap_slots"].fill_(-1)

        def batch_of(inputs: dict[str, torch.Tensor]) -> ForwardBatch:
            # Host lists a captured forward may not read are None (kernels read the tensors).
            return ForwardBatch(
                input_ids=inputs["input_ids"], positions=inputs["positions"],
                query_lens=[width] * padded, seq_lens=None, slot_mapping=inputs["slot_mapping"],
                block_tables=inputs["block_tables"], state_slots=None,
                is_verify=[True] * padded, aux_layer_ids=self.aux_layer_ids,
                seq_lens_t=inputs["seq_lens"], state_slots_t=inputs["state_slots"])

        def forward(inputs):
            # Writes the block's K/V (the same values each run) and journals; states untouched.
            batch = batch_of(inputs)
            hidden, aux = self.model(batch, self.caches)
            return hidden, aux, batch

        fwd = CapturedCall(forward, static, self.pool, staged=True)
        if fwd.graph is not None:  # capture ran nothing: fill the journal the commit reads
            fwd.graph.replay()
        if width == 1:  # a one-token round commits in its forward: nothing to capture
            return _RoundStep(fwd, None)
        kept = {"num_kept": torch.zeros(padded, dtype=torch.long, device=self.device)}
        # Over the forward's journal (fixed once captured) and its tap slots (the forward's
        # input). Warmed up with num_kept = 0, which leaves every state exactly as it was
        # (given a journal of finite values: above) and reaches no boundary.
        commit = CapturedCall(
            lambda inputs: self.model.commit_verify(fwd.outputs[2], self.caches,
                                                    inputs["num_kept"], fwd.inputs["tap_slots"],
                                                    fwd.inputs["tap_ends"]),
            kept, self.pool)
        return _RoundStep(fwd, commit)
