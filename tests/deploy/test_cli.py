from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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


def test_errors_exit_2_with_a_message(capsys, tmp_path):
    assert main(["generate", "--model", str(tmp_path / "nope"), "--prompt-ids", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["generate", "--model", str(DEMO / "target"), "--prompt-ids", "1",
                 "--speculative-dflash-block-size", "4"]) == 2
    assert "--draft-model" in capsys.readouterr().err
    assert main(["generate", "--model", str(DEMO / "target"), "--prompt-ids", "1",
                 "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
