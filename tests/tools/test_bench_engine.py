"""bench/engine.py runs end to end on the tiny preset (so it cannot rot between GPU runs) and
its transformers twin is the same model: identical logits over shared tensors."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bench.random_model import build_target, transformers_twin
from configs.engine import SamplingParams
from configs.presets import target_preset
from workers.cache import allocate_target_caches
from workers.model_runner import ModelRunner, SeqInput

ROOT = Path(__file__).resolve().parents[2]


@torch.inference_mode()
def test_transformers_twin_shares_our_weights_and_matches_logits():
    raw = target_preset("tiny")
    ours = build_target(raw, torch.float32, torch.device("cpu"))
    hf = transformers_twin(ours, raw)
    assert hf.lm_head.weight.data_ptr() == ours.lm_head.weight.data_ptr()
    ids = list(range(5, 40))
    caches = allocate_target_caches(ours, 4, 16, 1, "cpu")
    runner = ModelRunner(ours, caches, (), "cpu")
    batch = runner._batch([SeqInput(0, ids, 0, [0, 1, 2, 3], 0, SamplingParams())], False)
    hidden, _ = ours(batch, caches)
    want = hf(torch.tensor([ids])).logits[0].float()
    torch.testing.assert_close(ours.compute_logits(hidden), want, rtol=1e-4, atol=1e-5)


def test_bench_engine_reports_every_step_with_floors(tmp_path):
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine", "--random-weights", "--preset", "tiny",
         "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1", "2",
         "--block-sizes", "4", "--prompt-len", "16", "40", "--prefill-chunk", "24",
         "--iters", "2", "--warmup", "1", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    # each context in turn, its prompts in prefill steps of at most 24 tokens over the batch
    assert [(x["prompt_len"], x["batch"]) for x in r["ours"]] == [(16, 1), (16, 2), (40, 1),
                                                                   (40, 2)]
    assert r["bandwidth_GBps"] > 0
    for x in r["ours"]:
        for key in ("prefill_tok_per_s", "decode_ms", "decode_floor_ms", "verify_B4_ms",
                    "verify_B4_floor_ms", "draft_B4_ms", "round_B4_ms"):
            assert x[key] > 0, key
        assert set(x["projected_speedup_B4"]) == {"3.0", "5.0", "6.3"}
        assert x["engine_overhead_AR_ms"] > 0
        assert all(v > 0 for v in x["engine_overhead_B4_ms"].values())
        # every timed step's ms in order, wall and inside; the figures are their medians
        samples = x["samples_ms"]
        assert set(samples) == {"prefill", "decode", "verify_B4", "draft_B4", "round_B4"}
        assert len(samples["decode"]["wall"]) == len(samples["decode"]["verify"]) == 2
        assert x["decode_ms"] == pytest.approx(sum(samples["decode"]["wall"]) / 2, abs=1e-3)
        assert x["inside_ms"]["decode"]["verify"] == pytest.approx(
            sum(samples["decode"]["verify"]) / 2, abs=1e-3)
        assert set(samples["round_B4"]) == {"wall", "propose", "verify"}
        assert x["device_only"] == {"decode": None, "verify_B4": None}  # no graphs on CPU
    assert r["transformers"]["decode_ms"] > 0
    assert "| variant | batch |" in proc.stdout
    assert {x["variant"] for x in r["ours"]} == {"baseline"}
    assert all(x["gpu_state"] == {"before": None, "after": None} for x in r["ours"])  # CPU


@pytest.mark.gpu
def test_bench_engine_times_the_device_share_of_its_captured_steps(tmp_path):
    """On CUDA each run also replays its captured decode and verify back to back with their
    logits and argmax (device_only_ms): the GPU's and the host's time per step, in the JSON
    and the table's "GPU ms" columns."""
    out = tmp_path / "engine.json"
    proc = subprocess.run(
        [sys.executable, "-m", "bench.engine", "--random-weights", "--preset", "tiny",
         "--device", "cuda", "--batch-sizes", "1", "2", "--block-sizes", "4",
         "--prompt-len", "40", "--iters", "3", "--warmup", "1", "--no-baseline",
         "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = json.loads(out.read_text())["ours"]
    assert [x["batch"] for x in runs] == [1, 2]
    for x in runs:
        assert set(x["device_only"]) == {"decode", "verify_B4"}
        for d in x["device_only"].values():
            assert d["gpu_ms"] > 0 and d["launch_ms"] > 0
    assert "decode GPU ms" in proc.stdout
    assert all(f"| {d['gpu_ms']:.2f} |" in proc.stdout
               for x in runs for d in x["device_only"].values())


def test_gpu_state_records_what_nvml_answers(monkeypatch):
    """bench.engine.gpu_state: the SM and memory clocks, temperature and power (mW → W) that
    NVML gives, None for one that fails (a host without NVML), and the caching allocator's
    reserved GiB and segments; None on CPU."""
    from bench import engine
    from bench.engine import gpu_state, state_table

    def no_nvml(device=None):
        raise ModuleNotFoundError("pynvml")

    monkeypatch.setattr(torch.cuda, "clock_rate", lambda device=None: 1980)
    monkeypatch.setattr(engine, "_memory_clock", lambda device: 2619)
    monkeypatch.setattr(torch.cuda, "temperature", no_nvml)
    monkeypatch.setattr(torch.cuda, "power_draw", lambda device=None: 412500)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3 << 29)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {
        "segment.all.current": 7})
    state = gpu_state(torch.device("cuda", 0))
    assert state == {"sm_clock_mhz": 1980, "mem_clock_mhz": 2619, "temperature_c": None,
                     "power_w": 412.5, "reserved_gib": 1.5, "segments": 7}
    assert gpu_state(torch.device("cpu")) is None
    results = {"ours": [{"variant": "pdl=off", "batch": 1, "prompt_len": 512,
                         "gpu_state": {"before": state, "after": {**state, "sm_clock_mhz": 1755,
                                                                  "segments": 9}}}]}
    assert state_table(results).splitlines()[-1] == \
        "| pdl=off | 1 | 512 | 1980 / 1755 | 2619 / 2619 | - / - | 412 / 412 | 1.5 / 1.5 | 7 / 9 |"
    monkeypatch.setattr(engine, "_memory_clock", no_nvml)
    assert gpu_state(torch.device("cuda", 0))["mem_clock_mhz"] is None


