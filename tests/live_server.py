"""Test support (on pytest's pythonpath): an ASGI app served by uvicorn on 127.0.0.1 in a
thread, the demo pair behind the OpenAI API that way, a Prometheus scrape of its /metrics, and
a wait until the engine is idle."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx2 as httpx
import uvicorn
from prometheus_client.parser import text_string_to_metric_families


def serve_in_thread(app) -> tuple[str, Callable[[], None]]:
    """Starts `app` on a free 127.0.0.1 port; returns its base URL and a stop function."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and thread.is_alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert srv.started, "uvicorn did not start"

    def stop() -> None:
        srv.should_exit = True
        thread.join(timeout=30)
        sock.close()

    return f"http://127.0.0.1:{sock.getsockname()[1]}", stop


DEMO = Path(__file__).resolve().parent / "assets" / "tiny"
DEMO_MODEL = "tiny-dflash"  # the id demo_api serves by default


@contextmanager
def demo_api(model_name: str = DEMO_MODEL, wrap: Callable | None = None,
             max_model_len: int | None = None) -> Iterator[dict]:
    """The demo target and its trained draft (B = 8) in process behind the OpenAI API, served
    by uvicorn, with a target-only engine as the reference. `wrap` wraps the ASGI app (a
    recorder); `max_model_len` past the demo's 1024 (Qwen3.5's tool prompt alone is ~1,000 of
    the demo's tokens). Yields url, client, tokenizer, reference, server (the OpenAIServer),
    app."""
    from cluster.engine import LLMEngine
    from configs.engine import EngineConfig
    from deploy.engine_client import LocalEngineClient
    from deploy.openai_api import build_app
    from deploy.tokenizer import load_tokenizer

    target, draft = str(DEMO / "target"), str(DEMO / "draft")
    long = {} if max_model_len is None else {"max_model_len": max_model_len,
                                             "allow_long_max_model_len": True}
    engine = LLMEngine(EngineConfig(model=target, draft_model=draft, block_size=8,
                                    max_num_seqs=16, page_size=8, **long))
    client = LocalEngineClient(engine, model_name)
    tokenizer = load_tokenizer(target)
    app = build_app(client, tokenizer)
    served = wrap(app) if wrap is not None else app
    url, stop = serve_in_thread(served)
    reference = LLMEngine(EngineConfig(model=target, max_num_seqs=16))
    try:
        yield {"url": url, "client": client, "tokenizer": tokenizer, "reference": reference,
               "server": app.state.server, "app": served}
    finally:
        stop()
        client.close()


# The tools the tool-call, Responses and Messages tests call (each API spells them its way):
# small enough that the demo model's constrained calls end well within their max_tokens.
WEATHER = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
           "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                          "days": {"type": "integer", "minimum": 1, "maximum": 7}}}
SEARCH = {"type": "object", "required": ["query"],
          "properties": {"query": {"type": "string", "maxLength": 10}}}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@contextmanager
def parsing(server: dict, **kw) -> Iterator[None]:
    """A demo_api server's reasoning and tool-call parsers (ChatParsing(**kw)) for the length
    of a block: the modules that need them share one server."""
    from deploy.tool_calls import ChatParsing

    api = server["server"]
    before, api.parsing = api.parsing, ChatParsing(**kw)
    try:
        yield
    finally:
        api.parsing = before


def scrape_metrics(base_url: str, timeout: float = 30,
                   model_name: bool = False) -> dict[tuple[str, tuple], float]:
    """/metrics as {(sample name, sorted label pairs): value}; the `model_name` label every
    series carries is left out of the keys unless `model_name` (one model per server)."""
    text = httpx.get(f"{base_url}/metrics", timeout=timeout).text
    return {(s.name, tuple(sorted((k, v) for k, v in s.labels.items()
                                  if model_name or k != "model_name"))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def wait_until_idle(base_url: str, timeout: float,
                    poll: float = 0.05) -> dict[tuple[str, tuple], float]:
    """Scrapes until no request runs or waits and the KV cache is empty; returns that scrape."""
    deadline = time.monotonic() + timeout
    idle = {("dflash_num_requests_running", ()), ("dflash_num_requests_waiting", ()),
            ("dflash_kv_cache_usage_ratio", ())}
    while True:
        m = scrape_metrics(base_url)
        if all(m[key] == 0 for key in idle):
            return m
        assert time.monotonic() < deadline, "the engine did not return to idle"
        time.sleep(poll)
