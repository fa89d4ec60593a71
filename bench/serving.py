"""Load generator for any OpenAI-compatible server: latency and throughput per concurrency level,
plus the speculative-decoding counters of our `/metrics` over the same window.

    python -m bench.serving --base-url http://127.0.0.1:8000 --concurrency 1 2 4 8 \
        --num-prompts 64 --prompt-len 256 --output-len 128 --out-dir results/
    python -m bench.serving --dataset prompts.jsonl --chat ...  # {"prompt": str, "max_tokens"?}

Every level sends the same prompts, at most c in flight, streamed with `ignore_eos` so outputs
have the requested length. Token counts come from the `return_token_ids` extension: one chunk
may carry several tokens (a speculative round commits up to B at once), and the gap before it
is split evenly over them, as the server's own ITL histogram does; tokens that arrive with the
first chunk are covered by TTFT and give no ITL sample. The server's counters are scraped
before and after each level once the engine is idle, so their deltas belong to that level.
The first request (sized like the rest, 16 output tokens) is sent again after the levels: its
TTFT on a fresh server against the same request's once warm says what start-up left for the
first user to pay. Writes serving.csv (a row per level), serving.json (everything, with the
command line and every request) and serving.png (throughput and ITL p50 vs concurrency) into
--out-dir.

    python -m bench.serving --workload multi-turn --history-len 16384 --turns 8 \
        --turn-len 512 --output-len 256
    python -m bench.serving --workload shared-prefix --num-prompts 32 --shared-len 32768 \
        --question-len 256 --concurrency 8

measure the prefix cache instead (token-id prompts, against a server with and without
`--no-enable-prefix-caching`): a conversation's turns, each resending everything before it
(TTFT, prompt and cached tokens per turn), or many requests sharing one long system prompt
(the total time); written to multi-turn.json / shared-prefix.json in --out-dir."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import openai
from prometheus_client.parser import text_string_to_metric_families

from bench.http_client import httpx
from bench.serving_report import plot, table, write_csv

# Common English words: one or a few tokens each in most vocabularies.
WORDS = """the of and to in is was for on that with as by at from they this which be or not are
have one all there more when would time year people way day man thing woman life child world
school state family group country problem hand part place case week company system program
question work number night point home water room mother area money story fact month""".split()
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]  # (name, sorted labels) → value


@dataclass(frozen=True)
class Prompt:
    text: str
    max_tokens: int
    ids: list[int] | None = None  # a token-id prompt (completions), sent instead of the text


@dataclass
class RequestResult:
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0  # chunks that carried tokens
    ttft_s: float | None = None
    e2e_s: float | None = None  # to the end of the stream
    last_token_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # one sample per token after the first chunk
    # between successive chunks that carried tokens: one engine step (a round) per sample
    chunk_gaps_s: list[float] = field(default_factory=list)
    cached_tokens: int = 0  # usage.prompt_tokens_details.cached_tokens (the prefix cache's)
    token_ids: list[int] = field(default_factory=list)  # the output (return_token_ids)
    error: str | None = None

    def add_chunk(self, since_start: float, num_tokens: int) -> None:
        """Tokens that arrived `since_start` seconds after the request was sent."""
        if num_tokens <= 0:
            return
        if self.ttft_s is None:
            self.ttft_s = since_start
        else:
            self.chunk_gaps_s.append(since_start - self.last_token_s)
            gap = (since_start - self.last_token_s) / num_tokens
            self.itl_s.extend([gap] * num_tokens)
        self.last_token_s = since_start
        self.output_tokens += num_tokens
        self.chunks += 1


@dataclass(frozen=True)
class SpecStats:
    """Deltas of the server's speculative-decoding series over one level (None: not exported)."""

    spec_rounds: float | None  # per sequence: a batched round of 8 sequences counts 8
    committed_tokens: float | None
    acceptance_length: float | None  # committed / rounds: tokens per sequence per round
    draft_ms_per_round: float | None  # per batched round, from the histograms' _sum / _count
    verify_ms_per_round: float | None
    position_acceptance_rate: tuple[float, ...]  # cumulative since server start: after-values
    # this level's own rates: Δ accepted at position i / Δ drafts
    level_position_acceptance_rate: tuple[float, ...]
    # the driver's wall time per step (dflash_engine_step_seconds): rounds, and the prefill
    # steps between them (their count and mean)
    engine_round_ms: float | None = None
    prefill_steps: float | None = None
    prefill_step_ms: float | None = None


