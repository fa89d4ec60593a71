"""Long prompts against a running server, one at a time: status, time to the first token and
to the end, streamed over /v1/completions with the prompt as token ids (no tokenizer needed,
exact lengths).

    python -m bench.long_prompts --base-url http://127.0.0.1:8000 --lengths 32768 131072 \
        [--max-tokens 16] [--vocab 248320] [--with-short N] [--out result.json]

--with-short N: while each long prompt runs, N short requests (512-token prompts, 64 tokens
out) stream side by side, each started again as it ends; per long prompt it reports how many
ended and with which status, and their gaps between chunks (median and largest: the stall a
long prefill puts on the others).

A request that fails prints the server's error body; the run goes on with the next length.
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
from pathlib import Path

from bench.http_client import httpx


def prompt_ids(length: int, vocab: int, seed: int) -> list[int]:
    return [1 + (i * 7919 + seed) % (vocab - 1) for i in range(length)]


def run_one(client: httpx.Client, base_url: str, model: str, length: int, max_tokens: int,
            vocab: int, seed: int, gaps: list[float] | None = None) -> dict:
    body = {"model": model, "prompt": prompt_ids(length, vocab, seed), "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    r = {"prompt_tokens": length, "status": None, "ttft_s": None, "total_s": None,
         "tokens": 0, "error": None}
    t = last = time.perf_counter()
    with client.stream("POST", f"{base_url}/v1/completions", json=body) as resp:
        r["status"] = resp.status_code
        if resp.status_code != 200:
            r["error"] = resp.read().decode()[:2000]
            return r
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                r["error"] = json.dumps(chunk["error"])[:2000]
                break
            if chunk.get("choices") and chunk["choices"][0].get("text") is not None:
                now = time.perf_counter()
                if r["ttft_s"] is None:
                    r["ttft_s"] = now - t
                elif gaps is not None:
                    gaps.append(now - last)
                last = now
                r["tokens"] += 1
    r["total_s"] = time.perf_counter() - t
    return r


class ShortTraffic:
    """N threads, each streaming short requests one after another until stopped."""

    def __init__(self, base_url: str, model: str, n: int, vocab: int, timeout: float):
        self.stop = threading.Event()
        self.statuses: list[int | None] = []
        self.errors: list[str] = []
        self.gaps: list[float] = []
        self.threads = [threading.Thread(target=self._loop, args=(base_url, model, vocab, i,
                                                                  timeout), daemon=True)
                        for i in range(n)]
        for th in self.threads:
            th.start()

    def _loop(self, base_url, model, vocab, i, timeout):
        with httpx.Client(timeout=timeout) as client:
            k = 0
            while not self.stop.is_set():
                gaps: list[float] = []
                r = run_one(client, base_url, model, 512, 64, vocab, 1000 + 97 * i + k, gaps)
                self.statuses.append(r["status"])
                self.gaps.extend(gaps)
                if r["error"]:
                    self.errors.append(r["error"][:300])
                k += 1

    def finish(self) -> dict:
        self.stop.set()
        for th in self.threads:
            th.join()
        gaps = sorted(self.gaps)
        return {"requests": len(self.statuses),
                "ok": sum(1 for s in self.statuses if s == 200),
                "errors": self.errors[:5],
                "gap_median_ms": statistics.median(gaps) * 1e3 if gaps else None,
                "gap_max_ms": gaps[-1] * 1e3 if gaps else None}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--lengths", type=int, nargs="+", default=[32768, 131072])
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--vocab", type=int, help="token ids below this (default: the model's, "
                   "from /v1/models when it reports it, else 32000)")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--with-short", type=int, default=0,
                   help="short streams running beside each long prompt")
    p.add_argument("--out")
    args = p.parse_args(argv)
    results = []
    with httpx.Client(timeout=args.timeout) as client:
        models = client.get(f"{args.base_url}/v1/models").json()["data"]
        model = models[0]["id"]
        vocab = args.vocab or 32000
        for i, n in enumerate(args.lengths):
            short = ShortTraffic(args.base_url, model, args.with_short, vocab, args.timeout) \
                if args.with_short else None
            r = run_one(client, args.base_url, model, n, args.max_tokens, vocab, i)
            if short is not None:
                r["short"] = short.finish()
            results.append(r)
            ttft = f"{r['ttft_s']:.2f} s" if r["ttft_s"] is not None else "-"
            print(f"{n:>7} tokens: HTTP {r['status']}, TTFT {ttft}, {r['tokens']} chunks"
                  + (f", error {r['error']}" if r["error"] else "")
                  + (f", beside it: {json.dumps(r['short'])}" if short else ""), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "results": results},
                                             indent=1))


if __name__ == "__main__":
    main()
