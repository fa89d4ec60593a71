"""Reliability runs against a real `dflash-serve serve` (started here, in its own process and
Ray cluster), each printing and writing its figures as JSON (docs/RELIABILITY.md):

    python -m tools.chaos drain    [--grace 10]        # SIGTERM with 8 streams open
    python -m tools.chaos kill     [--streams 16]      # a second server on the port; SIGKILL of
                                                       # a TP worker, the draft, the driver
                                                       # (--roles: which); then of the raylet
                                                       # (the server must exit)
    python -m tools.chaos freeze   [--streams 16]      # SIGSTOP of a TP worker, of the driver
    python -m tools.chaos abandon  [--requests 200]    # clients that leave at any moment
    python -m tools.chaos overload                     # 3 requests of n = 256 at once
    python -m tools.chaos big      [--payload detokenize]  # a 20 MB body beside 4 streams
    python -m tools.chaos soak     [--duration 1200]   # mixed load, cancels, periodic kills
    common: [--model DIR --draft-model DIR --tp 2 --device cpu --api-key KEY --out result.json]

main_result() can also run one against a server already started (tests/tools/test_chaos.py's
runs share one).

A stream's ending is one of: "finished" (finish_reason, then [DONE]), "error:<code>" (an
error event, then [DONE]), "http:<status>" (refused before streaming), "cut" (the connection
ended without [DONE]: the failure these runs look for), "cancelled" (closed by us)."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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

from deploy.process_tree import descendants

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "tests" / "assets" / "tiny"
MODEL = "tiny"
ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
HEADERS: dict[str, str] = {}  # the API key's header, when the runs' server has one


def serve_command(args: argparse.Namespace, port: int, grace: float = 30.0) -> list[str]:
    cmd = [sys.executable, "-m", "deploy.cli", "serve", "--model", args.model,
           "--tp", str(args.tp), "--device", args.device, "--port", str(port),
           "--served-model-name", MODEL, "--shutdown-grace-s", str(grace),
           "--max-num-seqs", str(args.max_num_seqs)]
    if args.draft_model:
        cmd += ["--draft-model", args.draft_model]
    if args.api_key:
        cmd += ["--api-key", args.api_key]
    return cmd


class Server:
    """`dflash-serve serve` in a child process; `url` once it printed its banner."""

    def __init__(self, args: argparse.Namespace, grace: float = 30.0):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(serve_command(args, self.port, grace), cwd=ROOT, env=ENV,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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
        return [self.proc.pid, *descendants(self.proc.pid)]

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
        async with client.stream("POST", f"{url}/v1/completions", json=body,
                                 headers=HEADERS) as resp:
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
               "driver": "ray::EngineDriver", "raylet": "/"}


def role_pid(server: Server, role: str) -> int:
    """One process of `role` under the server: the last TP worker found, the draft, the
    driver, or the raylet (by its executable's name)."""
    if role == "raylet":
        pids = [p for p in server.descendants() if _cmdline(p).split(" ")[0].endswith("/raylet")]
    else:
        pids = [p for p in server.descendants() if _cmdline(p).startswith(ROLE_TITLES[role])]
    if not pids:
        raise RuntimeError(f"no {role} process under the server")
    return max(pids)


def kill(server: Server, role: str, sig: int = signal.SIGKILL) -> float:
    """`sig` (SIGKILL: as the kernel's OOM killer or a crash would end it; SIGSTOP: a frozen
    process) to one process of `role` under the server. Returns the moment (monotonic)."""
    os.kill(role_pid(server, role), sig)
    return time.monotonic()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def listening(pids: list[int]) -> list[dict]:
    """The TCP sockets these processes listen on: address, port, the process's title."""
    inodes: dict[str, int] = {}
    for pid in pids:
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes[target[8:-1]] = pid
        except OSError:
            continue
    out = []
    for table, v6 in (("/proc/net/tcp", False), ("/proc/net/tcp6", True)):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] != "0A" or f[9] not in inodes:  # 0A: LISTEN
                continue
            hex_addr, hex_port = f[1].split(":")
            raw = bytes.fromhex(hex_addr)
            if v6:  # four little-endian words
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))
                addr = socket.inet_ntop(socket.AF_INET6, raw)
            else:
                addr = socket.inet_ntop(socket.AF_INET, raw[::-1])
            pid = inodes[f[9]]
            out.append({"address": addr, "port": int(hex_port, 16), "pid": pid,
                        "process": _cmdline(pid).split(" ")[0][:40]})
    return out


def port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(1.0)
        return s.connect_ex(("127.0.0.1", port)) == 0