@dataclass(frozen=True)
class LevelSummary:
    concurrency: int
    requests: int
    errors: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_throughput: float  # (prompt + output) tokens / s
    mean_prompt_tokens: float
    output_tokens: int
    ttft_ms_p50: float | None
    ttft_ms_p90: float | None
    ttft_ms_p99: float | None
    itl_ms_p50: float | None
    itl_ms_p90: float | None
    itl_ms_p99: float | None
    chunk_gap_ms_p50: float | None  # per engine step that streamed tokens (a round)
    e2e_ms_p50: float | None
    e2e_ms_p90: float | None
    # each request's decode rate, its tokens after the first chunk's over the time from that
    # chunk to its last: the median over the requests (tokens/s per user)
    decode_tok_s_per_user_p50: float | None
    spec: SpecStats


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__.split("\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="without /v1")
    p.add_argument("--model", help="default: the first model the server lists")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--num-prompts", type=int, default=64, help="requests per level")
    p.add_argument("--prompt-len", type=int, default=256, help="synthetic prompts, in tokens")
    p.add_argument("--output-len", type=int, default=128, help="max_tokens (ignore_eos is set)")
    p.add_argument("--dataset", type=Path, help='JSONL: {"prompt": str, "max_tokens"?: int}')
    p.add_argument("--chat", action="store_true", help="/v1/chat/completions, one user message")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--logprobs", type=int, default=None,
                   help="ask for each token's log-probability and this many alternatives")
    p.add_argument("--seed", type=int, default=0, help="for the synthetic prompts")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    p.add_argument("--out-dir", type=Path, default=Path("."))
    p.add_argument("--record-first", action="store_true",
                   help="send the prompts once, unmeasured, before the levels: a server "
                        "started with --acceptance-replay records the target's outputs there "
                        "and replays them in the levels (a DFlash speed at a chosen acceptance "
                        "on any weights)")
    w = p.add_argument_group("prefix-cache workloads (token-id prompts on /v1/completions; "
                             "run each against the server with and without prefix caching)")
    w.add_argument("--workload", choices=["levels", "multi-turn", "shared-prefix"],
                   default="levels", help="levels: the concurrency levels above (default)")
    w.add_argument("--history-len", type=int, default=16384, help="multi-turn: the history")
    w.add_argument("--turns", type=int, default=8, help="multi-turn: turns")
    w.add_argument("--turn-len", type=int, default=512, help="multi-turn: new tokens a turn")
    w.add_argument("--shared-len", type=int, default=32768, help="shared-prefix: its length")
    w.add_argument("--question-len", type=int, default=256,
                   help="shared-prefix: each request's own tokens")
    w.add_argument("--token-id-min", type=int, default=10)
    w.add_argument("--token-id-max", type=int, default=300,
                   help="token ids are drawn from [min, max): within any vocabulary here")
    args = p.parse_args(argv)
    if not 0 <= args.token_id_min < args.token_id_max:
        p.error("--token-id-min must be >= 0 and below --token-id-max")
    for name in ("num_prompts", "prompt_len", "output_len", "history_len", "turns", "turn_len",
                 "shared_len", "question_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if min(args.concurrency) < 1:
        p.error("--concurrency levels must be at least 1")
    args.base_url = args.base_url.rstrip("/").removesuffix("/v1")
    return args


def load_dataset(path: Path, n: int, default_max_tokens: int) -> list[Prompt]:
    rows = []
    for i, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{i}: not JSON: {e}") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise ValueError(f"{path}:{i}: expected an object with a string 'prompt'")
        rows.append(Prompt(obj["prompt"], int(obj.get("max_tokens", default_max_tokens))))
    if not rows:
        raise ValueError(f"{path} holds no prompts")
    return [rows[i % len(rows)] for i in range(n)]  # cycled when the file is shorter


def synthetic(n: int, num_words: int, max_tokens: int, seed: int) -> list[Prompt]:
    rng = random.Random(seed)
    return [Prompt(" ".join(rng.choices(WORDS, k=max(1, num_words))), max_tokens)
            for _ in range(n)]


async def send(client: openai.AsyncOpenAI, model: str, prompt: Prompt, chat: bool,
               temperature: float, logprobs: int | None = None) -> RequestResult:
    """One streamed request; `logprobs`: that many alternatives per token (chat: logprobs
    with top_logprobs)."""
    res = RequestResult()
    kw = dict(model=model, max_tokens=prompt.max_tokens, temperature=temperature, stream=True,
              stream_options={"include_usage": True},
              extra_body={"ignore_eos": True, "return_token_ids": True})
    if logprobs is not None:
        kw.update({"logprobs": True, "top_logprobs": logprobs} if chat
                  else {"logprobs": logprobs})
    start = time.perf_counter()
    try:
        if chat:
            stream = await client.chat.completions.create(
                messages=[{"role": "user", "content": prompt.text}], **kw)
        elif prompt.ids is None:
            stream = await client.completions.create(prompt=prompt.text, **kw)
        else:  # token ids in extra_body, which the SDK sends as it is: its request transform
            # walks a `prompt` list id by id (~0.2 s for 17,664 ids on a 2-core box), time the
            # TTFT would count
            kw["extra_body"] = {**kw["extra_body"], "prompt": prompt.ids}
            stream = await client.completions.create(prompt="", **kw)
        usage = None
        async for chunk in stream:
            now = time.perf_counter() - start
            usage = chunk.usage or usage
            for choice in chunk.choices:
                ids = (choice.model_extra or {}).get("token_ids")
                if ids is None:  # a server without the extension: a content chunk is 1 token
                    text = choice.delta.content if chat else choice.text
                    ids = [0] if text else []
                else:
                    res.token_ids += ids
                res.add_chunk(now, len(ids))
        if usage is not None:
            res.prompt_tokens = usage.prompt_tokens
            res.output_tokens = usage.completion_tokens
            details = getattr(usage, "prompt_tokens_details", None)
            res.cached_tokens = (details.cached_tokens or 0) if details is not None else 0
        res.e2e_s = time.perf_counter() - start
    except Exception as e:  # counted per level; the run goes on
        res.error = f"{type(e).__name__}: {e}"
    return res


async def run_level(client: openai.AsyncOpenAI, args: argparse.Namespace, model: str,
                    prompts: list[Prompt], c: int) -> tuple[list[RequestResult], float]:
    gate = asyncio.Semaphore(c)

    async def gated(p: Prompt) -> RequestResult:
        async with gate:
            return await send(client, model, p, args.chat, args.temperature, args.logprobs)

    start = time.perf_counter()
    results = await asyncio.gather(*(gated(p) for p in prompts))
    return results, time.perf_counter() - start


async def scrape(http: httpx.AsyncClient, base: str, idle_timeout: float = 10.0) -> Samples:
    """The server's metrics once no request runs or waits ({} if it has no /metrics)."""
    deadline = time.monotonic() + idle_timeout
    while True:
        try:
            r = await http.get(f"{base}/metrics")
            r.raise_for_status()
        except httpx.HTTPError as e:
            print(f"warning: no metrics from {base}/metrics: {e}", file=sys.stderr)
            return {}
        m = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))):
             s.value for fam in text_string_to_metric_families(r.text) for s in fam.samples}
        busy = m.get(("dflash_num_requests_running", ()), 0) + m.get(
            ("dflash_num_requests_waiting", ()), 0)
        if not busy or time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.05)