def test_bench_engine_measures_kernel_variants_in_the_same_run(tmp_path):
    """--variants: each KernelConfig variant measured after the flags' own kernels at every
    batch size, in one process; a name that is no KernelConfig field fails before any run."""
    out = tmp_path / "engine.json"
    base = [sys.executable, "-m", "bench.engine", "--random-weights", "--preset", "tiny",
            "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1", "--block-sizes",
            "4", "--prompt-len", "16", "--iters", "1", "--warmup", "0", "--no-baseline"]
    proc = subprocess.run(base + ["--variants", "gdn_rounds=per-seq",
                                  "moe_routing=torch,moe=reference", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [x["variant"] for x in r["ours"]] == ["baseline", "gdn_rounds=per-seq",
                                                 "moe_routing=torch,moe=reference"]
    assert all(x["round_B4_ms"] > 0 and x["decode_floor_ms"] > 0 for x in r["ours"])
    assert "| gdn_rounds=per-seq | 1 |" in proc.stdout
    bad = subprocess.run(base + ["--variants", "moe=sorted", "expert=pairs"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and "'expert' is not a kernel choice" in bad.stderr


def test_engine_overhead_rounds_commit_what_the_instant_runner_accepts():
    """The overhead bench really runs rounds: with 3 drafts accepted of B − 1 = 7 per round,
    every sequence gains 4 tokens per step."""
    from bench.engine import InstantDrafter, InstantRunner
    from cluster.engine import EnginePlan, LLMEngine
    from cluster.executor import LocalExecutor
    from configs.engine import EngineConfig
    from configs.model import TargetConfig

    plan = EnginePlan(TargetConfig.from_dict(target_preset("tiny")), None, 8, 4096, 256, 1)
    engine = LLMEngine(EngineConfig(model="(none)", max_num_seqs=4),
                       LocalExecutor(InstantRunner(3), InstantDrafter(8)), plan)
    for i in range(4):
        engine.add_request([5, 6, 7], SamplingParams(max_tokens=100, ignore_eos=True), f"r{i}")
    engine.step()  # prefill: one token each
    outs = [engine.step() for _ in range(3)]
    assert all(len(o.new_token_ids) == 4 for step in outs for o in step)
    assert engine.stats.rounds == 12 and engine.stats.mean_acceptance_length == 4


@pytest.mark.ray
# TP 1 as GPU users run it; TP 2 with the draft on its own device (the all-reduce figures
# and the draft's separate hand-off: colocated TP 2 adds nothing the two do not cover)
@pytest.mark.parametrize(("tp", "placement"), [(1, "colocated"), (2, "separate")])
def test_bench_engine_through_the_cluster_path(ray_cluster, tp, placement):
    """--tp N: the steps through the Ray workers and the draft actor (on rank 0's device or
    its own), and at TP > 1 the all-reduce per call for a decode's and a verify's tokens
    against the bus bandwidth."""
    from bench import engine, engine_cluster

    args = engine.parse_args([
        "--random-weights", "--preset", "tiny", "--device", "cpu", "--dtype", "float32",
        "--batch-sizes", "1", "2", "--block-sizes", "4", "--prompt-len", "16", "--iters", "2",
        "--warmup", "1", "--tp", str(tp), "--draft-placement", placement])
    r = engine_cluster.run(args)
    assert r["channel"] == "shm" and r["warmup"]["steps"] >= 3
    assert [x["batch"] for x in r["ours"]] == [1, 2]
    for x in r["ours"]:
        for key in ("prefill_tok_per_s", "decode_ms", "verify_B4_ms", "draft_B4_ms",
                    "round_B4_ms"):
            assert x[key] > 0, key
        inside = x["inside_ms"]  # timed in the actors: the target's step, the draft's proposal
        assert 0 < inside["decode"]["verify"] and 0 < inside["draft_B4"]["propose"]
        assert set(inside["round_B4"]) == {"propose", "verify"}
        if tp == 1:
            assert "all_reduce" not in x
            continue
        ar = x["all_reduce"]
        assert ar["bus_GBps"] > 0
        assert set(ar["by_tokens"]) == {str(x["batch"]), str(4 * x["batch"])}
        for v in ar["by_tokens"].values():
            assert v["us_per_call"] > 0 and v["bus_floor_us_per_call"] > 0
            assert v["ms_per_step"] == pytest.approx(2 * r["layers"] * v["us_per_call"] / 1e3)
    assert "| batch |" in engine_cluster.table(r)


def test_bench_prefill_goes_in_steps_within_the_chunk_budget():
    from bench.steps import Batch
    from workers.messages import StepKind, StepResult

    class Recorder:
        def __init__(self):
            self.msgs = []

        def submit(self, msg):
            self.msgs.append(msg)

        def result(self):
            msg = self.msgs[-1]
            return StepResult(msg.step_id, [[7] if s else [] for s in msg.samples],
                              [0] * len(msg.seq_ids))

    rec = Recorder()
    batch = Batch(rec, 2, 50, 8, 16, 100)
    batch.prefill(chunk=40)  # 20 tokens per sequence per step: 20 + 20 + 10
    assert [(m.kind, m.starts, m.chunk_lens, m.samples) for m in rec.msgs] == [
        (StepKind.PREFILL, [0, 0], [20, 20], [False, False]),
        (StepKind.PREFILL, [20, 20], [20, 20], [False, False]),
        (StepKind.PREFILL, [40, 40], [10, 10], [True, True])]
    assert batch.num_cached == [50, 50] and batch.anchors == [7, 7]
    assert len(rec.msgs[0].new_seqs) == 2 and not rec.msgs[1].new_seqs  # sequences cross once
    rec.msgs.clear()
    batch.prefill()  # None: the whole prompts in one step
    assert [m.chunk_lens for m in rec.msgs] == [[50, 50]]


def test_round_attention_bench_runs_every_form_on_the_same_inputs(tmp_path):
    """bench/round_attention.py on CPU (no timings there; the Triton form needs CUDA or the
    interpreter): the gathered form runs on the paged inputs, and a query's result alone
    equals it inside the block."""
    from bench import round_attention

    out = tmp_path / "round.json"
    round_attention.main(["--device", "cpu", "--keys", "600", "--seqs", "2", "--widths", "1",
                          "4", "--forms", "gathered", "--out", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["seqs"], r["width"]) for r in rows] == [(2, 1), (2, 4)]
    for r in rows:
        assert "gathered_error" not in r and r["gathered_max_diff"] == 0, r
        assert r["gathered_row_invariant"], r


def test_gdn_kernel_bench_runs_every_step_shape_and_prologue(tmp_path):
    """bench/gdn_kernel.py at tiny sizes in Triton's interpreter (a child process: the
    interpreter must be set before triton is imported): decode, verify and commit rows for
    each launch shape it runs there, the same results as the default shape's, and the torch
    and Triton prologues and output norms."""
    out = tmp_path / "gdn.json"
    proc = subprocess.run([sys.executable, "-m", "bench.gdn_kernel", "--device", "cpu",
                           "--small", "--seqs", "2", "--widths", "1", "3", "--out", str(out)],
                          cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    recurrence = [(r["step"], r["width"], r["config"]) for r in rows if r["what"] == "recurrence"]
    assert recurrence == [("decode", 1, "32x4"), ("decode", 1, "16x4"), ("verify", 3, "32x4"),
                          ("verify", 3, "16x4"), ("commit", 3, "32x4"), ("commit", 3, "16x4")]
    # (--small has 16 value columns: both shapes run one 16-column tile, the same program)
    assert all(r.get("rel_err_vs_default", 0.0) == 0.0 for r in rows), rows
    prologues = [(r["what"], r["step"], r["config"]) for r in rows if r["what"] != "recurrence"]
    assert prologues == [(what, step, kind) for step in ("decode", "verify")
                         for what in ("prologue", "norm") for kind in ("torch", "triton")]
    assert all(r["us"] > 0 and r["floor_us"] > 0 for r in rows), rows


def test_linear_kernel_bench_times_every_shape_in_both_layouts(tmp_path):
    """bench/linear_kernel.py at tiny sizes (a child process): every projection and every
    group's stacked weight at every M, as the model stores the weight and transposed, and the
    per-step sums over them."""
    out = tmp_path / "linear.json"
    proc = subprocess.run([sys.executable, "-m", "bench.linear_kernel", "--device", "cpu",
                           "--layouts", "nk", "kn", "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(out.read_text())
    layouts = {(row["n"], row["k"], row["rows"], row["layout"]) for row in r["rows"]}
    for n, k, _ in r["shapes"].values():
        assert {(n, k, m, lay) for m in (1, 3) for lay in ("nk", "kn")} <= layouts
    assert all(row["us"] > 0 for row in r["rows"])
    assert r["per_step"], r


def test_profile_step_sorts_kernels_by_kind():
    """bench/profile_step.py's per-kind view of a step's kernels, over names as the CUDA
    profiler gives them."""
    from bench.profile_step import kernel_kind, kernels_by_kind

    names = {"nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT": "gemm",
             "_gate_up_kernel": "engine triton", "_recurrent_slots_kernel": "engine triton",
             "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "compiled chains",
             "fused_recurrent_gated_delta_rule_fwd_kernel": "fla",
             "void at::native::index_elementwise_kernel<128, 4>": "torch index/gather",
             "void at::native::vectorized_elementwise_kernel<8>": "torch elementwise/reduce",
             "Memcpy DtoD (Device -> Device)": "copies", "something_else": "other"}
    assert {n: kernel_kind(n) for n in names} == names
    kinds = kernels_by_kind([("_down_kernel", 80, 700.0), ("nvjet_x", 40, 400.0),
                             ("triton_poi_fused_mul_silu_0", 40, 80.0)], steps=2)
    assert list(kinds) == ["engine triton", "gemm", "compiled chains"]  # by device time
    assert kinds["engine triton"] == {"launches": 40.0, "ms": 0.35}


def test_profile_step_profiles_the_kinds_asked_over_fresh_caches_each_repeat(tmp_path):
    """bench/profile_step.py end to end on the tiny preset: the steps asked for (a prompt in
    prefill chunks first), once per repeat, each with its wall and kernel times and the
    operator tables appended to --out."""
    from bench import profile_step

    out = tmp_path / "prof.txt"
    rows = profile_step.main(["--preset", "tiny", "--device", "cpu", "--dtype", "float32",
                              "--prompt-len", "40", "--prefill-chunk", "16", "--steps", "1",
                              "--block-size", "4", "--kinds", "decode", "verify",
                              "--repeats", "2", "--out", str(out)])
    assert [(r["step"], r["repeat"]) for r in rows] == [
        ("decode_b1", 0), ("verify_B4_b1", 0), ("decode_b1", 1), ("verify_B4_b1", 1)]
    assert all(r["wall_ms"] > 0 and r["host_syncs"] >= 0 for r in rows)
    assert out.read_text().count('"step": "decode_b1"') == 2
