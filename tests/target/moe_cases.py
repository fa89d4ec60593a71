"""What the Triton routed-expert tests share (test_moe_triton.py, test_moe_sorted.py): the
fp64 per-expert reference, a problem's tensors, the relative error, the same tensors through
non-contiguous views, and one case's error."""

from __future__ import annotations

import torch


def reference(x, gate_up, down, ids, w):
    """The per-expert loop of FusedExperts.reference, in fp64."""
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        tokens, slots = (ids == e).nonzero(as_tuple=True)
        gate, up = (x[tokens].double() @ gate_up[e].double().T).chunk(2, dim=-1)
        y = (torch.nn.functional.silu(gate) * up) @ down[e].double().T
        out.index_add_(0, tokens, y * w[tokens, slots].double()[:, None])
    return out


def problem(tokens, k, experts, hidden, inter, dtype, device="cpu", seed=0, ids=None):
    """x, gate_up, down in `dtype`; ids (distinct experts per token, as top-k gives, unless
    given) and weights summing to 1 per token."""
    g = torch.Generator(device).manual_seed(seed)
    kw = dict(generator=g, device=device)
    gate_up = torch.randn(experts, 2 * inter, hidden, **kw) * hidden**-0.5
    down = torch.randn(experts, hidden, inter, **kw) * inter**-0.5
    x = torch.randn(tokens, hidden, **kw)
    if ids is None:
        ids = torch.stack([torch.randperm(experts, **kw)[:k] for _ in range(tokens)])
    w = torch.rand(tokens, k, **kw)
    w = w / w.sum(-1, keepdim=True)
    return [t.to(dtype) for t in (x, gate_up, down)] + [ids.to(device), w.to(dtype)]


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def strided(x, gate_up, down, ids, w):
    """The same values through non-contiguous views: H-major weights, x with strides (2H, 2),
    [k, T]-major routing."""
    gate_up = gate_up.transpose(1, 2).contiguous().transpose(1, 2)
    down = down.transpose(1, 2).contiguous().transpose(1, 2)
    x = torch.stack([x, x], dim=-1)[..., 0]
    return x, gate_up, down, ids.T.contiguous().T, w.T.contiguous().T


def case_error(fn, case: tuple, dtype: torch.dtype, device: str, blocks: dict) -> float:
    """fn's (an expert path's) relative error against the reference on one case: (tokens, k,
    experts, hidden, inter, ids or None for random distinct, extra). extra "blocks" passes
    `blocks` (its launch-shape overrides); "strided" runs on non-contiguous views."""
    tokens, k, experts, hidden, inter, ids, extra = case
    ids = None if ids is None else torch.tensor(ids, device=device)
    x, gate_up, down, ids, w = problem(tokens, k, experts, hidden, inter, dtype, device,
                                       ids=ids)
    want = reference(x, gate_up, down, ids, w)
    if extra == "strided":
        x, gate_up, down, ids, w = strided(x, gate_up, down, ids, w)
    got = fn(x, gate_up, down, ids, w, **(blocks if extra == "blocks" else {}))
    assert got.dtype == x.dtype and got.shape == x.shape
    return rel_err(got, want)


def check_graph_replay(fn, x, gate_up, down, ids, w) -> None:
    """fn captured in a CUDA graph with one routing, replayed with another copied into the
    same buffers: the replay's output equals an eager call's, bit for bit (real sizes)."""
    x2, _, _, ids2, w2 = problem(x.shape[0], ids.shape[1], gate_up.shape[0], x.shape[1],
                                 down.shape[2], x.dtype, "cuda", seed=1)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(x, gate_up, down, ids, w)
    for dst, src in ((x, x2), (ids, ids2), (w, w2)):
        dst.copy_(src)
    graph.replay()
    torch.testing.assert_close(out, fn(x2, gate_up, down, ids2, w2), rtol=0, atol=0)