async def health_timeline(url: str, since: float, until: asyncio.Event,
                          every_s: float = 0.25) -> dict:
    """/health polled from `since` until `until` is set: when it first failed (a non-200, or
    no answer within 10 s), and the longest it took to answer."""
    first_bad, longest = None, 0.0
    async with httpx.AsyncClient(timeout=10) as c:
        while not until.is_set():
            t = time.monotonic()
            try:
                ok = (await c.get(f"{url}/health")).status_code == 200
            except httpx.HTTPError:
                ok = False
            longest = max(longest, time.monotonic() - t)
            if not ok and first_bad is None:
                first_bad = time.monotonic() - since
            await asyncio.sleep(every_s)
    return {"first_unhealthy_s": first_bad, "longest_answer_s": longest}


async def engine_counts(url: str) -> dict[str, float]:
    """From /metrics: requests running and waiting, and those the engine ended, by how."""
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient(timeout=30) as c:
        text = (await c.get(f"{url}/metrics", headers=HEADERS)).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in ("dflash_num_requests_running", "dflash_num_requests_waiting"):
                out[sample.name.removeprefix("dflash_num_requests_")] = sample.value
            elif sample.name == "dflash_engine_requests_finished_total":
                out["ended_by_" + sample.labels["finish_reason"]] = sample.value
    return out


async def streams_under_way(c: httpx.AsyncClient, url: str, n: int) -> list[asyncio.Task]:
    """n streams of 900 tokens, returned once each has had its first chunk."""
    started = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(stream(c, url, prompt(10, i), 900, started=started[i]))
             for i in range(n)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
    return tasks


# ---- runs -----------------------------------------------------------------------------------

