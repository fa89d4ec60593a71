"""tools/gpu/ab_tree.sh: a commit's packages copied beside the working tree, then bench/engine.py
run in each tree in turn (tiny preset, CPU), each run importing its own tree's code."""

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_a_commit_runs_against_the_working_tree_in_turn(tmp_path):
    base, out = tmp_path / "base", tmp_path / "out"
    env = {**os.environ, "AB_BASE": str(base), "OUT": str(out), "ROUNDS": "1",
           "AB_TIMEOUT": "280", "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    prep = subprocess.run(["bash", "tools/gpu/ab_tree.sh", "prepare", "HEAD"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert prep.returncode == 0, prep.stderr
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True, check=True).stdout.strip()
    assert (base / "COMMIT").read_text().strip() == head
    assert (base / "target" / "model.py").is_file() and not (base / "tests").exists()
    # the base tree's bench marks its output, so the run shows which tree's code it imported
    marked = base / "bench" / "engine.py"
    main = 'if __name__ == "__main__":'
    marked.write_text(marked.read_text().replace(main, f'print("| from the base tree |")\n{main}'))
    run = subprocess.run(
        ["bash", "tools/gpu/ab_tree.sh", "run", "--", "--random-weights", "--preset", "tiny",
         "--device", "cpu", "--dtype", "float32", "--batch-sizes", "1", "--block-sizes", "4",
         "--prompt-len", "16", "--iters", "2", "--warmup", "1", "--no-baseline"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith(("base 1 ", "new 1 "))]
    assert rows[0] == "base 1 | from the base tree |", run.stdout
    assert [r.split()[0] for r in rows[1:]] == ["base", "new"], run.stdout
    assert "from the base tree" not in rows[-1]
    for tree in ("base", "new"):
        result = json.loads((out / f"ab_{tree}_1.json").read_text())
        assert result["ours"][0]["decode_ms"] > 0
