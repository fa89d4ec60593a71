"""Sizing the KV pool from measured profiles: processes sharing a GPU add up, the tightest GPU
decides, and a pool too small for one full-length sequence is a clear error."""

from __future__ import annotations

import pytest

from cluster.engine import EnginePlan
from configs.engine import EngineConfig
from workers.memory import MemoryProfile, plan_num_pages, plan_snapshots

MiB = 1 << 20


def test_processes_sharing_a_gpu_add_up_and_the_tightest_gpu_decides():
    rank0 = MemoryProfile("gpu0", cache_budget=1000 * MiB, activation_peak=100 * MiB,
                          bytes_per_page=MiB, bytes_per_slot=2 * MiB)
    draft = MemoryProfile("gpu0", cache_budget=990 * MiB, activation_peak=40 * MiB,
                          bytes_per_page=MiB // 2, bytes_per_slot=0)
    rank1 = MemoryProfile("gpu1", cache_budget=1200 * MiB, activation_peak=100 * MiB,
                          bytes_per_page=MiB, bytes_per_slot=2 * MiB)
    # gpu0: (990 − 100 − 40 − 10·2) MiB over 1.5 MiB per page; gpu1: (1200 − 100 − 20) / 1
    assert plan_num_pages([rank0, draft, rank1], num_slots=10, min_pages=8) == 830 * 2 // 3
    assert plan_num_pages([rank1], num_slots=10, min_pages=8) == 1080


def test_too_little_memory_names_what_to_change():
    tight = MemoryProfile("gpu0", cache_budget=50 * MiB, activation_peak=40 * MiB,
                          bytes_per_page=MiB, bytes_per_slot=MiB)
    with pytest.raises(ValueError, match="max_model_len or max_num_seqs.*gpu_memory_utilization"):
        plan_num_pages([tight], num_slots=4, min_pages=16)
    roomy = MemoryProfile("gpu1", cache_budget=4096 * MiB, activation_peak=0,
                          bytes_per_page=MiB, bytes_per_slot=MiB)
    # the figures are the tightest GPU's: what its budget went to, and what one sequence needs
    with pytest.raises(ValueError) as info:
        plan_num_pages([roomy, tight], num_slots=4, min_pages=16)
    assert ("holds 6 KV pages; one full-length sequence needs 16. On GPU gpu0: 0.05 GiB left "
            "within gpu_memory_utilization once the weights were loaded, 0.04 GiB of activation "
            "peaks, 0.00 GiB for 4 state slots (max_num_seqs; 1.0 MiB each), and a full-length "
            "sequence's pages take 0.02 GiB") in str(info.value)


def test_cpu_plans_without_measuring_and_gpu_plans_measure(tiny_demo):
    target, draft = map(str, tiny_demo)
    cpu = EnginePlan.from_config(EngineConfig(model=target, draft_model=draft, max_num_seqs=3,
                                              max_model_len=100, page_size=8))
    assert cpu.min_pages == -(-(100 + cpu.block_size) // 8)
    assert cpu.num_pages == 3 * cpu.min_pages
    assert cpu.with_measured_pages([None], 3) is cpu
    gpu = EnginePlan.from_config(EngineConfig(model=target, device="cuda", max_model_len=100))
    assert gpu.num_pages is None  # decided at start-up from the profiles
    fixed = EnginePlan.from_config(EngineConfig(model=target, device="cuda", num_pages=77))
    assert fixed.num_pages == 77
    profile = MemoryProfile("g", 64 * MiB, 0, MiB, 0)
    assert gpu.with_measured_pages([profile], 1).num_pages == 64


def test_gpu_memory_utilization_is_validated():
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(model="m", gpu_memory_utilization=1.5)


def test_the_profiled_steps_are_the_largest_at_the_longest_context(tiny_demo, monkeypatch):
    """What the start-up profile measures (run here on CPU, where it is not measured): a full
    prefill chunk over the longest prefix, a verify of max_num_seqs blocks there, a context
    write and a proposal for max_num_seqs sequences at that length."""
    from draft.actor import DraftWorker
    from draft.proposer import DraftRunner
    from target.kernels import attention
    from workers.worker import TargetWorker

    target, draft = map(str, tiny_demo)
    cfg = EngineConfig(model=target, draft_model=draft, max_num_seqs=3, max_model_len=1000,
                       max_num_batched_tokens=96, page_size=8)
    calls, proposals = [], []
    real_attention, real_propose = attention.paged_attention, DraftRunner.propose

    def paged_attention(q, k_cache, v_cache, query_lens, seq_lens, *rest):
        calls.append((list(query_lens), list(seq_lens)))
        return real_attention(q, k_cache, v_cache, query_lens, seq_lens, *rest)

    def propose(runner, request):
        proposals.append(list(request.context_lens))
        return real_propose(runner, request)

    monkeypatch.setattr(attention, "paged_attention", paged_attention)
    monkeypatch.setattr(DraftRunner, "propose", propose)
    worker = TargetWorker(cfg, (1, 3), rank=0, tp=1)
    worker.init_model()
    assert worker.profile(4, 1000) is None  # nothing to measure on CPU
    worker.largest_steps(4, 1000)
    prefill, verify = calls[0], calls[-1]
    assert prefill == ([96], [1000])  # the last chunk of a 1000-token prompt
    assert verify == ([4] * 3, [1000] * 3)
    drafter = DraftWorker(cfg, 4, worker.model.embed, worker.model.compute_logits,
                          worker.device)
    drafter.largest_steps(1000)
    assert proposals == [[996] * 3]


def test_the_prefix_caches_snapshots_come_out_of_the_cache_memory(tiny_demo):
    rank0 = MemoryProfile("gpu0", cache_budget=1000 * MiB, activation_peak=100 * MiB,
                          bytes_per_page=MiB, bytes_per_slot=2 * MiB)
    draft = MemoryProfile("gpu0", cache_budget=990 * MiB, activation_peak=40 * MiB,
                          bytes_per_page=MiB // 2, bytes_per_slot=0)
    # a tenth of gpu0's (990 − 100 − 40 − 10·2) MiB, 2 MiB a snapshot; or 0.1 GiB of them
    assert plan_snapshots([rank0, draft], 10, None, 0.1, 4096) == 41
    assert plan_snapshots([rank0, draft], 10, 0.1, 0.1, 4096) == 51
    assert plan_snapshots([rank0, draft], 10, None, 0.1, 20) == 20
    assert plan_snapshots([draft], 10, None, 0.1, 4096) == 0  # no recurrent state

    target, _ = map(str, tiny_demo)
    gpu = EnginePlan.from_config(EngineConfig(model=target, device="cuda", max_num_seqs=10,
                                              max_model_len=100))
    assert gpu.num_snapshots is None  # measured with the pages
    planned = gpu.with_measured_pages([rank0, draft], 10)
    assert planned.num_snapshots == 41
    # the pages get what the snapshots leave: (830 − 41·2) MiB over 1.5 MiB a page
    assert planned.num_pages == (830 - 82) * 2 // 3
    assert planned.snapshot_slots(10) == list(range(11, 52))
    cpu = EnginePlan.from_config(EngineConfig(model=target, max_num_seqs=3, max_model_len=100))
    assert cpu.num_snapshots == 12  # 4 per max_num_seqs on CPU
    off = EnginePlan.from_config(EngineConfig(model=target, max_num_seqs=3, max_model_len=100,
                                              enable_prefix_caching=False))
    assert off.num_snapshots == 0 and off.snapshot_slots(3) == []
