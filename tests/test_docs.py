"""The docs as a new user pastes them. Every fenced block of README.md, docs/API.md and
docs/DEPLOYMENT.md is one of:

- not a command: `text` (diagrams, synopses, output), `yaml`, `promql`;
- a command that needs more than one CPU machine: its first line reads `# needs: …` (GPUs, a
  cloud account); skipped here, with that reason;
- flag spellings (first line `# flag spellings…`): each `dflash-serve serve` line is parsed
  and checked as `serve run` would, with the tiny pair for M and D, nothing started;
- commands (`bash`, `python`): run here, from the repository root, in the activated venv,
  against the demo server that README's first command starts: `make serve`, run as pasted
  with `PORT` set as the docs say. `make test` is what runs this file; a `serve run` block
  is a second server on that port, run once `make serve` has stopped.

`make serve` also shows what a user sees at start-up (the printed hints, run as pasted) and at
SIGTERM (the requests in flight drained, exit 0, no line of noise)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx2 as httpx
import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ("README.md", "docs/API.md", "docs/DEPLOYMENT.md")
NOT_COMMANDS = {"text", "yaml", "promql"}
FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.M | re.S)
# Lines Ray or Serve print that nobody can act on; neither start-up nor shutdown shows them.
NOISE = ("graceful_shutdown failed", "will not be applied", "blocking ray.get")

pytestmark = pytest.mark.ray


def blocks() -> list[tuple[str, str, str]]:
    """(doc, language, body) of every fenced block, in order."""
    out = []
    for doc in DOCS:
        for m in FENCE.finditer((ROOT / doc).read_text()):
            indent = m.group(1)
            body = "".join(line[len(indent):] for line in m.group(3).splitlines(True))
            out.append((doc, m.group(2), body))
    return out


def commands(body: str) -> list[str]:
    """A bash block's commands: lines joined until the shell's quoting closes (a backslash
    continuation, a quoted string over several lines); comment lines left out."""
    out, buf = [], ""
    for line in body.splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        buf += line + "\n"
        if line.endswith("\\"):  # continued on the next line
            continue
        try:
            shlex.split(buf, comments=True)
        except ValueError:  # a quote or an escape still open
            continue
        out.append(buf.strip())
        buf = ""
    assert not buf, f"unclosed quoting: {buf!r}"
    return out


def kind(lang: str, body: str) -> str:
    first = body.lstrip().splitlines()[0] if body.strip() else ""
    if lang in NOT_COMMANDS:
        return "text"
    assert lang in ("bash", "python"), f"a block must say what it is: ```{lang}\n{body}"
    if first.startswith("# needs:"):
        return "needs"
    if first.startswith("# flag spellings"):
        return "flags"
    return "serve run" if any(c.startswith("serve run") for c in commands(body)) else "run"


ALL = blocks()
CASES = [pytest.param(doc, lang, body, id=f"{doc}:{i}") for i, (doc, lang, body) in enumerate(ALL)
         if kind(lang, body) != "serve run"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _venv_env(port: int, **extra: str) -> dict[str, str]:
    """The activated venv (this interpreter's), PORT as the docs read it; Hugging Face offline
    (lm-eval's local tasks need nothing from the Hub; CI reaches no Hub)."""
    venv = Path(sys.prefix)
    return {**os.environ, "VIRTUAL_ENV": str(venv), "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
            "PORT": str(port), "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0",
            "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", **extra}


class Server:
    """A server process started by a documented command, its output read as it comes."""

    def __init__(self, command: str, env: dict[str, str]):
        self.lines: list[str] = []
        self.proc = subprocess.Popen(["bash", "-c", command], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)

    def wait_for(self, ready, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.text[-4000:]
            time.sleep(0.5)

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def python_pid(self) -> int:
        """The `dflash-serve serve` process below make and its shell."""
        todo = [self.proc.pid]
        while todo:
            pid = todo.pop()
            with contextlib.suppress(OSError):
                if b"deploy.cli" in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
                    return pid
                for task in Path(f"/proc/{pid}/task").iterdir():
                    todo += map(int, (task / "children").read_text().split())
        raise AssertionError("no dflash-serve process below make")

    def stop(self) -> None:
        """Whatever of its process group is left (make may be gone, its children not)."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        self._reader.join(timeout=10)


@pytest.fixture(scope="module")
def demo():
    """README's `make serve`, as pasted, on a free PORT (SIGTERM's grace cut to 8 s through
    SERVE_ARGS, for the drain below)."""
    if Path(sys.prefix) != ROOT / ".venv":
        pytest.skip("the docs' commands run in the repository's .venv (make setup)")
    port = _free_port()
    env = _venv_env(port, SERVE_ARGS="--shutdown-grace-s 8")
    server = Server("make serve", env)
    try:
        server.wait_for(lambda: "stop with Ctrl-C" in server.text, 240)
        yield {"server": server, "port": port, "env": env}
    finally:
        server.stop()


def test_every_block_says_what_it_is():
    kinds = [kind(lang, body) for _, lang, body in ALL]
    assert kinds.count("run") >= 4 and kinds.count("serve run") == 1, kinds
    readme = ALL[0][2].splitlines()
    assert [line.split("#")[0].strip() for line in readme] == ["make serve", "make test"]


def _check_output(command: str, out: subprocess.CompletedProcess) -> None:
    said = out.stdout + out.stderr
    assert out.returncode == 0, (command, said[-3000:])
    if command.startswith("curl"):
        assert out.stdout.strip(), command
        assert '"error"' not in out.stdout, (command, out.stdout[-2000:])
        if "stream" in command:  # every event parses; the stream ends with [DONE]
            events = [line[6:] for line in out.stdout.splitlines() if line.startswith("data: ")]
            assert events[-1] == "[DONE]" and all(json.loads(e) for e in events[:-1])


@pytest.mark.parametrize("doc,lang,body", CASES)
def test_block(demo, doc, lang, body, tmp_path):
    what = kind(lang, body)
    if what == "text":
        return
    if what == "needs":
        pytest.skip(f"{doc}: {body.lstrip().splitlines()[0][2:]}")
    if what == "flags":
        return check_flag_spellings(body, tmp_path)
    if lang == "python":
        out = subprocess.run([sys.executable, "-c", body], cwd=ROOT, env=demo["env"],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip(), out.stderr[-3000:]
        return
    for command in commands(body):
        if command.startswith("make serve"):
            continue  # the server all these run against
        if command.startswith("make test"):
            continue  # the suite this test is part of
        out = subprocess.run(["bash", "-c", command], cwd=ROOT, env=demo["env"],
                             capture_output=True, text=True, timeout=300)
        _check_output(command, out)


def test_make_serves_printed_hints_work_as_pasted(demo):
    """The ready banner's curl and `ray list actors` (under Ray's token authentication), run
    as printed; the dashboard's URL; no start-up noise."""
    server, port = demo["server"], demo["port"]
    lines = server.lines
    at = next(i for i, line in enumerate(lines) if line.startswith("try:"))
    curl = lines[at + 1].strip()
    assert curl.startswith(f"curl http://127.0.0.1:{port}/v1/completions")
    ray_list = lines[next(i for i, line in enumerate(lines) if "its actors:" in line) + 1]
    env = {k: v for k, v in demo["env"].items() if not k.startswith("RAY_AUTH")}
    for command, want in ((curl, '"text_completion"'), (ray_list, "dflash-driver-")):
        out = subprocess.run(command, shell=True, capture_output=True, text=True, timeout=120,
                             env=env, cwd=ROOT)
        assert out.returncode == 0 and want in out.stdout, (command, out.stderr[-2000:])
    assert any(line.startswith("Ray dashboard: http://127.0.0.1:") for line in lines)
    assert not [n for n in NOISE if n in server.text]


def _stream_events(port: int, max_tokens: int, out: dict) -> None:
    """One streamed completion; out["events"]: its data lines, parsed ("[DONE]" as is)."""
    body = {"model": "tiny-dflash", "prompt": "Hello", "max_tokens": max_tokens, "stream": True,
            "ignore_eos": True}
    events = out["events"] = []
    try:
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body,
                          timeout=120) as r:
            out["status"] = r.status_code
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:] if line == "data: [DONE]" else json.loads(line[6:]))
    except Exception as e:  # a cut connection: what the drain must prevent
        out["error"] = f"{type(e).__name__}: {e}"