async def run_drain(args, server: Server) -> dict:
    async with httpx.AsyncClient(timeout=300) as c:
        started = [asyncio.Event() for _ in range(8)]
        tasks = [asyncio.create_task(stream(c, server.url, prompt(20, i), 40 if i < 4 else 900,
                                            started=started[i])) for i in range(8)]
        await asyncio.gather(*(e.wait() for e in started))
        t = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(1.0)
        late = await c.post(f"{server.url}/v1/completions", headers=HEADERS,
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


def second_server(args, port: int) -> dict:
    """`dflash-serve serve` on a port the first server holds: it must refuse to start."""
    t = time.monotonic()
    proc = subprocess.run(serve_command(args, port), cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=300)
    said = [line for line in proc.stderr.splitlines() if "in use" in line]
    return {"exit_code": proc.returncode, "exited_after_s": time.monotonic() - t,
            "message": said[0][:200] if said else proc.stderr[-300:]}


async def proxy_routes(url: str) -> dict:
    """Ray Serve's own routes, with and without the API key."""
    async with httpx.AsyncClient(timeout=30) as c:
        return {path: {"without_key": (await c.get(url + path)).status_code,
                       "with_key": (await c.get(url + path, headers=HEADERS)).status_code}
                for path in ("/-/routes", "/-/healthz")}


async def run_kill(args, server: Server) -> dict:
    out = {"second_server_on_the_port": second_server(args, server.port),
           "listening_beyond_loopback": [
               sock for sock in listening(server.descendants())
               if not sock["address"].removeprefix("::ffff:").startswith("127.")
               and sock["address"] != "::1"]}
    if args.api_key:
        out["proxy_routes"] = await proxy_routes(server.url)
    for role in args.roles:
        async with httpx.AsyncClient(timeout=300) as c:
            tasks = await streams_under_way(c, server.url, args.streams)
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
    out["raylet"] = await raylet_death(server, args.streams)
    print("raylet", json.dumps(out["raylet"]), flush=True)
    return out


async def raylet_death(server: Server, num_streams: int) -> dict:
    """SIGKILL of the raylet with streams open: the server must notice, close its port, exit
    non-zero saying why, and leave no process behind."""
    before = server.descendants()[1:]
    async with httpx.AsyncClient(timeout=120) as c:
        started = [asyncio.Event() for _ in range(num_streams)]
        tasks = [asyncio.create_task(stream(c, server.url, prompt(10, 300 + i), 900,
                                            started=started[i])) for i in range(num_streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 300)
        t = await asyncio.to_thread(kill, server, "raylet")
        try:
            rest, _ = await asyncio.to_thread(server.proc.communicate, timeout=120)
        except subprocess.TimeoutExpired:
            rest = ""
        exited = time.monotonic() - t if server.proc.returncode is not None else None
        closed = not port_open(server.port)
        results = await asyncio.gather(*tasks)
    await asyncio.sleep(1.0)
    left = [p for p in before if Path(f"/proc/{p}").exists()
            and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    said = [line for line in rest.splitlines() if "dflash-serve: error" in line]
    return {"exit_code": server.proc.returncode, "exited_after_s": exited,
            "port_closed_at_exit": closed, "streams": endings(results),
            "processes_before": len(before), "processes_left": len(left),
            "message": said[0][:300] if said else rest[-300:]}


async def run_freeze(args, server: Server) -> dict:
    """SIGSTOP of a TP worker, then of the driver, with streams open: the streams end with an
    error, /health answers 503 meanwhile (never hangs), the engine comes back."""
    out, stopped = {}, []
    try:
        for role in ("worker", "driver"):
            async with httpx.AsyncClient(timeout=300) as c:
                tasks = await streams_under_way(c, server.url, args.streams)
                pid = role_pid(server, role)
                stopped.append(pid)
                t = await asyncio.to_thread(kill, server, role, signal.SIGSTOP)
                done = asyncio.Event()
                health = asyncio.create_task(health_timeline(server.url, t, done))
                results = await asyncio.gather(*tasks)
                ended = max(r["t1"] for r in results) - t
                await wait_health(server.url, 300)
                back = time.monotonic() - t
                done.set()
                after = await asyncio.gather(*(stream(c, server.url, prompt(8, 200 + i), 16)
                                               for i in range(4)))
            timeline = await health
            out[role] = {"in_flight": endings(results), "all_ended_within_s": ended,
                         "first_unhealthy_s": timeline["first_unhealthy_s"],
                         "longest_health_answer_s": timeline["longest_answer_s"],
                         "healthy_again_s": back, "sent_after": endings(after),
                         "frozen_process_gone": not Path(f"/proc/{pid}").exists()}
            print(role, json.dumps(out[role]), flush=True)
    finally:
        for pid in stopped:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGCONT)
    return out


async def run_abandon(args, server: Server) -> dict:
    """`--requests` requests at once (streamed or not, n 1 or 4), each abandoned by its
    client at a random moment 0–1.5 s after it was sent (queued, prefilling, decoding): how
    many still run afterwards, and until when."""
    rng = random.Random(2)
    limits = httpx.Limits(max_connections=args.requests + 10)
    async with httpx.AsyncClient(timeout=300, limits=limits) as c:
        async def one(i: int) -> None:
            body = {"model": MODEL, "prompt": prompt(20, 500 + i), "max_tokens": 900,
                    "ignore_eos": True, "stream": rng.random() < 0.5,
                    "n": rng.choice([1, 1, 4])}
            task = asyncio.create_task(c.post(f"{server.url}/v1/completions", json=body,
                                              headers=HEADERS))
            await asyncio.sleep(rng.uniform(0.0, 1.5))
            task.cancel()
            with contextlib.suppress(BaseException):
                await task

        before = await engine_counts(server.url)
        await asyncio.gather(*(one(i) for i in range(args.requests)))
    t = time.monotonic()
    samples = []
    while time.monotonic() - t < 120:
        counts = await engine_counts(server.url)
        samples.append((time.monotonic() - t, counts["running"] + counts["waiting"]))
        if samples[-1][1] == 0:
            break
        await asyncio.sleep(0.1)
    ended = {how: counts[f"ended_by_{how}"] - before[f"ended_by_{how}"]
             for how in ("stop", "length", "abort", "error")}
    return {"requests": args.requests, "idle_after_s": samples[-1][0],
            "in_engine_at_the_last_abandonment": samples[0][1],
            "engine_requests_ended": ended}


async def run_overload(args, server: Server) -> dict:
    """Three requests of n = 256 at once, against a queue of 4 × max-num-seqs: each is served
    or refused, and a refusal comes at once."""
    async with httpx.AsyncClient(timeout=600) as c:
        async def one(i: int) -> dict:
            t = time.monotonic()
            r = await c.post(f"{server.url}/v1/completions", headers=HEADERS, json={
                "model": MODEL, "prompt": prompt(10, 700 + i), "max_tokens": 64, "n": 256,
                "ignore_eos": True})
            return {"status": r.status_code, "seconds": time.monotonic() - t,
                    "code": r.json().get("error", {}).get("code") if r.status_code != 200
                    else None}

        results = await asyncio.gather(*(one(i) for i in range(3)))
        after = await stream(c, server.url, prompt(8, 800), 8)
    return {"requests": results, "served": sum(r["status"] == 200 for r in results),
            "refused": sum(r["status"] == 429 for r in results), "after": after["ending"]}


async def run_big(args, server: Server) -> dict:
    async with httpx.AsyncClient(timeout=300) as c:
        started = [asyncio.Event() for _ in range(4)]
        tasks = [asyncio.create_task(stream(c, server.url, prompt(10, i), 600,
                                            started=started[i])) for i in range(4)]
        await asyncio.gather(*(e.wait() for e in started))
        await asyncio.sleep(3.0)
        if args.payload == "detokenize":  # 3 M ids: 15 MB, within the body limit
            path = "/detokenize"
            body = json.dumps({"model": MODEL,
                               "tokens": [100 + i % 200 for i in range(3_000_000)]})
        else:
            path = "/v1/completions"
            body = json.dumps({"model": MODEL, "prompt": "a" * (20 << 20), "max_tokens": 4})
        t = time.monotonic()
        r = await c.post(f"{server.url}{path}", content=body,
                         headers={"Content-Type": "application/json", **HEADERS})
        big_s, t_end = time.monotonic() - t, time.monotonic()
        results = await asyncio.gather(*tasks)

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

    return {"payload": args.payload, "bytes": len(body), "status": r.status_code,
            "code": r.json().get("error", {}).get("code"),
            "seconds": big_s, "streams": endings(results),
            "gaps_before": gap_stats(t - 2.5, t), "gaps_during": gap_stats(t, t_end + 0.5)}


async def run_soak(args, server: Server) -> dict:
    rng = random.Random(0)
    stop_at = time.monotonic() + args.duration
    results: list[dict] = []
    kills: list[dict] = []
    await asyncio.sleep(2.0)
    rss0, shm0 = server.rss_bytes(), shm_names()

    async def client_loop(i: int) -> None:
        async with httpx.AsyncClient(timeout=300) as c:
            k = 0
            while time.monotonic() < stop_at:
                n = rng.choice([5, 40, 200, 600])
                m = min(rng.choice([1, 16, 64, 256]), args.max_tokens)
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
    return {"duration_s": args.duration, "clients": args.clients, "requests": len(results),
            "endings": endings(results), "kills": kills,
            "rss_start_gib": rss0 / 2**30, "rss_end_gib": rss1 / 2**30,
            "dev_shm_start": shm0, "dev_shm_end": shm1}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", choices=["drain", "kill", "freeze", "abandon", "overload", "big",
                                   "soak"])
    p.add_argument("--model", default=str(DEMO / "target"))
    p.add_argument("--draft-model", default=str(DEMO / "draft"))
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--grace", type=float, default=10.0, help="drain: --shutdown-grace-s")
    p.add_argument("--streams", type=int, default=16, help="kill: streams in flight")
    p.add_argument("--roles", nargs="+", choices=["worker", "draft", "driver"],
                   default=["worker", "draft", "driver"],
                   help="kill: the actors killed in turn, before the raylet")
    p.add_argument("--duration", type=float, default=1200.0, help="soak: seconds")
    p.add_argument("--clients", type=int, default=12, help="soak: concurrent clients")
    p.add_argument("--kill-every", type=float, default=240.0, help="soak: seconds")
    p.add_argument("--max-tokens", type=int, default=256,
                   help="soak: the longest completion (each is 1, 16, 64 or 256 tokens, cut "
                        "to this)")
    p.add_argument("--requests", type=int, default=200, help="abandon: requests")
    p.add_argument("--payload", choices=["completion", "detokenize"], default="completion",
                   help="big: a 20 MB completion, or a /detokenize of 3 M ids (15 MB)")
    p.add_argument("--api-key", help="serve with this API key (kill: also checks Ray Serve's "
                                     "own routes for it)")
    p.add_argument("--out")
    return p.parse_args(argv)


def main_result(argv: list[str] | None = None, server: Server | None = None) -> dict:
    """Runs what argv says; its result (also printed, and written to --out). On `server` if
    given (started with argv's flags), which stays up unless the run ends it (kill's raylet
    death, drain's SIGTERM); else on one started here and stopped after. Once the server has
    exited, the result says what /dev/shm holds of ours."""
    args = parse_args(argv)
    HEADERS.clear()
    if args.api_key:
        HEADERS["Authorization"] = f"Bearer {args.api_key}"
    runs = {"drain": run_drain, "kill": run_kill, "freeze": run_freeze, "abandon": run_abandon,
            "overload": run_overload, "big": run_big, "soak": run_soak}
    own = server is None
    if own:
        server = Server(args, grace=args.grace if args.run == "drain" else 30.0)
    try:
        result = {"run": args.run, "args": vars(args),
                  **asyncio.run(runs[args.run](args, server))}
    finally:
        if own:
            server.stop()
    if server.proc.poll() is not None:
        result["dev_shm_after_exit"] = shm_names()
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
