from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cluster.engine import LLMEngine
from configs.engine import EngineConfig, SamplingParams
from deploy.cli import main

ROOT = Path(__file__).resolve().parents[2]
DEMO = ROOT / "tests" / "assets" / "tiny"


def test_generate_json_with_draft_equals_target_only(capsys):
    args = ["generate", "--model", str(DEMO / "target"), "--prompt-ids", "72,101,108,108,111",
            "--max-tokens", "24", "--ignore-eos", "--json"]
    assert main(args + ["--draft-model", str(DEMO / "draft"),
                        "--speculative-dflash-block-size", "8"]) == 0
    spec = json.loads(capsys.readouterr().out)
    assert main(args) == 0
    plain = json.loads(capsys.readouterr().out)
    assert spec["token_ids"] == plain["token_ids"] and len(spec["token_ids"]) == 24
    assert spec["num_rounds"] == len(spec["acceptance_lengths"]) < plain["num_rounds"]
    assert sum(spec["acceptance_lengths"]) + 1 == 24
    ref = LLMEngine(EngineConfig(model=str(DEMO / "target"))).generate(
        [[72, 101, 108, 108, 111]], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    assert plain["token_ids"] == ref.output_ids
    assert isinstance(spec["text"], str)


def test_console_script_text_prompt_and_chat():
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", "--model", str(DEMO / "target"),
         "--draft-model", str(DEMO / "draft"), "--prompt", "The river", "--chat",
         "--max-tokens", "8", "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20",
         "--seed", "3", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert 1 <= len(out["token_ids"]) <= 8 and out["finish_reason"] in ("stop", "length")


def test_generate_takes_structured_outputs_and_the_sampling_controls(capsys, tmp_path):
    import re

    schema = tmp_path / "schema.json"
    schema.write_text('{"type": "object", "properties": {"n": {"type": "integer"}}, '
                      '"required": ["n"], "additionalProperties": false}')
    base = ["generate", "--model", str(DEMO / "target"), "--draft-model", str(DEMO / "draft"),
            "--prompt", "To make bread", "--max-tokens", "24", "--json"]
    for extra, check in (
            (["--json-schema", str(schema), "--repetition-penalty", "1.2"],
             lambda t: list(json.loads(t)) == ["n"]),
            (["--regex", "[a-z]{2,5}( [a-z]{2,5})?", "--bad-words", "the", "--min-p", "0.1"],
             lambda t: re.fullmatch("[a-z]{2,5}( [a-z]{2,5})?", t)),
            (["--choice", "oak", "--choice", "river bank", "--frequency-penalty", "1",
              "--presence-penalty", "0.5", "--logit-bias", "90=-100"],
             lambda t: t in ("oak", "river bank"))):
        assert main(base + extra) == 0
        out = json.loads(capsys.readouterr().out)
        assert out["finish_reason"] == "stop" and check(out["text"]), (extra, out)
    assert main(base + ["--allowed-token-ids", "64,65,66", "--min-tokens", "24"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out["token_ids"]) <= {64, 65, 66} and len(out["token_ids"]) == 24
    assert main(base + ["--regex", "(a"]) == 2
    assert "does not compile" in capsys.readouterr().err
    assert main(base + ["--logit-bias", "9999=1"]) == 2
    assert "logit_bias" in capsys.readouterr().err


def test_errors_exit_2_with_a_message(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(DEMO / "target"), "--prompt-ids", "1",
                 "--speculative-dflash-block-size", "4"]) == 2
    assert "--draft-model" in capsys.readouterr().err
    assert main(["generate", "--model", str(DEMO / "target"), "--prompt-ids", "1",
                 "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err


@pytest.mark.ray
def test_generate_tp2_equals_tp1():
    """`generate --tp 2` (its own local Ray cluster) gives the in-process tokens. (`serve` in
    its own process, its hints, SIGTERM's drain: tests/test_docs.py, through `make serve`.)"""
    import os

    env = {**os.environ, "OMP_NUM_THREADS": "1", "RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", "--model", str(DEMO / "target"),
         "--draft-model", str(DEMO / "draft"), "--prompt-ids", "72,101,108,108,111",
         "--max-tokens", "12", "--ignore-eos", "--json", "--tp", "2"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    ref = LLMEngine(EngineConfig(model=str(DEMO / "target"))).generate(
        [[72, 101, 108, 108, 111]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert got["token_ids"] == ref.output_ids


def _broken_copy(tmp_path, name: str, src: Path, edit) -> Path:
    out = tmp_path / name
    shutil.copytree(src, out)
    edit(out)
    return out


def _set_config(field: str, value):
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.get("text_config", cfg)[field] = value
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _damage_weights(how: str):
    def edit(d: Path) -> None:
        for f in sorted(d.glob("*.safetensors")):
            data = f.read_bytes()
            f.write_bytes(data[: len(data) // 2] if how == "truncate" else bytes(len(data)))
    return edit


@pytest.mark.parametrize(("which", "edit", "says"), [
    ("target", lambda d: (d / "config.json").write_text("{not json"), "config.json"),
    ("target", _set_config("hidden_size", "abc"), "hidden_size"),
    ("target", _set_config("num_hidden_layers", -3), "num_hidden_layers"),
    ("target", _damage_weights("truncate"), ".safetensors"),
    ("target", _damage_weights("zero"), ".safetensors"),
    ("draft", _damage_weights("truncate"), ".safetensors"),
    ("draft", _damage_weights("zero"), ".safetensors"),
])
def test_broken_checkpoints_exit_2_naming_what_is_wrong(capsys, tmp_path, which, edit, says):
    target, draft = DEMO / "target", DEMO / "draft"
    if which == "target":
        target = _broken_copy(tmp_path, "target", target, edit)
    else:
        draft = _broken_copy(tmp_path, "draft", draft, edit)
    argv = ["generate", "--model", str(target), "--draft-model", str(draft), "--prompt-ids",
            "1,2,3", "--max-tokens", "4"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("dflash-serve: error: ") and says in err, err
    assert str(tmp_path) in err  # the file or directory at fault is named


def test_generate_refuses_what_cannot_fit_and_a_model_that_is_a_file(capsys, tmp_path):
    assert main(["generate", "--model", str(DEMO / "target"), "--prompt-ids", "1,2",
                 "--max-tokens", "100000"]) == 2
    assert "--max-tokens" in capsys.readouterr().err
    weights = next((DEMO / "target").glob("*.safetensors"))
    assert main(["generate", "--model", str(weights), "--prompt", "hi"]) == 2
    assert "is a file" in capsys.readouterr().err


def test_the_model_as_a_positional_argument_as_vllm_serve_takes_it(capsys):
    from deploy.cli import parse_args

    for command, rest in (("serve", ["--port", "9000"]), ("generate", ["--prompt", "hi"])):
        assert parse_args([command, "org/m", *rest]).model == "org/m"
        assert parse_args([command, *rest, "org/m"]).model == "org/m"
        assert parse_args([command, "--model", "org/m", *rest]).model == "org/m"
        assert parse_args([command, "org/m", "--model", "org/m", *rest]).model == "org/m"
        with pytest.raises(SystemExit):
            parse_args([command, "org/a", "--model", "org/b", *rest])
        assert "given twice" in capsys.readouterr().err
        with pytest.raises(SystemExit):
            parse_args([command, *rest])
        assert "the model is required" in capsys.readouterr().err


def test_the_printed_hints_work_as_pasted(monkeypatch):
    from deploy.cli import API_KEY_ENV, LOCAL_RAY_ENV, ready_hints

    base = "http://127.0.0.1:8000"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    monkeypatch.setenv(LOCAL_RAY_ENV, "0")  # the Ray `serve` starts: its CLI needs it too
    hints = ready_hints(base, "tiny-dflash", "from-env", "127.0.0.1:6379", "127.0.0.1:8265")
    assert f'-H "Authorization: Bearer ${API_KEY_ENV}"' in hints  # the key stays out
    assert '"model": "tiny-dflash"' in hints
    assert f"{LOCAL_RAY_ENV}=0 RAY_AUTH_MODE=token " in hints
    assert "list actors --address 127.0.0.1:6379" in hints
    assert "Ray dashboard: http://127.0.0.1:8265" in hints and "get-auth-token" in hints
    typed = ready_hints(base, "m", "typed key", "127.0.0.1:6379", None)
    assert "-H 'Authorization: Bearer typed key'" in typed  # --api-key: as the user typed it
    assert "list actors" not in typed and "(no dashboard)" in typed  # `ray list` needs one
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    monkeypatch.delenv(API_KEY_ENV)
    monkeypatch.delenv(LOCAL_RAY_ENV)
    plain = ready_hints(base, "m", None, "127.0.0.1:6379", "127.0.0.1:8265")
    assert "Authorization" not in plain and "RAY_AUTH_MODE" not in plain
    assert LOCAL_RAY_ENV not in plain  # joined to a cluster (--address)


def test_metrics_export_port_reaches_the_ray_serve_starts(monkeypatch):
    """`serve --metrics-export-port P` starts its Ray with the metrics export on P (where
    Prometheus scrapes every replica's series); with --address it is `ray start`'s job."""
    import ray

    from deploy import cli

    calls = []
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    args = cli.build_parser().parse_args(["serve", "--model", "m", "--metrics-export-port",
                                          "9123"])
    cli._init_ray(args.address, 1, args.metrics_export_port)
    assert calls[-1]["_metrics_export_port"] == 9123
    cli._init_ray(None, 1)
    assert "_metrics_export_port" not in calls[-1]
    with pytest.raises(ValueError, match="ray start"):
        cli._init_ray("auto", 1, 9123)


def test_drain_reports_a_driver_it_stopped_waiting_for(monkeypatch):
    """drain_engines calls every named driver's drain; one that never answers is reported as
    unanswered by the deadline, or, when a second signal cut the wait, as not waited for."""
    import threading

    import ray

    from deploy import ray_client

    class Method:
        def __init__(self, ref):
            self.ref = ref

        def remote(self, grace_s):
            return self.ref

    class Driver:
        def __init__(self, ref):
            self.drain = Method(ref)

    done, stuck = object(), object()
    actors = {"dflash-driver-a": Driver(done), "dflash-driver-b": Driver(stuck)}
    monkeypatch.setattr(ray.util, "list_named_actors", lambda all_namespaces: [
        {"name": n, "namespace": "x"} for n in [*actors, "other"]])
    monkeypatch.setattr(ray, "get_actor", lambda name, namespace: actors[name])
    monkeypatch.setattr(ray, "wait", lambda refs, num_returns, timeout: (
        [r for r in refs if r is done], [r for r in refs if r is stuck]))
    monkeypatch.setattr(ray, "get", lambda ref: {"in_flight": 1, "finished": 1, "stopped": 0})
    monkeypatch.setattr(ray_client, "DRAIN_MARGIN_S", 0.3)
    answered = {"driver": "dflash-driver-a", "in_flight": 1, "finished": 1, "stopped": 0}
    assert ray_client.drain_engines(0.0) == [
        answered, {"driver": "dflash-driver-b", "error": "no answer before the deadline"}]
    force = threading.Event()
    force.set()
    assert ray_client.drain_engines(30.0, force) == [
        {"driver": "dflash-driver-a", "error": "not waited for: a second signal"},
        {"driver": "dflash-driver-b", "error": "not waited for: a second signal"}]


@pytest.mark.parametrize("reuse_port", [False, True])
def test_a_port_in_use_is_refused_before_anything_starts(capsys, reuse_port):
    """A second server on a port that one listens on (Ray Serve's proxy listens with
    SO_REUSEPORT, which would let a second proxy share the port) exits 2 at once."""
    import socket

    with socket.socket() as s:
        if reuse_port:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        argv = ["serve", "--model", str(DEMO / "target"), "--device", "cpu", "--port", str(port)]
        assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"port {port} on 127.0.0.1 is in use" in err


def test_serve_routes_of_the_proxy_ask_for_the_key():
    """Ray Serve's proxy answers /-/routes and /-/healthz itself: the middleware its callback
    installs asks for the key there (any case of the scheme), and leaves the rest alone."""
    import asyncio

    from deploy.proxy_auth import CALLBACK_ENV, GuardProxyRoutes, key_digest, proxy_env

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guarded = GuardProxyRoutes(app, key_digest("s3cret"))

    def status(path: str, authorization: str | None = None) -> int:
        headers = [] if authorization is None else [(b"authorization", authorization.encode())]
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}

        asyncio.run(guarded({"type": "http", "path": path, "headers": headers}, receive, send))
        return sent[0]["status"]

    assert status("/-/routes") == 401 and status("/-/healthz", "Bearer wrong") == 401
    assert status("/-/routes", "Bearer s3cret") == 200
    assert status("/-/healthz", "bearer s3cret") == 200
    assert status("/v1/models") == 200  # the application checks its own routes
    assert proxy_env(None) == {} and proxy_env("k")[CALLBACK_ENV] == "deploy.proxy_auth:middlewares"


def test_processes_orphaned_below_a_subreaper_are_found_and_ended():
    """What `serve` does when its raylet dies: the processes orphaned below it (as Ray's are
    when the raylet goes) are re-parented to it, and end_descendants ends every one."""
    script = (
        "import os, subprocess, sys, time\n"
        "from deploy.process_tree import become_subreaper, descendants, end_descendants\n"
        "assert become_subreaper()\n"
        # a child that starts a grandchild and exits: the grandchild is orphaned
        "subprocess.run([sys.executable, '-c', 'import subprocess, sys; "
        "subprocess.Popen([sys.executable, \"-c\", \"import time; time.sleep(60)\"])'])\n"
        "time.sleep(0.5)\n"
        "orphans = descendants(os.getpid())\n"
        "ended = end_descendants(grace_s=2)\n"
        "print(len(orphans), sorted(ended) == sorted(orphans), descendants(os.getpid()))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["1", "True", "[]"]
