"""Reliability runs against a real `dflash-serve serve` (started here, in its own process and
Ray cluster), each printing and writing its figures as JSON (docs/RELIABILITY.md):

    python -m tools.chaos drain  [--grace 10]          # SIGTERM with 8 streams open
    python -m tools.chaos kill   [--streams 16]        # a TP worker, the draft, the driver
    python -m tools.chaos big                          # a 20 MB body beside 4 streams
    python -m tools.chaos soak   [--duration 1200]     # mixed load, cancels, periodic kills
    common: [--model DIR --draft-model DIR --tp 2 --device cpu --out result.json]

A stream's ending is one of: "finished" (finish_reason, then [DONE]), "error:<code>" (an
error event, then [DONE]), "http:<status>" (refused before streaming), "cut" (the connection
ended without [DONE]: the failure these runs look for), "cancelled" (closed by us)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx2 as httpx

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "tests" / "assets" / "tiny"
MODEL = "tiny"


class Server:
    """`dflash-serve serve` in a child process; `url` once it printed its banner."""

    def __init__(self, args: argparse.Namespace, grace: float = 30.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, "-m", "deploy.cli", "serve", "--model", args.model,
               "--tp", str(args.tp), "--device", args.device, "--port", str(self.port),
               "--served-model-name", MODEL, "--shutdown-grace-s", str(grace),
               "--max-num-seqs", str(args.max_num_seqs)]
        if args.draft_model:
            cmd += ["--draft-model", args.draft_model]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        deadline = time.monotonic() + 300
        while not any("stop with Ctrl-C" in line for line in self.lines):
            line = self.proc.stdout.readline()
            if not line or time.monotonic() > deadline:
                raise RuntimeError("the server did not start:\n" + "".join(self.lines[-40:]))
            self.lines.append(line)

    def stop(self, sig=signal.SIGINT, timeout: float = 180) -> tuple[int | None, float]:
        """Signals the server; its exit code and the seconds it took to exit."""
        t = time.monotonic()
        self.proc.send_signal(sig)
        try:
            rest, _ = self.proc.communicate(timeout=timeout)
            self.lines.append(rest)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.communicate()
        return self.proc.returncode, time.monotonic() - t

    def descendants(self) -> list[int]:
        """The server's process and every process below it (Ray's included)."""
        children: dict[int, list[int]] = {}
        for d in os.listdir("/proc"):
            if d.isdigit():
                try:
                    fields = Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                children.setdefault(int(fields[1]), []).append(int(d))
        out, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def rss_bytes(self) -> int:
        """Resident memory of the server and every process below it (Ray's included)."""
        total = 0
        for pid in self.descendants():
            try:
                for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
            except OSError:
                pass
        return total


def shm_names() -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(("psm_", "dflash-")))


def prompt(n: int, seed: int) -> list[int]:
    return [1 + (seed * 31 + i * 7) % 300 for i in range(n)]