def test_sigterm_drains_make_serve_and_exits_cleanly(demo):
    """SIGTERM to `dflash-serve serve` (below make) with streams open: a short stream ends with
    its whole output, long ones with an error event, each with [DONE]; a request sent during
    the drain gets 503; then exit 0 (make's too), the port free, no shutdown noise."""
    server, port = demo["server"], demo["port"]
    # 1,000 tokens at TP 2 on CPU (~40 tokens/s for one stream) take far longer than the 8 s
    # grace; the short stream is 16 tokens: 40 once outlasted the grace on a 2-core box busy
    # elsewhere
    streams = [{}, {}, {}]
    threads = [threading.Thread(target=_stream_events, args=(port, n, out))
               for n, out in zip((16, 1000, 1000), streams, strict=True)]
    for t in threads:
        t.start()
    while not all(len(out.get("events", ())) >= 2 for out in streams):
        assert all(t.is_alive() for t in threads), streams
        time.sleep(0.05)
    os.kill(server.python_pid(), signal.SIGTERM)
    time.sleep(1.0)
    late = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30,
                      json={"model": "tiny-dflash", "prompt": "Hi", "max_tokens": 4})
    assert late.status_code == 503, late.text
    assert late.json()["error"]["code"] == "server_shutting_down"
    for t in threads:
        t.join(timeout=60)
    assert server.proc.wait(timeout=120) == 0, server.text[-3000:]
    server.stop()
    with socket.socket() as probe:  # the port is free again
        assert probe.connect_ex(("127.0.0.1", port)) != 0
    rest = server.text
    assert "shutting down" in rest and '"stopped": 2' in rest, rest[-3000:]
    assert not [n for n in NOISE if n in rest], rest[-3000:]
    short, *long = streams
    assert "error" not in short and short["events"][-1] == "[DONE]"
    assert short["events"][-2]["choices"][0]["finish_reason"] == "length"
    for out in long:
        assert "error" not in out and out["events"][-1] == "[DONE]", out
        assert out["events"][-2]["error"]["code"] == "server_shutting_down", out


