"""bench/serving.py end to end against the OpenAI app in process (uvicorn on 127.0.0.1 over a
LocalEngineClient: tiny demo target + trained draft, B = 8), so the load generator cannot rot
between GPU runs. Counts and structure only: no timing thresholds on this box."""

from __future__ import annotations

import csv
import json

import pytest
from live_server import serve_in_thread

from bench import serving
from cluster.engine import LLMEngine
from configs.engine import EngineConfig
from deploy.engine_client import LocalEngineClient
from deploy.openai_api import build_app
from deploy.tokenizer import load_tokenizer

MODEL = "tiny-dflash"


@pytest.fixture(scope="module")
def base_url(tiny_demo):
    target, draft = (str(p) for p in tiny_demo)
    engine = LLMEngine(EngineConfig(model=target, draft_model=draft, block_size=8,
                                    max_num_seqs=8, page_size=8))
    client = LocalEngineClient(engine, MODEL)
    app = build_app(client, load_tokenizer(target))
    url, stop = serve_in_thread(app)
    yield url
    stop()
    client.close()


def test_itl_splits_a_multi_token_chunk_evenly():
    r = serving.RequestResult()
    r.add_chunk(0.5, 1)  # TTFT
    r.add_chunk(0.9, 4)  # one speculative round: 4 tokens after 0.4 s
    r.add_chunk(1.0, 0)  # a chunk without tokens (role, held-back text) is no token
    r.add_chunk(1.1, 1)  # the gap runs from the last token, not the last chunk
    assert r.ttft_s == 0.5 and r.output_tokens == 6 and r.chunks == 3
    assert r.itl_s == pytest.approx([0.1] * 4 + [0.2])


