"""One tensor-parallel rank of the target on CPU (gloo), and the forward sequence that every rank
and the single-rank reference run. Lives in its own module so spawned children can import it."""

from __future__ import annotations

import os
import traceback
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from configs.engine import SamplingParams
from configs.kernels import KernelConfig
from target.distributed import SINGLE, TPGroup
from target.loader import load_target
from target.model import Qwen3_5MoeForCausalLM
from workers.cache import allocate_target_caches
from workers.model_runner import ModelRunner, SeqInput

PAGE_SIZE = 4
NUM_PAGES = 48
PROMPT_LENS = (9, 2, 14)
BLOCK = 6  # verify width B
KEPT = (1, 4, 6)  # tokens committed after the first verify: anchor only … the whole block
AUX_LAYERS = (2, 7)
COLLECTIVE_TIMEOUT_S = 60


def _tokens(gen: torch.Generator, n: int) -> list[int]:
    return torch.randint(0, 300, (n,), generator=gen).tolist()


class Forwards:
    """n sequences on their own caches: forward(name, tokens, starts, verify) runs one batch
    (sequence i's `tokens` from position starts[i]) and keeps its logits [T, V] and aux
    features [T, n_aux·H] in `out` under that name. Page ids interleave (sequence i owns
    pages i, i+n, i+2n, …) and state slots are not the sequence indices, so paging and slot
    mix-ups cannot hide."""

    def __init__(self, model: Qwen3_5MoeForCausalLM, slots: list[int]):
        n = len(slots)
        self.model, self.slots = model, slots
        self.caches = allocate_target_caches(model, NUM_PAGES, PAGE_SIZE, n, "cpu")
        self.runner = ModelRunner(model, self.caches, AUX_LAYERS, "cpu")
        self.tables = [[i + n * j for j in range(NUM_PAGES // n)] for i in range(n)]
        self.out: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, tokens: list[list[int]], starts: list[int], verify: bool):
        params = SamplingParams()
        batch = self.runner._batch([SeqInput(i, t, starts[i], self.tables[i], self.slots[i],
                                             params) for i, t in enumerate(tokens)],
                                   is_verify=verify)
        hidden, aux = self.model(batch, self.caches)
        self.out[f"{name}.logits"] = self.model.compute_logits(hidden)
        self.out[f"{name}.aux"] = aux.clone()
        return batch

    def commit(self, batch, kept: tuple[int, ...]) -> None:
        self.model.commit_verify(batch, self.caches, list(kept))


@torch.inference_mode()
def run_scenario(model: Qwen3_5MoeForCausalLM) -> dict[str, torch.Tensor]:
    """Batched prefill of 3 prompts → verify B tokens each → commit KEPT → verify again.
    Returns each forward's logits [T, V] and aux features [T, n_aux·H]."""
    forward = Forwards(model, [2, 0, 1])
    gen = torch.Generator().manual_seed(7)
    prompts = [_tokens(gen, n) for n in PROMPT_LENS]
    lens = [len(p) for p in prompts]
    forward("prefill", prompts, [0] * len(prompts), verify=False)
    batch = forward("verify1", [_tokens(gen, BLOCK) for _ in prompts], lens, verify=True)
    forward.commit(batch, KEPT)
    forward("verify2", [_tokens(gen, BLOCK) for _ in prompts],
            [m + kept for m, kept in zip(lens, KEPT, strict=True)], verify=True)
    return forward.out


# The Triton kernels of uniform rounds, each on its local heads: the attention and its
# prologue, the GDN prologue and output norm on the slots recurrence (CPU: in Triton's
# interpreter).
TRITON_ROUNDS = dict(attention="triton", attention_prologue="triton", gdn_recurrence="slots",
                     gdn_prologue="triton")
ROUND_PROMPT_LENS = (5, 11)
ROUND_WIDTH = 3
ROUND_KEPT = (1, 3)


@torch.inference_mode()
def run_rounds(model: Qwen3_5MoeForCausalLM) -> dict[str, torch.Tensor]:
    """Prefill of 2 prompts → a uniform verify round of ROUND_WIDTH tokens each → commit
    ROUND_KEPT → a decode step (a one-token round, as the engine runs it: the GDN conv and
    recurrent states written in the round) → a 2-token round reading them: the paths the
    Triton round kernels take, kept small (the interpreter runs a GDN prologue program in
    ~0.1 s). Returns each forward's logits and aux features."""
    forward = Forwards(model, [1, 0])
    gen = torch.Generator().manual_seed(11)
    lens = list(ROUND_PROMPT_LENS)
    forward("prefill", [_tokens(gen, m) for m in lens], [0] * len(lens), verify=False)
    batch = forward("verify", [_tokens(gen, ROUND_WIDTH) for _ in lens], lens, verify=True)
    forward.commit(batch, ROUND_KEPT)
    lens = [m + kept for m, kept in zip(lens, ROUND_KEPT, strict=True)]
    forward("decode", [_tokens(gen, 1) for _ in lens], lens, verify=True)
    forward("verify2", [_tokens(gen, 2) for _ in lens], [m + 1 for m in lens], verify=True)
    return forward.out


SCENARIOS = {"forwards": run_scenario, "rounds": run_rounds}


def reference(model_dir: str | Path, scenario: str = "forwards") -> dict[str, torch.Tensor]:
    return SCENARIOS[scenario](load_target(model_dir, tp=SINGLE))


def run_rank(rank: int, world_size: int, port: int, model_dir: str, out_dir: str,
             scenario: str = "forwards", kernels: dict[str, str] | None = None) -> None:
    """Entry point of one spawned rank; writes its outputs to out_dir/rank{r}.pt. `kernels`:
    KernelConfig fields the model takes before the scenario (the Triton ones need
    TRITON_INTERPRET=1 in the environment the ranks are spawned with)."""
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"  # loopback only, never a routable interface
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
        try:
            tp = TPGroup(rank=rank, size=world_size, group=None)
            model = load_target(model_dir, tp=tp)
            if kernels:
                model.set_kernels(KernelConfig(**kernels), graphs=False)
            torch.save(SCENARIOS[scenario](model), Path(out_dir) / f"rank{rank}.pt")
        finally:
            dist.destroy_process_group()
    except BaseException:
        # The parent reports every rank's traceback: the first rank to exit is often only the
        # peer of the one that failed ("connection closed by peer").
        (Path(out_dir) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
