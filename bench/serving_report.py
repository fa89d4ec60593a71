"""The outputs of bench/serving.py: a markdown table, a CSV row per level, a PNG."""

from __future__ import annotations

import csv
from pathlib import Path

COLUMNS = [  # (header, LevelSummary field or "spec.<field>", format)
    ("conc", "concurrency", "{}"), ("req/s", "request_throughput", "{:.2f}"),
    ("out tok/s", "output_throughput", "{:.1f}"), ("total tok/s", "total_throughput", "{:.1f}"),
    ("TTFT p50/p90/p99 ms", ("ttft_ms_p50", "ttft_ms_p90", "ttft_ms_p99"), "{:.1f}"),
    ("ITL p50/p90/p99 ms", ("itl_ms_p50", "itl_ms_p90", "itl_ms_p99"), "{:.1f}"),
    ("step gap p50 ms", "chunk_gap_ms_p50", "{:.2f}"),
    ("e2e p50/p90 ms", ("e2e_ms_p50", "e2e_ms_p90"), "{:.0f}"),
    ("decode tok/s/user", "decode_tok_s_per_user_p50", "{:.1f}"),
    ("accept len", "spec.acceptance_length", "{:.2f}"),
    ("draft/verify ms", ("spec.draft_ms_per_round", "spec.verify_ms_per_round"), "{:.1f}"),
    ("engine round ms", "spec.engine_round_ms", "{:.2f}"),
    ("prefill steps (ms)", ("spec.prefill_steps", "spec.prefill_step_ms"), "{:.0f}"),
    ("errors", "errors", "{}"),
]


def _get(summary: dict, key: str) -> object:
    return summary["spec"][key[5:]] if key.startswith("spec.") else summary[key]


def table(summaries: list[dict]) -> str:
    def cell(s: dict, keys, fmt: str) -> str:
        keys = (keys,) if isinstance(keys, str) else keys
        return " / ".join("-" if _get(s, k) is None else fmt.format(_get(s, k)) for k in keys)

    lines = ["| " + " | ".join(h for h, _, _ in COLUMNS) + " |", "|---" * len(COLUMNS) + "|"]
    lines += ["| " + " | ".join(cell(s, k, f) for _, k, f in COLUMNS) + " |" for s in summaries]
    return "\n".join(lines)


def write_csv(path: Path, summaries: list[dict]) -> None:
    # columns in the summaries' own (dataclass field) order
    top = [k for k in summaries[0] if k != "spec"] if summaries else []
    spec = list(summaries[0]["spec"]) if summaries else []
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(top + spec)
        for s in summaries:  # rates as one space-separated cell
            w.writerow([s[k] for k in top] + [
                " ".join(f"{r:.4f}" for r in v) if isinstance(v, list | tuple) else v
                for v in (s["spec"][k] for k in spec)])


def plot(path: Path, summaries: list[dict], title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    c = [s["concurrency"] for s in summaries]
    fig, (thr, itl) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    thr.plot(c, [s["output_throughput"] for s in summaries], "o-", label="output")
    thr.plot(c, [s["total_throughput"] for s in summaries], "s--", label="prompt + output")
    thr.set(xlabel="concurrency", ylabel="tokens / s", title="throughput")
    thr.legend()
    itl.plot(c, [s["itl_ms_p50"] or float("nan") for s in summaries], "o-")
    itl.set(xlabel="concurrency", ylabel="ms", title="inter-token latency p50")
    for ax in (thr, itl):
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    fig.suptitle(title)
    fig.savefig(path, dpi=120)
    plt.close(fig)
