"""Tensor parallelism on CPU (gloo, spawned processes, no Ray): TP 2 and TP 4 give the TP 1
logits through prefill, verify, partial commit and verify again, on the torch kernels and on
the Triton round kernels (in Triton's interpreter); each rank holds exactly its shard of every
parameter (the sharding rules of target/layers/linear.py)."""

from __future__ import annotations

import socket
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from tp_worker import TRITON_ROUNDS, reference, run_rank

from configs.model import TargetConfig
from target.distributed import TPGroup
from target.loader import load_target

# fp32. Summation order differs across TP sizes, and the tiny random model amplifies it: a 1e-7
# relative change of the GDN out_proj weights moves its logits (|max| ~18) by ~5e-6, and TP 2/4
# land 5–7e-6 from TP 1 (an earlier init of the tiny model reached 4e-5). Sharding bugs move
# logits by 1e-1 or more, so the bound sits well above rounding and far below any bug.
ATOL = 5e-5
RUN_TIMEOUT_S = 120  # a hung collective must fail the test, never hang the suite


@pytest.fixture(scope="module")
def single_rank(tiny_models):
    cache: dict[str, dict[str, torch.Tensor]] = {}

    def get(layout: str, scenario: str = "forwards") -> dict[str, torch.Tensor]:
        if (layout, scenario) not in cache:
            cache[layout, scenario] = reference(tiny_models / layout, scenario)
        return cache[layout, scenario]

    return get


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_tp(model_dir: Path, size: int, out_dir: Path, scenario: str = "forwards",
           kernels: dict[str, str] | None = None) -> list[dict[str, torch.Tensor]]:
    """Spawns `size` ranks, waits for all of them, returns each rank's outputs (tp_worker's
    `scenario`, with `kernels` set on the model)."""
    args = (size, free_port(), str(model_dir), str(out_dir), scenario, kernels)
    ctx = mp.start_processes(run_rank, args=args, nprocs=size, join=False, start_method="spawn")
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        # join() raises as soon as one rank fails, after terminating the others; it returns
        # True once every rank exited cleanly.
        while not ctx.join(timeout=1.0):
            if time.monotonic() > deadline:
                raise TimeoutError(f"TP={size} ranks did not finish within {RUN_TIMEOUT_S} s")
    except Exception as e:
        errors = "\n".join(f"--- {p.name}:\n{p.read_text()}" for p in sorted(out_dir.glob("*.err")))
        raise AssertionError(f"TP={size} run failed: {e}\n{errors}") from e
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.terminate()
        for p in ctx.processes:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [torch.load(out_dir / f"rank{r}.pt") for r in range(size)]


@pytest.mark.parametrize(
    "layout, size",
    [("target-published", 2), ("target", 2),
     ("target", 4)],  # tp 4 > 2 kv heads: replicated
)
def test_tp_forwards_match_single_rank(tiny_models, single_rank, tmp_path, layout, size):
    assert_ranks_match(run_tp(tiny_models / layout, size, tmp_path), single_rank(layout), size)