def test_synthetic_run_reports_every_level(base_url, tmp_path):
    n, out_len = 6, 12
    report = serving.main(["--base-url", base_url, "--concurrency", "1", "4",
                           "--num-prompts", str(n), "--prompt-len", "24",
                           "--output-len", str(out_len), "--out-dir", str(tmp_path)])
    assert report["model"] == MODEL and report["command"].startswith("python -m bench.serving")
    for name in ("serving.csv", "serving.json", "serving.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    rows = list(csv.DictReader((tmp_path / "serving.csv").open()))
    assert [int(r["concurrency"]) for r in rows] == [1, 4]
    saved = json.loads((tmp_path / "serving.json").read_text())
    assert saved["command"] == report["command"] and len(saved["levels"]) == 2
    for level in saved["levels"]:
        s, spec = level["summary"], level["summary"]["spec"]
        assert (s["requests"], s["errors"], s["output_tokens"]) == (n, 0, n * out_len)
        assert s["ttft_ms_p50"] > 0 and s["itl_ms_p50"] > 0 and s["e2e_ms_p90"] > 0
        assert s["mean_prompt_tokens"] > 0 and s["output_throughput"] > 0
        # the deltas belong to this level: rounds commit every output token but the prefill's
        # first, plus what the last round of each request committed past max_tokens (< B)
        assert spec["acceptance_length"] >= 1
        assert n * (out_len - 1) <= spec["committed_tokens"] < n * (out_len - 1 + 8)
        assert spec["draft_ms_per_round"] > 0 and spec["verify_ms_per_round"] > 0
        assert spec["engine_round_ms"] >= spec["verify_ms_per_round"]
        assert spec["prefill_steps"] >= 1 and spec["prefill_step_ms"] > 0
        assert len(spec["position_acceptance_rate"]) == 7  # B = 8: 7 draft positions
        # a round commits its accepted prefix + 1, so the level's own per-position rates
        # (rebuilt from the cumulative gauges) must add up to its acceptance length
        rates = spec["level_position_acceptance_rate"]
        assert len(rates) == 7 and 1 >= rates[0] >= rates[-1] >= 0
        assert 1 + sum(rates) == pytest.approx(spec["acceptance_length"])
        for r in level["requests"]:
            assert r["error"] is None and r["output_tokens"] == out_len
            assert len(r["itl_s"]) == out_len - 1  # the prefill chunk carries one token


def test_failed_requests_are_counted_and_the_run_goes_on(base_url, tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text("\n".join(json.dumps(x) for x in [
        {"prompt": "Tell me a story.", "max_tokens": 6},
        {"prompt": "Too long an answer.", "max_tokens": 5000},  # past the 1024-token context
        {"prompt": "Name a colour."}]) + "\n")
    report = serving.main(["--base-url", f"{base_url}/v1", "--model", MODEL, "--chat",
                           "--dataset", str(data), "--concurrency", "2", "--num-prompts", "3",
                           "--output-len", "5", "--logprobs", "2", "--out-dir", str(tmp_path)])
    (level,) = report["levels"]
    assert (level["summary"]["errors"], level["summary"]["output_tokens"]) == (1, 11)
    (bad,) = [r for r in level["requests"] if r["error"]]
    assert "BadRequestError" in bad["error"] and "max_tokens" in bad["error"]


def test_long_prompts_reports_each_length_and_the_servers_error(base_url, tmp_path):
    """bench/long_prompts.py: token-id prompts of exact lengths, streamed; a prompt longer than
    the context comes back as the server's 400, and the run goes on."""
    from bench import long_prompts

    out = tmp_path / "long.json"
    long_prompts.main(["--base-url", base_url, "--lengths", "700", "5000", "300",
                       "--max-tokens", "5", "--vocab", "384", "--out", str(out)])
    ok, too_long, short = json.loads(out.read_text())["results"]
    assert ok["status"] == 200 and ok["tokens"] >= 1 and ok["ttft_s"] <= ok["total_s"]
    assert too_long["status"] == 400 and "context" in too_long["error"]
    assert short["status"] == 200 and short["error"] is None


def test_long_prompts_with_short_streams_beside_each(base_url, tmp_path):
    """--with-short: short streams run beside the long prompt until it ends; each is counted
    with its status, and the gaps between their chunks are reported."""
    from bench import long_prompts

    out = tmp_path / "mixed.json"
    long_prompts.main(["--base-url", base_url, "--lengths", "900", "--max-tokens", "40",
                       "--vocab", "384", "--with-short", "2", "--out", str(out)])
    (r,) = json.loads(out.read_text())["results"]
    assert r["status"] == 200 and r["error"] is None
    short = r["short"]
    assert short["requests"] >= 2 and short["ok"] == short["requests"] and not short["errors"]
    assert 0 < short["gap_median_ms"] <= short["gap_max_ms"]


def test_the_prefix_cache_workloads_report_cached_tokens(base_url, tmp_path):
    common = ["--base-url", base_url, "--output-len", "8", "--out-dir", str(tmp_path)]
    turns = serving.main([*common, "--workload", "multi-turn", "--history-len", "40",
                          "--turns", "3", "--turn-len", "10"])["multi-turn"]["turns"]
    assert [t["prompt_tokens"] for t in turns] == [50, 68, 86]  # + 10 new and 8 answered
    # a turn hits at the previous answer's last full page (pages of 8): 50 + 8 tokens sent
    # and answered by the first turn, 56; 68 + 8 by the second, 72
    assert [t["cached_tokens"] for t in turns] == [0, 56, 72]
    shared = serving.main([*common, "--workload", "shared-prefix", "--num-prompts", "5",
                           "--shared-len", "48", "--question-len", "6", "--concurrency",
                           "1", "--seed", "1"])["shared-prefix"]
    assert (shared["requests"], shared["errors"], shared["prompt_tokens"]) == (5, 0, 5 * 54)
    # the first request snapshots its prompt at its last page boundary before its last token
    # (48, inside its one chunk: the shared prompt); each later one starts there
    assert [r["cached_tokens"] for r in shared["per_request"]] == [0, 48, 48, 48, 48]
    saved = json.loads((tmp_path / "shared-prefix.json").read_text())
    assert saved["command"].startswith("python -m bench.serving") and saved["model"] == MODEL


def test_a_replaying_server_serves_the_chosen_acceptance(tiny_demo, tmp_path):
    """--record-first against a server started with --acceptance-replay: the recording pass
    gives the target's outputs, the level replays them with every draft accepted (B = 8):
    each request's 8 tokens after the first come in one round."""
    target, draft = (str(p) for p in tiny_demo)
    engine = LLMEngine(EngineConfig(model=target, draft_model=draft, block_size=8,
                                    max_num_seqs=4, page_size=8, acceptance_replay="8"))
    client = LocalEngineClient(engine, MODEL)
    url, stop = serve_in_thread(build_app(client, load_tokenizer(target)))
    try:
        report = serving.main(["--base-url", url, "--concurrency", "2", "--num-prompts", "4",
                               "--prompt-len", "20", "--output-len", "9", "--record-first",
                               "--out-dir", str(tmp_path)])
    finally:
        stop()
        client.close()
    (level,) = report["levels"]
    s, spec = level["summary"], level["summary"]["spec"]
    assert report["recording_pass_s"] > 0 and (s["requests"], s["errors"]) == (4, 0)
    assert (spec["spec_rounds"], spec["committed_tokens"], spec["acceptance_length"]) \
        == (4, 32, 8)
    assert all(r["chunks"] == 2 for r in level["requests"])  # the prefill's token, then 8
    assert s["decode_tok_s_per_user_p50"] > 0
