"""tools/bad_inputs.py against the OpenAI app in process (tiny demo pair): every request of its
catalogue is a 4xx with OpenAI's error JSON, none a 5xx, and the server serves afterwards."""

from __future__ import annotations

import pytest
from live_server import serve_in_thread

from cluster.engine import LLMEngine
from configs.engine import EngineConfig
from deploy.engine_client import LocalEngineClient
from deploy.openai_api import build_app
from deploy.tokenizer import load_tokenizer
from tools import bad_inputs


@pytest.fixture(scope="module")
def base_url(tiny_demo):
    target, draft = (str(p) for p in tiny_demo)
    engine = LLMEngine(EngineConfig(model=target, draft_model=draft, block_size=8,
                                    max_num_seqs=4, page_size=8))
    client = LocalEngineClient(engine, "tiny")
    url, stop = serve_in_thread(build_app(client, load_tokenizer(target)))
    yield url
    stop()
    client.close()


def test_every_bad_input_is_a_4xx_and_the_server_goes_on(base_url):
    report = bad_inputs.run(base_url)
    bad = [r for r in report["results"] if not r["ok"]]
    assert not bad, bad
    assert report["tried"] == len(report["results"]) >= 40 and report["answered_5xx"] == 0
    assert report["serving_after"]
    by_name = {r["name"]: r for r in report["results"]}
    assert by_name["20 MB body"]["status"] == 413
    assert by_name["unknown model"]["status"] == 404