def test_the_yaml_served_by_serve_run_on_PORT(demo):
    """DEPLOYMENT's `serve run` of the demo YAML's copy on PORT (once `make serve` is gone):
    served, then Ctrl-C (SIGINT to its process group, as a terminal sends) stops it."""
    (doc, lang, body), = [b for b in ALL if kind(b[1], b[2]) == "serve run"]
    port, env = demo["port"], demo["env"]
    assert demo["server"].proc.poll() is not None, "make serve still runs"
    *before, last = commands(body)
    for command in before:
        out = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=60)
        _check_output(command, out)
    server = Server(last, env)
    try:
        def answers() -> bool:
            with contextlib.suppress(httpx.HTTPError):
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=30, json={
                    "model": "tiny-dflash", "prompt": "Hello", "max_tokens": 4})
                return r.status_code == 200
            return False

        server.wait_for(answers, 240)
        os.killpg(server.proc.pid, signal.SIGINT)
        assert server.proc.wait(timeout=120) == 0, server.text[-3000:]
        assert "shutting down" in server.text
    finally:
        server.stop()


def check_flag_spellings(body: str, tmp_path: Path) -> None:
    """Each `dflash-serve serve` line, with the tiny pair for M and D: parsed, turned into
    ServeArgs and checked as `serve run` would (nothing started)."""
    from deploy.app import build_deployment
    from deploy.cli import build_parser, serve_args
    from draft.config import DraftConfig

    target, draft = (str(ROOT / "tests/assets/tiny" / name) for name in ("target", "draft"))
    trained = DraftConfig.from_pretrained(draft).block_size
    lines = [c for c in commands(body) if c.startswith("dflash-serve serve")]
    assert len(lines) >= 3
    (tmp_path / "template.jinja").write_text("{% for m in messages %}{{ m.content }}{% endfor %}")
    here = os.getcwd()
    os.chdir(tmp_path)  # the lines name template.jinja in the working directory
    try:
        for line in lines:
            line = line.replace('"$KEY"', "k").replace(" M ", f" {target} ").replace(
                '"D"', json.dumps(draft)).replace(" D ", f" {draft} ")
            # the tiny draft's block, where the lines give the 35B draft's 16 (K = 15)
            line = line.replace("16", str(trained)).replace("15", str(trained - 1))
            argv = shlex.split(line.replace("\\\n", " "))[1:] + ["--device", "cpu"]
            sargs = serve_args(build_parser().parse_args(argv))
            build_deployment(sargs)  # engine config, TP, draft block and chat template checks
            assert sargs.draft_model == draft and sargs.block_size == trained
    finally:
        os.chdir(here)