def spec_stats(before: Samples, after: Samples) -> SpecStats:
    def delta(name: str, labels: tuple = ()) -> float | None:
        if (name, labels) not in after:
            return None
        return after[(name, labels)] - before.get((name, labels), 0.0)

    def mean_ms(hist: str, labels: tuple = ()) -> float | None:
        s, n = delta(f"{hist}_sum", labels), delta(f"{hist}_count", labels)
        return 1e3 * s / n if s is not None and n else None

    def accepted_at(m: Samples) -> dict[int, float]:
        return {int(dict(labels)["position"]): v for (name, labels), v in m.items()
                if name == "dflash_spec_decode_num_accepted_tokens_per_pos_total"}

    rounds = delta("dflash_spec_decode_num_drafts_total")
    accepted = delta("dflash_spec_decode_num_accepted_tokens_total")
    committed = None if rounds is None or accepted is None else accepted + rounds
    a0, a1 = accepted_at(before), accepted_at(after)
    n1 = after.get(("dflash_spec_decode_num_drafts_total", ()), 0.0)
    cumulative = tuple(a1[i] / n1 for i in sorted(a1)) if n1 else ()
    level = [(a1[i] - a0.get(i, 0.0)) / rounds for i in sorted(a1)] if rounds else []
    return SpecStats(rounds, committed, committed / rounds if rounds and committed else None,
                     mean_ms("dflash_draft_time_per_round_seconds"),
                     mean_ms("dflash_verify_time_per_round_seconds"),
                     cumulative, tuple(level),
                     mean_ms("dflash_engine_step_seconds", (("kind", "round"),)),
                     delta("dflash_engine_step_seconds_count", (("kind", "prefill"),)),
                     mean_ms("dflash_engine_step_seconds", (("kind", "prefill"),)))