async def stream(client: httpx.AsyncClient, url: str, prompt_ids: list[int], max_tokens: int,
                 cancel_after: int | None = None, started: asyncio.Event | None = None) -> dict:
    """One streamed completion; its ending (see the module's doc), chunk count, gaps."""
    body = {"model": MODEL, "prompt": prompt_ids, "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    r = {"ending": "cut", "chunks": 0, "t0": time.monotonic(), "gaps": []}
    last = r["t0"]
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                r["ending"] = f"http:{resp.status_code}"
                with_body = (await resp.aread()).decode()[:300]
                r["body"] = with_body
                return r
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    r["ending"] = r.pop("pending", "cut")
                    break
                event = json.loads(line[6:])
                now = time.monotonic()
                if "error" in event:
                    r["pending"] = f"error:{event['error'].get('code')}"
                    continue
                if r["chunks"]:
                    r["gaps"].append(now - last)
                last = now
                r["chunks"] += 1
                if started is not None:
                    started.set()
                if event["choices"][0].get("finish_reason"):
                    r["pending"] = "finished"
                if cancel_after is not None and r["chunks"] >= cancel_after:
                    r["ending"] = "cancelled"
                    break
    except httpx.HTTPError as e:
        r["ending"], r["exception"] = "cut", f"{type(e).__name__}: {e}"[:200]
    finally:
        r["t1"] = time.monotonic()
        r.pop("pending", None)
    return r


def endings(results: list[dict]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in results:
        out[r["ending"]] = out.get(r["ending"], 0) + 1
    return out


async def recovered_after(url: str, since: float, timeout: float = 120) -> float | None:
    """Seconds from `since` (a kill) until /health is 200 again, having first seen it fail
    (before the engine has noticed a death it may still answer 200). None: not in time."""
    async with httpx.AsyncClient(timeout=10) as c:
        failed = False
        while time.monotonic() - since < timeout:
            try:
                ok = (await c.get(f"{url}/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                failed = True
            elif failed:
                return time.monotonic() - since
            await asyncio.sleep(0.1)
    return None


async def wait_health(url: str, timeout: float) -> float | None:
    """Seconds until /health answers 200 (None: not within timeout)."""
    t = time.monotonic()
    async with httpx.AsyncClient(timeout=10) as c:
        while time.monotonic() - t < timeout:
            try:
                if (await c.get(f"{url}/health")).status_code == 200:
                    return time.monotonic() - t
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    return None


# The processes behind each role, by the title Ray gives an actor's process.
ROLE_TITLES = {"worker": "ray::TargetWorker", "draft": "ray::DraftWorker",
               "driver": "ray::EngineDriver"}


def kill(server: Server, role: str) -> float:
    """SIGKILL of one process of `role` under the server (the last TP worker found, the
    draft, or the driver), as the kernel's OOM killer or a crash would end it. Returns the
    moment of the kill (monotonic)."""
    pids = [pid for pid in server.descendants()
            if _cmdline(pid).startswith(ROLE_TITLES[role])]
    if not pids:
        raise RuntimeError(f"no {ROLE_TITLES[role]} process under the server")
    os.kill(max(pids), signal.SIGKILL)
    return time.monotonic()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


# ---- runs -----------------------------------------------------------------------------------

async def run_drain(args) -> dict:
    server = Server(args, grace=args.grace)
    async with httpx.AsyncClient(timeout=300) as c:
        started = [asyncio.Event() for _ in range(8)]
        tasks = [asyncio.create_task(stream(c, server.url, prompt(20, i), 40 if i < 4 else 900,
                                            started=started[i])) for i in range(8)]
        await asyncio.gather(*(e.wait() for e in started))
        t = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)
        late = await c.post(f"{server.url}/v1/completions",
                            json={"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4})
        results = await asyncio.gather(*tasks)
    rc, _ = server.stop(signal.SIGTERM)  # already signalled: this waits for the exit
    exited = time.monotonic() - t
    return {"grace_s": args.grace, "streams": endings(results),
            "short_endings": endings(results[:4]), "long_endings": endings(results[4:]),
            "last_stream_end_s": max(r["t1"] for r in results) - t,
            "late_request": {"status": late.status_code,
                             "code": late.json().get("error", {}).get("code")},
            "exit_code": rc, "exited_after_s": exited}


async def run_kill(args) -> dict:
    server = Server(args)
    out = {}
    try:
        for role in ("worker", "draft", "driver"):
            async with httpx.AsyncClient(timeout=300) as c:
                started = [asyncio.Event() for _ in range(args.streams)]
                tasks = [asyncio.create_task(stream(c, server.url, prompt(10, i), 900,
                                                    started=started[i]))
                         for i in range(args.streams)]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
                t = await asyncio.to_thread(kill, server, role)
                health_task = asyncio.create_task(recovered_after(server.url, t))
                await asyncio.sleep(0.5)
                during = [asyncio.create_task(stream(c, server.url, prompt(8, 100 + i), 16))
                          for i in range(8)]
                results = await asyncio.gather(*tasks)
                ended = max(r["t1"] for r in results) - t
                health = await health_task
                during = await asyncio.gather(*during)
                after = await asyncio.gather(*(stream(c, server.url, prompt(8, 200 + i), 16)
                                               for i in range(args.streams)))
            out[role] = {"in_flight": endings(results), "all_ended_within_s": ended,
                         "health_back_s": health,
                         "sent_during_recovery": endings(during),
                         "sent_after": endings(after)}
            print(role, json.dumps(out[role]), flush=True)
    finally:
        server.stop()
    return out


async def run_big(args) -> dict:
    server = Server(args)
    try:
        async with httpx.AsyncClient(timeout=300) as c:
            started = [asyncio.Event() for _ in range(4)]
            tasks = [asyncio.create_task(stream(c, server.url, prompt(10, i), 600,
                                                started=started[i])) for i in range(4)]
            await asyncio.gather(*(e.wait() for e in started))
            await asyncio.sleep(3.0)
            body = json.dumps({"model": MODEL, "prompt": "a" * (20 << 20), "max_tokens": 4})
            t = time.monotonic()
            r = await c.post(f"{server.url}/v1/completions", content=body,
                             headers={"Content-Type": "application/json"})
            big_s, t_end = time.monotonic() - t, time.monotonic()
            results = await asyncio.gather(*tasks)
    finally:
        server.stop()

    def gap_stats(lo: float, hi: float) -> dict:
        gaps = []
        for res in results:  # each gap at the time its chunk arrived
            at = res["t0"]
            for g in res["gaps"]:
                at += g
                if lo <= at <= hi:
                    gaps.append(g * 1e3)
        gaps.sort()
        return {"n": len(gaps), "median_ms": statistics.median(gaps) if gaps else None,
                "max_ms": gaps[-1] if gaps else None}

    return {"status": r.status_code, "code": r.json().get("error", {}).get("code"),
            "seconds": big_s, "streams": endings(results),
            "gaps_before": gap_stats(t - 2.5, t), "gaps_during": gap_stats(t, t_end + 0.5)}


async def run_soak(args) -> dict:
    server = Server(args)
    rng = random.Random(0)
    stop_at = time.monotonic() + args.duration
    results: list[dict] = []
    kills: list[dict] = []
    try:
        await asyncio.sleep(2.0)
        rss0, shm0 = server.rss_bytes(), shm_names()

        async def client_loop(i: int) -> None:
            async with httpx.AsyncClient(timeout=300) as c:
                k = 0
                while time.monotonic() < stop_at:
                    n = rng.choice([5, 40, 200, 600])
                    m = rng.choice([1, 16, 64, 256])
                    cancel = rng.randrange(1, 8) if rng.random() < 0.2 else None
                    results.append(await stream(c, server.url, prompt(n, 1000 * i + k), m,
                                                cancel_after=cancel))
                    k += 1

        async def killer() -> None:
            roles = ["worker", "draft"]
            j = 0
            while time.monotonic() + args.kill_every < stop_at:
                await asyncio.sleep(args.kill_every)
                role = roles[j % 2]
                at = await asyncio.to_thread(kill, server, role)
                kills.append({"role": role, "at_s": args.duration - (stop_at - at),
                              "health_back_s": await recovered_after(server.url, at)})
                j += 1

        await asyncio.gather(killer(), *(client_loop(i) for i in range(args.clients)))
        await wait_health(server.url, 120)
        await asyncio.sleep(5.0)  # the last aborts settle
        rss1, shm1 = server.rss_bytes(), shm_names()
    finally:
        server.stop()
    return {"duration_s": args.duration, "clients": args.clients, "requests": len(results),
            "endings": endings(results), "kills": kills,
            "rss_start_gib": rss0 / 2**30, "rss_end_gib": rss1 / 2**30,
            "dev_shm_start": shm0, "dev_shm_end": shm1, "dev_shm_after_exit": shm_names()}


def main_result(argv: list[str] | None = None) -> dict:
    """Runs what argv says; its result (also printed, and written to --out)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", choices=["drain", "kill", "big", "soak"])
    p.add_argument("--model", default=str(DEMO / "target"))
    p.add_argument("--draft-model", default=str(DEMO / "draft"))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--grace", type=float, default=10.0, help="drain: --shutdown-grace-s")
    p.add_argument("--streams", type=int, default=16, help="kill: streams in flight")
    p.add_argument("--duration", type=float, default=1200.0, help="soak: seconds")
    p.add_argument("--clients", type=int, default=12, help="soak: concurrent clients")
    p.add_argument("--kill-every", type=float, default=240.0, help="soak: seconds")
    p.add_argument("--out")
    args = p.parse_args(argv)
    runs = {"drain": run_drain, "kill": run_kill, "big": run_big, "soak": run_soak}
    result = {"run": args.run, "args": vars(args), **asyncio.run(runs[args.run](args))}
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return result


def main(argv: list[str] | None = None) -> int:
    main_result(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
