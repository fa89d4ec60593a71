"""Train the tiny "full"-revision DFlash draft against the committed tiny target.

    python -m tools.train_tiny_draft --target tests/assets/tiny/target --out tests/assets/tiny/draft

Reference implementations only: transformers' `Qwen3_5MoeForCausalLM` (fp32) makes the data
(cached greedy, every token checked by a cache-free forward) and verifies without a cache;
`dflash.model.DFlashDraftModel` is the draft. DFlash's objective: for an
anchor position p of a target-greedy sequence x, the draft sees the target's aux features of
x[:p] and the block [x_p, mask × (B-1)] at positions p … p+B-1 and predicts x[p+1 : p+B] through
the target's lm_head. Acceptance is measured with cache-free greedy speculative rounds.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from tools import tiny_models


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0  # training order; data uses seed + 1, held-out prompts seed + 2
    prompt_len: int = 24  # long enough for a ChatML prompt with a few words of content
    seq_len: int = 96  # prompt + 72 greedy tokens
    prompts_per_kind: int = 1000  # corpus snippets, random token prefixes, ChatML prompts
    steps: int = 2000
    batch_size: int = 16  # sequences per step
    anchors_per_seq: int = 8  # blocks per sequence per step (DFlash's multi-anchor batches)
    block_sizes: tuple[int, ...] = (16, 16, 8)  # sampled per step
    lr: float = 1e-2
    loss_decay: float = 7.0  # DFlash's position weight exp(-(k-1)/gamma)
    eval_prompts_per_kind: int = 8
    eval_new_tokens: int = 64


# --------------------------------------------------------------------------------------------
# Target side: features and greedy data
# --------------------------------------------------------------------------------------------


class TargetTap:
    """Runs the target and returns logits plus the aux features the draft consumes.

    Features are taken from forward hooks on the decoder layers: the residual stream after layer
    k, before the final norm. transformers' `hidden_states[k + 1]` equals that for every k except
    the last layer, whose entry is replaced by the post-norm `last_hidden_state`
    (`check_feature_offsets` pins this).
    """

    def __init__(self, target, layer_ids: list[int], post_norm_last: bool = False):
        self.target = target
        self.layer_ids = list(layer_ids)
        # True reproduces the hidden_states[-1] bug (post-norm last layer); for ablation only.
        self.post_norm_last = post_norm_last
        self._outs: dict[int, torch.Tensor] = {}
        for k, layer in enumerate(target.model.layers):
            layer.register_forward_hook(self._hook(k))

    def _hook(self, k: int):
        def hook(_module, _args, output):
            self._outs[k] = output[0] if isinstance(output, tuple) else output

        return hook

    @torch.no_grad()
    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self._outs.clear()
        logits = self.target(ids, use_cache=False).logits  # [N, T, V]
        last = len(self.target.model.layers) - 1
        if self.post_norm_last:
            self._outs[last] = self.target.model.norm(self._outs[last])
        feats = torch.cat([self._outs[k] for k in self.layer_ids], dim=-1)  # [N, T, len(ids)*H]
        return logits, feats


@torch.no_grad()
def check_feature_offsets(tap: TargetTap, ids: torch.Tensor) -> dict[str, float]:
    out = tap.target(ids, use_cache=False, output_hidden_states=True)
    hs, n = out.hidden_states, len(tap.target.model.layers)
    tap(ids)
    diffs = {
        f"hidden_states[{k + 1}] vs layer {k}": (hs[k + 1] - tap._outs[k]).abs().max().item()
        for k in range(n)
    }
    normed_last = tap.target.model.norm(tap._outs[n - 1])
    diffs[f"hidden_states[{n}] vs norm(layer {n - 1})"] = (hs[n] - normed_last).abs().max().item()
    return diffs


@torch.no_grad()
def greedy(target, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    # Cache-free: every step recomputes the whole sequence. Exact, but O(new_tokens) forwards.
    ids = prompts
    for _ in range(new_tokens):
        logits = target(ids, use_cache=False, logits_to_keep=1).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids


@torch.no_grad()
def greedy_checked(tap: TargetTap, prompts: torch.Tensor, new_tokens: int):
    """Cache-free greedy sequences and their aux features, fast: decode with transformers' cache
    (fine for plain greedy), then check every token against one cache-free teacher-forced
    forward, which also yields the features; rows that disagree anywhere (near-ties) are redone
    with `greedy`. Returns (ids [N, P+new], feats [N, P+new, F], rows redone)."""
    target = tap.target
    out = target(prompts, use_cache=True)
    cache, ids = out.past_key_values, torch.cat([prompts, out.logits[:, -1:].argmax(-1)], dim=1)
    for _ in range(new_tokens - 1):
        out = target(ids[:, -1:], past_key_values=cache, use_cache=True)
        cache, ids = out.past_key_values, torch.cat([ids, out.logits[:, -1:].argmax(-1)], dim=1)
    p = prompts.shape[1]
    logits, feats = tap(ids)
    bad = (logits[:, p - 1 : -1].argmax(-1) != ids[:, p:]).any(dim=1).nonzero().flatten()
    if len(bad):
        ids[bad] = greedy(target, prompts[bad], new_tokens)
        feats[bad] = tap(ids[bad])[1]
    return ids, feats, len(bad)


def greedy_dataset(tap: TargetTap, prompts: torch.Tensor, new_tokens: int, chunk: int = 256):
    parts = [greedy_checked(tap, c, new_tokens) for c in prompts.split(chunk)]
    ids, feats = torch.cat([x for x, _, _ in parts]), torch.cat([f for _, f, _ in parts])
    return ids, feats, sum(n for _, _, n in parts)


def make_prompts(n_per_kind: int, length: int, seed: int) -> torch.Tensor:
    """Corpus snippets, random BPE-token prefixes, and ChatML prompts; all `length` tokens."""
    tok = tiny_models.build_tokenizer()
    corpus = tok.encode(tiny_models.CORPUS).ids
    sp = tiny_models.special_token_ids()
    head = [sp["<|im_start|>"]] + tok.encode("user\n").ids
    tail = [sp["<|im_end|>"]] + tok.encode("\n").ids + [sp["<|im_start|>"]]
    tail += tok.encode("assistant\n").ids
    gen = torch.Generator().manual_seed(seed)
    rows = []

    def snippet(k: int) -> list[int]:
        start = int(torch.randint(0, len(corpus) - k, (1,), generator=gen))
        return corpus[start : start + k]

    for _ in range(n_per_kind):
        rows.append(snippet(length))
        rows.append(torch.randint(0, tiny_models.BPE_VOCAB_SIZE, (length,), generator=gen).tolist())
        rows.append(head + snippet(length - len(head) - len(tail)) + tail)
    return torch.tensor(rows)


# --------------------------------------------------------------------------------------------
# Draft side
# --------------------------------------------------------------------------------------------


def draft_logits(draft, target, ctx: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """One block per row: ctx [N, p, F] are the features of x[:p]; block_ids [N, B]."""
    n, p = ctx.shape[:2]
    pos = torch.arange(p + block_ids.shape[1]).expand(n, -1)
    noise = target.model.embed_tokens(block_ids)
    hidden = draft(position_ids=pos, noise_embedding=noise, target_hidden=ctx)  # [N, B, H]
    return target.lm_head(hidden[:, 1:])  # [N, B-1, V]


def multi_block_batch(seqs, feats, anchors, block_size, mask_id, embed):
    """Several anchors per sequence in one draft forward, as DFlash trains.

    Queries are the concatenated blocks; keys are the whole context then the blocks. Block j
    sees context positions < anchor_j and (non-causally) its own block only.
    """
    n, t = seqs.shape
    a = anchors.shape[1]
    offs = torch.arange(block_size)
    block_pos = (anchors[:, :, None] + offs).reshape(n, a * block_size)  # [N, A*B]
    block_ids = torch.full((n, a, block_size), mask_id)
    block_ids[:, :, 0] = seqs.gather(1, anchors)
    labels = seqs.gather(1, (anchors[:, :, None] + offs[1:]).reshape(n, -1)).view(n, a, -1)
    pos = torch.cat([torch.arange(t).expand(n, -1), block_pos], dim=1)  # [N, T + A*B]
    ctx_vis = torch.arange(t)[None, None, :] < anchors[:, :, None]  # [N, A, T]
    ctx_vis = ctx_vis.repeat_interleave(block_size, dim=1)  # [N, A*B, T]
    blk = torch.arange(a).repeat_interleave(block_size)
    own = (blk[:, None] == blk[None, :]).expand(n, -1, -1)  # [N, A*B, A*B]
    mask = torch.cat([ctx_vis, own], dim=2)[:, None]  # [N, 1, A*B, T + A*B]
    return dict(
        position_ids=pos,
        attention_mask=mask,
        noise_embedding=embed(block_ids.view(n, -1)),
        target_hidden=feats,
    ), labels


def train(draft, target, seqs, feats, cfg: TrainConfig, log=print) -> None:
    mask_id = draft.mask_token_id
    gen = torch.Generator().manual_seed(cfg.seed)
    opt = torch.optim.Adam(draft.parameters(), lr=cfg.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 100) * 0.5 * (1 + math.cos(math.pi * s / cfg.steps))
    )
    draft.train()
    t0, running = time.time(), None
    for step in range(cfg.steps):
        b = cfg.block_sizes[int(torch.randint(len(cfg.block_sizes), (1,), generator=gen))]
        idx = torch.randperm(seqs.shape[0], generator=gen)[: cfg.batch_size]
        hi = cfg.seq_len - b + 1  # anchors in [prompt_len, seq_len - B]: labels are greedy tokens
        anchors = (
            torch.stack(
                [
                    torch.randperm(hi - cfg.prompt_len, generator=gen)[: cfg.anchors_per_seq]
                    for _ in idx
                ]
            )
            + cfg.prompt_len
        )
        inputs, labels = multi_block_batch(
            seqs[idx], feats[idx], anchors, b, mask_id, target.model.embed_tokens
        )
        hidden = draft(**inputs).view(len(idx), cfg.anchors_per_seq, b, -1)
        logits = target.lm_head(hidden[:, :, 1:])  # [N, A, B-1, V]
        ce = F.cross_entropy(logits.flatten(0, 2), labels.flatten(), reduction="none")
        w = torch.exp(-torch.arange(b - 1) / cfg.loss_decay)
        loss = (ce.view(-1, b - 1) * w).sum() / (w.sum() * ce.numel() / (b - 1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        opt.step()
        sched.step()
        running = loss.item() if running is None else 0.98 * running + 0.02 * loss.item()
        if step % 250 == 0 or step == cfg.steps - 1:
            log(f"step {step:5d}  loss {running:.3f}  {time.time() - t0:.0f}s")
    draft.eval()


# --------------------------------------------------------------------------------------------
# Acceptance: cache-free greedy speculative rounds
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def speculative_greedy(tap: TargetTap, draft, prompt: torch.Tensor, new_tokens: int, block_size):
    """Returns (tokens [1, P + new], committed tokens per round). Recomputes the target on the
    whole sequence every round, so nothing needs rolling back."""
    target, mask_id = tap.target, draft.mask_token_id
    logits, feats = tap(prompt)
    ids = torch.cat([prompt, logits[:, -1:].argmax(-1)], dim=1)  # prefill commits one token
    end = prompt.shape[1] + new_tokens
    per_round = []
    while ids.shape[1] < end:
        p = ids.shape[1] - 1  # anchor = last committed token; features exist for x[:p]
        block = torch.full((1, block_size), mask_id)
        block[0, 0] = ids[0, p]
        proposal = draft_logits(draft, target, feats[:, :p], block).argmax(-1)  # [1, B-1]
        logits, feats = tap(torch.cat([ids, proposal], dim=1))
        verify = logits[:, p:].argmax(-1)  # [1, B]: target's choice after x_p, d_1, ...
        accepted = int((proposal == verify[:, :-1]).int().cumprod(-1).sum())
        ids = torch.cat([ids, proposal[:, :accepted], verify[:, accepted : accepted + 1]], dim=1)
        per_round.append(accepted + 1)
    return ids[:, :end], per_round


def measure_acceptance(tap, draft, prompts, new_tokens, block_size, reference):
    rounds, mismatches = [], 0
    for i in range(prompts.shape[0]):
        out, per_round = speculative_greedy(tap, draft, prompts[i : i + 1], new_tokens, block_size)
        rounds += per_round
        mismatches += int(not torch.equal(out[0], reference[i]))
    return statistics.mean(rounds), len(rounds), mismatches


# --------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--target", default="tests/assets/tiny/target")
    parser.add_argument("--out", default="tests/assets/tiny/draft")
    parser.add_argument("--steps", type=int, default=TrainConfig.steps)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    cfg = TrainConfig(steps=args.steps)

    from transformers import Qwen3_5MoeForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(cfg.seed)
    t0 = time.time()
    target = Qwen3_5MoeForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    target.requires_grad_(False)
    draft = tiny_models.build_tiny_draft("full")  # seed tiny_models.DRAFT_SEED
    tap = TargetTap(target, draft.target_layer_ids)

    for name, diff in check_feature_offsets(tap, make_prompts(1, 16, seed=99)).items():
        print(f"{name}: max |diff| {diff:.2e}")

    new_tokens = cfg.seq_len - cfg.prompt_len
    prompts = make_prompts(cfg.prompts_per_kind, cfg.prompt_len, seed=cfg.seed + 1)
    seqs, feats, redone = greedy_dataset(tap, prompts, new_tokens)  # feats [N, T, 3H]
    print(
        f"data: {tuple(seqs.shape)} greedy sequences ({redone} redone cache-free), "
        f"{time.time() - t0:.0f}s"
    )

    train(draft, target, seqs, feats, cfg)
    tiny_models.save_draft(draft, args.out, "full")
    print(f"saved {args.out} after {time.time() - t0:.0f}s")

    held_out = make_prompts(cfg.eval_prompts_per_kind, cfg.prompt_len, seed=cfg.seed + 2)
    reference = greedy_dataset(tap, held_out, cfg.eval_new_tokens)[0]
    kinds = ("corpus", "random", "chat")
    results = {}
    for name, b, post_norm in (
        ("B=16", 16, False),
        ("B=8", 8, False),
        ("B=16, post-norm last-layer features", 16, True),
    ):
        tap.post_norm_last = post_norm
        per_kind = {}
        for k, kind in enumerate(kinds):
            mean, n_rounds, mism = measure_acceptance(
                tap, draft, held_out[k::3], cfg.eval_new_tokens, b, reference[k::3]
            )
            per_kind[kind] = (mean, n_rounds, mism)
        rounds = sum(n for _, n, _ in per_kind.values())
        total = sum(m * n for m, n, _ in per_kind.values()) / rounds
        results[name] = round(total, 2)
        detail = ", ".join(f"{kind} {m:.2f}" for kind, (m, _, _) in per_kind.items())
        mism = sum(x for _, _, x in per_kind.values())
        print(
            f"{name}: mean committed/round {total:.2f} ({detail}); "
            f"{mism} outputs differ from plain greedy"
        )
    tap.post_norm_last = False
    print(json.dumps({"acceptance": results, "config": asdict(cfg)}))
    print(f"total {time.time() - t0:.0f}s")


if __name__ == "__main__":
    main()
