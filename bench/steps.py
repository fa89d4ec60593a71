"""The step messages a benchmark sends: `Batch`, b sequences driven through an executor (in
process or through the cluster path) by prefill, decode, verify, proposal and round steps, and
`time_steps`, the median of each step kind over a batch. bench/engine.py times them in
process, bench/engine_cluster.py through the Ray actors, bench/profile_step.py profiles them."""

from __future__ import annotations

import statistics

import torch

from bench.timing import sample_times
from cluster.executor import LocalExecutor
from configs.engine import SamplingParams
from workers.cache import allocate_target_caches
from workers.controls import ControlsEnv
from workers.cuda_graphs import MAX_GRAPH_WIDTH, RoundGraphs, num_scratch_pages
from workers.messages import NewSeq, StepKind, StepMsg, StepResult
from workers.model_runner import ModelRunner

GREEDY = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
SEQ_ID_BASE = 1 << 30  # the bench's sequence ids (clear of any engine's warm-up ids)


class Batch:
    """b sequences (seq i in state slot i, pages i·P … (i+1)·P − 1) driven through an
    `executor` with step messages, advanced by every round the bench runs. In process the
    executor is a LocalExecutor over a ModelRunner and a DraftRunner; through the cluster path
    the engine's ChannelExecutor over the Ray actors: the same steps either way."""

    def __init__(self, executor, b: int, prompt_len: int, max_new: int, page_size: int,
                 vocab: int, params: SamplingParams = GREEDY):
        """`params`: every sequence's (sampling controls need the executor's ControlsEnv)."""
        self.executor, self.b, self.vocab, self.params = executor, b, vocab, params
        self.pages = -(-(prompt_len + max_new) // page_size)
        self.tables = [list(range(i * self.pages, (i + 1) * self.pages)) for i in range(b)]
        g = torch.Generator().manual_seed(0)
        self.prompts = [torch.randint(0, vocab, (prompt_len,), generator=g).tolist()
                        for _ in range(b)]
        self.num_cached, self.anchors = [0] * b, [0] * b
        self.seq_ids = [SEQ_ID_BASE + i for i in range(b)]
        self.sent, self.step_id = False, 0
        self.results: list[StepResult] = []  # every step's, with the times measured inside

    @classmethod
    def in_process(cls, target, draft_runner, aux_ids, b: int, prompt_len: int, max_new: int,
                   page_size: int, device: torch.device, cuda_graphs: bool = False,
                   params: SamplingParams = GREEDY, controls: ControlsEnv | None = None
                   ) -> Batch:
        pages = -(-(prompt_len + max_new) // page_size)
        num_pages = b * pages
        scratch = num_scratch_pages(MAX_GRAPH_WIDTH, page_size) if cuda_graphs else 0
        caches = allocate_target_caches(target, num_pages + scratch, page_size, b + 1, device)
        graphs = RoundGraphs(target, caches, aux_ids, device, b, pages,
                             list(range(num_pages, num_pages + scratch)), b) \
            if cuda_graphs else None
        runner = ModelRunner(target, caches, aux_ids, device, graphs=graphs)
        return cls(LocalExecutor(runner, draft_runner, controls), b, prompt_len, max_new,
                   page_size, target.config.vocab_size, params)

    def _run(self, kind: StepKind, **fields) -> StepResult:
        new = [] if self.sent else [
            # the end of sequence its controls see: the vocabulary's last (padding) id
            NewSeq(i, p, t, i - SEQ_ID_BASE, self.params, (self.vocab - 1,)) for i, p, t in
            zip(self.seq_ids, self.prompts, self.tables, strict=True)]
        self.sent = True
        msg = StepMsg(self.step_id, kind, seq_ids=self.seq_ids, new_seqs=new, **fields)
        self.step_id += 1
        self.executor.submit(msg)
        result = self.executor.result()
        self.results.append(result)
        return result

    def prefill(self, chunk: int | None = None) -> StepResult:
        """The whole prompts (again from position 0 on later calls), in steps of at most
        `chunk` tokens over the batch as the scheduler's budget cuts them (None: one step);
        returns the last step's result."""
        n = len(self.prompts[0])
        per_seq = n if chunk is None else max(1, chunk // self.b)
        for start in range(0, n, per_seq):
            k = min(per_seq, n - start)
            last = start + k == n
            out = self._run(StepKind.PREFILL, starts=[start] * self.b, chunk_lens=[k] * self.b,
                            samples=[last] * self.b)
        self.num_cached = [len(p) for p in self.prompts]
        self.anchors = [t[-1] for t in out.new_tokens]
        return out

    def round(self, drafts: list[list[int]] | None = None) -> StepResult:
        """A round; `drafts` given: verify them (the draft sits out), else the draft's."""
        out = self._run(StepKind.ROUND, starts=list(self.num_cached),
                        anchors=list(self.anchors), drafts=drafts)
        for i, (toks, n) in enumerate(zip(out.new_tokens, out.num_accepted, strict=True)):
            self.num_cached[i] += n + 1
            self.anchors[i] = toks[-1]
        return out

    def verify(self, drafts: list[list[int]]) -> StepResult:
        return self.round(drafts)

    def propose(self) -> StepResult:
        return self._run(StepKind.PROPOSE, starts=list(self.num_cached),
                         anchors=list(self.anchors))

    def release(self) -> None:
        self._run(StepKind.RELEASE, released=list(self.seq_ids))
        self.sent = False

    def random_drafts(self, k: int) -> list[list[int]]:
        return torch.randint(0, self.vocab, (self.b, k)).tolist()


def time_steps(batch: Batch, args, sync, block_sizes: list[int],
               set_block=None) -> dict:
    """Median ms of each step kind over batch, as the engine's thread sees it: prefill (once,
    after one warm-up), decode, verify per B, and the draft's proposal and a whole round per B
    in `block_sizes` (`set_block(B)` switches the draft's B where it can; the cluster's is
    fixed). `inside_ms`: the medians of the same steps' proposal and target step as timed
    where they ran (in the actors, through the cluster path): the rest is the control plane."""
    r = {"batch": batch.b, "prompt_len": args.prompt_len}
    inside = r["inside_ms"] = {}  # where the steps ran: the draft's proposal, the target's step

    # every timed step's ms, in order (wall, and where the steps ran): whether a run's median
    # moves with all its steps or with a few slow ones
    samples_ms = r["samples_ms"] = {}

    def timed_ms(name: str, fn, warmup: int, iters: int) -> None:
        samples, _ = sample_times(fn, iters, warmup, sync)
        r[f"{name}_ms"] = statistics.median(samples) * 1e3
        last = batch.results[-iters:]
        kinds = [k for k in ("propose", "verify")
                 if last[0] is not None and getattr(last[0], f"{k}_s") is not None]
        inside[name] = {k: statistics.median(getattr(x, f"{k}_s") for x in last) * 1e3
                        for k in kinds}
        samples_ms[name] = {"wall": [round(x * 1e3, 4) for x in samples],
                            **{k: [round(getattr(x, f"{k}_s") * 1e3, 4) for x in last]
                               for k in kinds}}

    b = batch.b
    timed_ms("prefill", lambda: batch.prefill(args.prefill_chunk), 1, 1)
    r["prefill_tok_per_s"] = b * args.prompt_len / r["prefill_ms"] * 1e3
    timed_ms("decode", lambda: batch.verify([[]] * b), args.warmup, args.iters)
    for B in args.block_sizes:
        timed_ms(f"verify_B{B}", lambda B=B: batch.verify(batch.random_drafts(B - 1)),
                 args.warmup, args.iters)
    for B in block_sizes:
        if set_block is not None:
            set_block(B)
        timed_ms(f"draft_B{B}", batch.propose, args.warmup, args.iters)
        timed_ms(f"round_B{B}", batch.round, args.warmup, args.iters)
    return r
