"""The in-process API server most of these tests share, one per module that asks for it: the
demo pair behind the OpenAI API (live_server.demo_api, serving DEMO_MODEL), and an `openai`
client on it. A module may define its own `server` or `oai` instead."""

from __future__ import annotations

import openai
import pytest
from live_server import demo_api


@pytest.fixture(scope="module")
def server():
    with demo_api() as s:
        yield s


@pytest.fixture(scope="session")
def long_server():
    """The demo pair with a 4,096-token context (Qwen3.5's tool-calling prompt alone is ~1,000
    of the demo tokenizer's tokens), shared by the tool-call, Responses and Messages tests."""
    with demo_api(max_model_len=4096) as s:
        yield s


@pytest.fixture(scope="module")
def oai(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server['url']}/v1", api_key="x", max_retries=0)