def summarize(c: int, results: list[RequestResult], duration: float,
              spec: SpecStats) -> LevelSummary:
    ok = [r for r in results if r.error is None]

    def pct(values: list[float], q: float) -> float | None:
        return float(np.percentile(values, q)) * 1e3 if values else None

    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [x for r in ok for x in r.itl_s]
    gaps = [x for r in ok for x in r.chunk_gaps_s]
    e2e = [r.e2e_s for r in ok]
    prompt_toks, out_toks = sum(r.prompt_tokens for r in ok), sum(r.output_tokens for r in ok)
    rates = [len(r.itl_s) / (r.last_token_s - r.ttft_s) for r in ok
             if r.ttft_s is not None and r.last_token_s > r.ttft_s]
    return LevelSummary(
        c, len(results), len(results) - len(ok), duration, len(ok) / duration,
        out_toks / duration, (prompt_toks + out_toks) / duration,
        prompt_toks / len(ok) if ok else 0.0, out_toks,
        pct(ttft, 50), pct(ttft, 90), pct(ttft, 99), pct(itl, 50), pct(itl, 90), pct(itl, 99),
        pct(gaps, 50), pct(e2e, 50), pct(e2e, 90),
        float(np.median(rates)) if rates else None, spec)


def token_ids(rng: random.Random, n: int, args: argparse.Namespace) -> list[int]:
    return [rng.randrange(args.token_id_min, args.token_id_max) for _ in range(n)]


async def multi_turn(client: openai.AsyncOpenAI, model: str, args: argparse.Namespace) -> dict:
    """One conversation of token-id prompts: a --history-len history, then --turns turns, each
    adding --turn-len new tokens to everything before (the earlier answers included) and
    generating --output-len tokens. Per turn: TTFT, prompt and cached tokens."""
    rng = random.Random(args.seed)
    history, turns = token_ids(rng, args.history_len, args), []
    for turn in range(1, args.turns + 1):
        history += token_ids(rng, args.turn_len, args)
        r = await send(client, model, Prompt("", args.output_len, list(history)), False,
                       args.temperature)
        if r.error:
            raise SystemExit(f"turn {turn} failed: {r.error}")
        turns.append({"turn": turn, "prompt_tokens": r.prompt_tokens,
                      "cached_tokens": r.cached_tokens, "ttft_ms": 1e3 * r.ttft_s,
                      "e2e_ms": 1e3 * r.e2e_s})
        print(f"turn {turn}: {r.prompt_tokens} prompt tokens ({r.cached_tokens} cached), TTFT "
              f"{1e3 * r.ttft_s:.1f} ms", file=sys.stderr)
        history += r.token_ids
    return {"turns": turns}


async def shared_prefix(client: openai.AsyncOpenAI, model: str,
                        args: argparse.Namespace) -> dict:
    """--num-prompts token-id prompts: one --shared-len prefix (a system prompt) and a distinct
    --question-len question each, at the first --concurrency level. The total time, TTFTs and
    cached tokens."""
    rng = random.Random(args.seed)
    system = token_ids(rng, args.shared_len, args)
    prompts = [Prompt("", args.output_len, system + token_ids(rng, args.question_len, args))
               for _ in range(args.num_prompts)]
    results, duration = await run_level(client, args, model, prompts, args.concurrency[0])
    ok = [r for r in results if r.error is None]
    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    print(f"shared prefix: {len(ok)}/{len(results)} ok in {duration:.2f} s, "
          f"{sum(r.cached_tokens for r in ok)} of {sum(r.prompt_tokens for r in ok)} prompt "
          f"tokens cached", file=sys.stderr)
    return {"total_s": duration, "requests": len(results), "errors": len(results) - len(ok),
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "cached_tokens": sum(r.cached_tokens for r in ok),
            "ttft_ms_p50": float(np.percentile(ttft, 50)) * 1e3 if ttft else None,
            "ttft_ms_max": max(ttft) * 1e3 if ttft else None,
            "per_request": [{"cached_tokens": r.cached_tokens, "ttft_ms": 1e3 * r.ttft_s
                             if r.ttft_s is not None else None, "error": r.error}
                            for r in results]}


async def prefix_workload(args: argparse.Namespace) -> dict:
    async with openai.AsyncOpenAI(base_url=f"{args.base_url}/v1", max_retries=0,
                                  api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                  timeout=args.timeout) as client:
        try:
            model = args.model or (await client.models.list()).data[0].id
        except (openai.APIError, IndexError) as e:
            raise SystemExit(f"no model at {args.base_url}/v1/models: {e!r}") from None
        run = multi_turn if args.workload == "multi-turn" else shared_prefix
        return {"model": model, args.workload: await run(client, model, args)}


