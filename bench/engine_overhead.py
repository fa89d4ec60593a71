"""Host time of the engine's own bookkeeping per round (scheduler, sequences, step messages,
stop checks, outputs), with a runner and drafter that return at once behind the in-process
executor: the t_overhead of the projected speedup. Device-independent: it measures Python,
not kernels."""

from __future__ import annotations

import statistics
import time
from dataclasses import replace

import torch

from cluster.engine import EnginePlan, LLMEngine
from cluster.executor import LocalExecutor
from configs.engine import EngineConfig, SamplingParams
from workers.messages import ContextWrite, ProposeRequest
from workers.model_runner import SeqInput, StepOutput


class InstantRunner:
    """Accepts `accept` drafts per round and emits token 1 (never EOS)."""

    def __init__(self, accept: int):
        self.accept = accept

    def prefill(self, seqs: list[SeqInput]) -> StepOutput:
        n = [len(s.token_ids) for s in seqs]
        return StepOutput([[1] if s.sample else [] for s in seqs], [0] * len(seqs), n, None,
                          torch.zeros(sum(n), dtype=torch.long))

    def verify(self, seqs: list[SeqInput]) -> StepOutput:
        k = [min(self.accept, len(s.token_ids) - 1) for s in seqs]
        toks = [s.token_ids[1 : a + 1] + [1] for s, a in zip(seqs, k, strict=True)]
        return StepOutput(toks, k, [a + 1 for a in k], None,
                          torch.zeros(sum(a + 1 for a in k), dtype=torch.long))

    def release(self, seq_id: int) -> None:
        pass


class InstantDrafter:
    def __init__(self, block: int):
        self.block = block

    def propose(self, req: ProposeRequest) -> torch.Tensor:
        return torch.full((len(req.anchors), self.block - 1), 2, dtype=torch.long)

    def write_context(self, write: ContextWrite) -> None:
        pass


def engine_overhead_ms(plan: EnginePlan, batch: int, block: int, accept: int,
                       rounds: int = 50) -> float:
    """Median host milliseconds of one LLMEngine.step() (a round) for `batch` sequences."""
    page = 16
    plan = replace(plan, block_size=block, max_model_len=1 << 20,
                   num_kv_blocks=batch * (-(-(64 + rounds * 4 * block) // page) + 1))
    cfg = EngineConfig(model="(none)", max_num_seqs=batch, kv_block_size=page,
                       max_num_batched_tokens=1 << 20)
    engine = LLMEngine(cfg, LocalExecutor(InstantRunner(accept), InstantDrafter(block)), plan)
    params = SamplingParams(max_tokens=rounds * 4 * block, ignore_eos=True)
    for i in range(batch):
        engine.add_request(list(range(2, 66)), params, f"r{i}")
    engine.step()  # the prefill
    samples = []
    for _ in range(rounds):
        t = time.perf_counter()
        engine.step()
        samples.append((time.perf_counter() - t) * 1e3)
    return statistics.median(samples[5:])