@pytest.mark.parametrize("size", [2, 4])  # tp 2: one kv head a rank; tp 4: kv heads replicated
def test_tp_triton_rounds_match_single_rank(tiny_models, single_rank, tmp_path, monkeypatch,
                                            size):
    """The Triton round kernels on each rank's local heads (the attention and its prologue:
    local query heads, kv heads sharded or replicated; the GDN prologue: local key and value
    heads and conv channels, a decode's states written in place) against TP 1 on the torch
    kernels. The two kernel sets differ at TP 1 by < 1e-5 here, well inside ATOL. The ranks
    run on CPU, spawned with TRITON_INTERPRET=1: the kernels run in Triton's interpreter (the
    test process keeps its own Triton as it is)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    ranks = run_tp(tiny_models / "target", size, tmp_path, "rounds", TRITON_ROUNDS)
    assert_ranks_match(ranks, single_rank("target", "rounds"), size)


def assert_ranks_match(ranks: list[dict[str, torch.Tensor]],
                       expected: dict[str, torch.Tensor], size: int) -> None:
    assert ranks[0].keys() == expected.keys()
    for name, want in expected.items():
        torch.testing.assert_close(ranks[0][name], want, atol=ATOL, rtol=0,
                                   msg=lambda m, name=name: f"{name}: {m}")
        for r in range(1, size):  # every rank sees the same all-reduced / all-gathered values
            torch.testing.assert_close(ranks[r][name], ranks[0][name], atol=0, rtol=0,
                                       msg=lambda m, name=name, r=r: f"rank {r}, {name}: {m}")


# --------------------------------------------------------------------------------------------
# Each rank holds only its shard
# --------------------------------------------------------------------------------------------


def _split(t: torch.Tensor, dim: int, parts: int, idx: int) -> torch.Tensor:
    return t.chunk(parts, dim)[idx]


def _split_segments(t: torch.Tensor, sizes: list[int], dim: int, parts: int, idx: int):
    # Fused [a | b | …] tensors are split per segment; a rank holds its piece of each, in order.
    return torch.cat([_split(seg, dim, parts, idx) for seg in t.split(sizes, dim)], dim)


def expected_shard(name: str, full: torch.Tensor, cfg: TargetConfig, tp: TPGroup):
    """The slice of the TP-1 parameter `full` that rank tp.rank must hold."""
    r, n = tp.rank, tp.size
    key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
    value = cfg.linear_num_value_heads * cfg.linear_value_head_dim
    if name.endswith("linear_attn.conv1d.weight"):
        return _split_segments(full, [key, key, value], 0, n, r)
    if name.endswith("linear_attn.in_proj.weight"):  # [q | k | v | z | b | a] rows
        heads = cfg.linear_num_value_heads
        return _split_segments(full, [key, key, value, value, heads, heads], 0, n, r)
    if name.endswith(("A_log", "dt_bias", "self_attn.q_proj.weight", "embed_tokens.weight",
                      "lm_head.weight")):
        return _split(full, 0, n, r)  # q_proj rows are per head [query | gate]: gates follow
    if name.endswith(("out_proj.weight", "o_proj.weight", "shared_expert.down_proj.weight")):
        return _split(full, 1, n, r)
    if name.endswith(("self_attn.k_proj.weight", "self_attn.v_proj.weight")):
        shards = min(n, cfg.num_key_value_heads)  # tp > kv heads: rank r uses head r // (n/kv)
        return _split(full, 0, shards, r * shards // n)
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H], gate rows first
        return _split_segments(full, [cfg.moe_intermediate_size] * 2, 1, n, r)
    if name.endswith("mlp.experts.down_proj"):  # [E, H, I]
        return _split(full, 2, n, r)
    if name.endswith("shared_expert.gate_up_proj.weight"):
        return _split_segments(full, [cfg.shared_expert_intermediate_size] * 2, 0, n, r)
    return full  # norms, router, shared-expert gate: replicated


@pytest.mark.parametrize("layout", ["target-published", "target"])
@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_holds_only_its_shard(tiny_models, layout, size):
    # Loading needs no process group: collectives only run in forward.
    full = dict(load_target(tiny_models / "target").named_parameters())
    cfg = TargetConfig.from_pretrained(tiny_models / "target")
    for rank in range(size):
        tp = TPGroup(rank=rank, size=size)
        params = dict(load_target(tiny_models / layout, tp=tp).named_parameters())
        assert params.keys() == full.keys()
        for name, param in params.items():
            want = expected_shard(name, full[name], cfg, tp)
            assert param.shape == want.shape, name
            assert torch.equal(param, want), name


def test_rank1_of_tp2_gdn_qkv_rows(tiny_models):
    # The worked example: in_proj_qkv [q 64 | k 64 | v 128] rows; rank 1 holds the second half
    # of each segment, not rows 128…255 of the fused tensor.
    # (in_proj holds [q | k | v | z | b | a]: the qkv rows come first, locally and in full.)
    full = load_target(tiny_models / "target").model.layers[0].linear_attn.in_proj.weight
    shard = load_target(tiny_models / "target-published", tp=TPGroup(rank=1, size=2))
    mine = shard.model.layers[0].linear_attn.in_proj.weight[:128]
    torch.testing.assert_close(mine, torch.cat([full[32:64], full[96:128], full[192:256]]),
                               atol=0, rtol=0)


def test_tp4_kv_heads_are_replicated_in_pairs(tiny_models):
    full = load_target(tiny_models / "target").model.layers[3].self_attn.k_proj.weight  # [32, 64]
    for rank in range(4):
        attn = load_target(tiny_models / "target", tp=TPGroup(rank=rank, size=4))
        k_proj = attn.model.layers[3].self_attn.k_proj.weight
        head = rank // 2  # 2 kv heads over 4 ranks
        assert k_proj.shape == (16, 64)
        assert torch.equal(k_proj, full[16 * head : 16 * (head + 1)])


@pytest.mark.parametrize("size", [2, 4])
def test_dummy_weights_shard_like_a_checkpoint(tiny_models, size):
    """load_format="dummy": each rank holds its slice of the TP-1 dummy model, so TP sizes
    compare on the real architecture without a checkpoint."""
    full = dict(load_target(tiny_models / "target", load_format="dummy").named_parameters())
    cfg = TargetConfig.from_pretrained(tiny_models / "target")
    for rank in range(size):
        tp = TPGroup(rank=rank, size=size)
        model = load_target(tiny_models / "target", tp=tp, load_format="dummy")
        for name, param in model.named_parameters():
            assert torch.equal(param, expected_shard(name, full[name], cfg, tp)), name