async def bench(args: argparse.Namespace) -> dict:
    async with (openai.AsyncOpenAI(base_url=f"{args.base_url}/v1", max_retries=0,
                                   api_key=os.environ.get("OPENAI_API_KEY", "EMPTY"),
                                   timeout=args.timeout) as client,
                httpx.AsyncClient(timeout=30.0) as http):
        try:
            model = args.model or (await client.models.list()).data[0].id
        except (openai.APIError, IndexError) as e:
            raise SystemExit(f"no model at {args.base_url}/v1/models: {e!r}") from None
        if args.dataset:
            prompts = load_dataset(args.dataset, args.num_prompts, args.output_len)
            warm = await send(client, model, prompts[0], args.chat, args.temperature,
                              args.logprobs)
        else:  # the warm-up also measures tokens per word, to size the prompts in tokens
            probe = synthetic(1, args.prompt_len, min(args.output_len, 16), args.seed)[0]
            warm = await send(client, model, probe, args.chat, args.temperature, args.logprobs)
            words = round(args.prompt_len ** 2 / max(warm.prompt_tokens, 1))
            prompts = synthetic(args.num_prompts, words, args.output_len, args.seed)
        if warm.error:
            raise SystemExit(f"the warm-up request failed: {warm.error}")
        recording = None
        if args.record_first:  # unmeasured: a replaying server records the outputs here
            results, recording = await run_level(client, args, model, prompts,
                                                 max(args.concurrency))
            failed = [r.error for r in results if r.error]
            if failed:
                raise SystemExit(f"the recording pass failed: {failed[0]}")
            print(f"recording pass: {len(results)} requests in {recording:.1f} s",
                  file=sys.stderr)
        levels = []
        for c in args.concurrency:
            before = await scrape(http, args.base_url)
            results, duration = await run_level(client, args, model, prompts, c)
            after = await scrape(http, args.base_url)
            s = summarize(c, results, duration, spec_stats(before, after))
            print(f"concurrency {c}: {s.requests - s.errors}/{s.requests} ok in {duration:.1f} s",
                  file=sys.stderr)
            levels.append({"summary": asdict(s), "requests": [
                asdict(r) | {"itl_s": [round(x, 6) for x in r.itl_s],
                             "chunk_gaps_s": [round(x, 6) for x in r.chunk_gaps_s]}
                for r in results]})
        # The first request (above) against the same request on a server now warm.
        again = await send(client, model, prompts[0] if args.dataset else probe, args.chat,
                           args.temperature, args.logprobs)
    first = {"first_ttft_ms": 1e3 * warm.ttft_s, "same_request_warm_ttft_ms":
             1e3 * again.ttft_s if again.ttft_s is not None else None,
             "prompt_tokens": warm.prompt_tokens}
    return {"model": model, "levels": levels, "first_request": first,
            "recording_pass_s": recording}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    command = "python -m bench.serving " + shlex.join(sys.argv[1:] if argv is None else argv)
    started = datetime.now(timezone.utc).isoformat(timespec="seconds")
    if args.workload != "levels":
        result = asyncio.run(prefix_workload(args))
        report = {"command": command, "started": started, **result,
                  "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
        args.out_dir.mkdir(parents=True, exist_ok=True)
        (args.out_dir / f"{args.workload}.json").write_text(json.dumps(report, indent=1))
        return report
    result = asyncio.run(bench(args))
    summaries = [level["summary"] for level in result["levels"]]
    report = {"command": command, "started": started, "model": result["model"],
              "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
              "first_request": result["first_request"],
              "recording_pass_s": result["recording_pass_s"], "levels": result["levels"]}
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "serving.json").write_text(json.dumps(report))  # every ITL: kept flat
    write_csv(args.out_dir / "serving.csv", summaries)
    plot(args.out_dir / "serving.png", summaries, f"{result['model']} — {args.base_url}")
    print(table(summaries))
    f = result["first_request"]
    print(f"first request after start-up: TTFT {f['first_ttft_ms']:.1f} ms; the same request "
          f"once warm: {f['same_request_warm_ttft_ms']:.1f} ms")
    for level in result["levels"]:
        for err in sorted({r["error"] for r in level["requests"] if r["error"]})[:3]:
            print(f"concurrency {level['summary']['concurrency']} error: {err}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
