"""Models by Hugging Face id, offline: a cache laid out as the Hub lays it (blobs, snapshots of
symlinks, refs) holding the tiny pair, HF_HUB_OFFLINE=1. Nothing here reaches the network: in
offline mode huggingface_hub refuses every request before it is sent."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from configs.hub import is_hub_id, resolve_model
from configs.model import TargetConfig

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "tests" / "assets" / "tiny"
TARGET_ID, DRAFT_ID = "tiny-org/tiny-target", "tiny-org/tiny-draft"
COMMIT = "a" * 40
COMMIT_V2 = "b" * 40


def add_snapshot(cache: Path, repo_id: str, src: Path, commit: str, refs: tuple[str, ...],
                 extra: dict[str, bytes] | None = None) -> Path:
    """`src`'s files as the Hub's cache stores a download of `repo_id` at `commit`: content in
    blobs/<hash>, snapshots/<commit>/<file> a relative symlink to it, refs/<branch> the commit
    (no newline, as huggingface_hub writes it)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    files = {f.name: f.read_bytes() for f in src.iterdir() if f.is_file()}
    for name, data in {**files, **(extra or {})}.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture
def hub_cache(tmp_path, monkeypatch) -> Path:
    """The tiny target at COMMIT (main) and COMMIT_V2 (branch v2, its generation_config.json
    changed), the draft at COMMIT (main); offline. huggingface_hub reads HF_HUB_CACHE and
    HF_HUB_OFFLINE when it is imported, so besides the environment (for child processes) the
    constants it consults at call time are patched."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    add_snapshot(cache, TARGET_ID, TINY / "target", COMMIT, ("main",))
    add_snapshot(cache, TARGET_ID, TINY / "target", COMMIT_V2, ("v2",),
                 extra={"generation_config.json": json.dumps({"temperature": 0.25}).encode()})
    add_snapshot(cache, DRAFT_ID, TINY / "draft", COMMIT, ("main",))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no local directory shadows the ids
    return cache


def snapshot_dir(cache: Path, repo_id: str, commit: str) -> str:
    return str(cache / f"models--{repo_id.replace('/', '--')}" / "snapshots" / commit)


def test_hub_ids_are_org_slash_name_and_not_paths():
    assert is_hub_id("Qwen/Qwen3.5-35B-A3B") and is_hub_id("z-lab/Qwen3.5-35B-A3B-DFlash")
    for path in ("/models/Qwen3.5-35B-A3B", "./org/name", "~/org", "tests/assets/tiny/target",
                 "target", "org/na me", "org/.."):
        assert not is_hub_id(path), path


def test_an_id_resolves_to_its_snapshot_by_default_commit_and_branch(hub_cache):
    main = snapshot_dir(hub_cache, TARGET_ID, COMMIT)
    assert resolve_model(TARGET_ID, "model") == main
    assert resolve_model(TARGET_ID, "model", revision=COMMIT) == main
    v2 = resolve_model(TARGET_ID, "model", revision="v2")
    assert v2 == snapshot_dir(hub_cache, TARGET_ID, COMMIT_V2)
    assert json.loads((Path(v2) / "generation_config.json").read_text())["temperature"] == 0.25
    # the snapshot is a checkpoint directory the loaders read through its symlinks
    assert TargetConfig.from_pretrained(main) == TargetConfig.from_pretrained(TINY / "target")
    # download=False finds what is cached and answers None for what is not
    assert resolve_model(TARGET_ID, "model", download=False) == main
    assert resolve_model("tiny-org/absent", "model", download=False) is None
    assert resolve_model("/no/such/dir", "model", download=False) is None


def test_a_missing_model_is_a_clear_error(hub_cache):
    with pytest.raises(ValueError, match=r"draft_model 'tiny-org/absent' \(revision 'main'\) "
                       r"is no local directory.*not in the cache .*hub.*HF_HUB_OFFLINE=1.*"
                       r"hf download tiny-org/absent"):
        resolve_model("tiny-org/absent", "draft_model")
    with pytest.raises(ValueError, match=r"revision 'v9'.*not in the cache.*--revision v9"):
        resolve_model(TARGET_ID, "model", revision="v9")
    with pytest.raises(ValueError, match=r"model /no/such/dir does not exist: no such directory"
                       r".*no Hugging Face model id"):
        resolve_model("/no/such/dir", "model")


def test_a_local_directory_wins_over_the_hub(hub_cache, tmp_path):
    local = tmp_path / "tiny-org" / "tiny-target"
    local.mkdir(parents=True)
    assert resolve_model(TARGET_ID, "model") == str(local.resolve())
    # relative paths: the working directory first, then `relative_to`
    assert resolve_model("tests/assets/tiny/draft", "d", relative_to=ROOT) == str(TINY / "draft")


def test_serve_args_take_ids_and_revisions(hub_cache):
    from deploy.app import ServeArgs, build_deployment, prepare_engine

    args = ServeArgs(model=TARGET_ID, draft_model=DRAFT_ID, device="cpu", revision="v2",
                     speculative_config={"revision": COMMIT})
    assert args.draft_revision == COMMIT  # vLLM's speculative_config key
    assert args.model_name == TARGET_ID  # the API's id is the Hub's, as vLLM's default
    cfg = args.engine_config()
    assert cfg.model == snapshot_dir(hub_cache, TARGET_ID, COMMIT_V2)
    assert cfg.draft_model == snapshot_dir(hub_cache, DRAFT_ID, COMMIT)
    cfg, defaults = prepare_engine(args)  # the replica's checks: they read the snapshot
    assert defaults.temperature == 0.25
    build_deployment(args)  # here, so checked in full without a download
    with pytest.raises(ValueError, match="draft_revision needs draft_model"):
        ServeArgs(model=TARGET_ID, draft_revision="main")


def test_the_builder_needs_only_the_args_where_the_models_are_not(hub_cache):
    """A head without the checkpoints builds the app from its args (no file read, nothing
    downloaded); the replica makes the file checks and fails with the error the builder gives
    where it has the files."""
    from deploy.app import ServeArgs, app_builder, build_deployment, prepare_engine

    elsewhere = ServeArgs(model="tiny-org/on-the-gpu-nodes", device="cpu", tp=3,
                          chat_template="/on/the/gpu/nodes.jinja")
    app = build_deployment(elsewhere)
    assert app._bound_deployment._replica_config.placement_group_bundles == [{"CPU": 1}] * 3
    with pytest.raises(ValueError, match="not in the cache"):
        prepare_engine(elsewhere)
    # what needs no files is still checked where the models are not
    with pytest.raises(ValueError, match="dtype"):
        app_builder({"model": "tiny-org/on-the-gpu-nodes", "dtype": "float16", "device": "cpu"})
    with pytest.raises(ValueError, match="not a valid Jinja"):
        build_deployment(ServeArgs(model="tiny-org/on-the-gpu-nodes", device="cpu",
                                   chat_template="{% for m in messages %}"))
    # the models in the cache: the builder checks their files (tp 3 splits no tiny head
    # count), and so does the replica, with the same error
    here = ServeArgs(model=TARGET_ID, device="cpu", tp=3)
    with pytest.raises(ValueError, match="tp") as built:
        build_deployment(here)
    with pytest.raises(ValueError, match="tp") as replica:
        prepare_engine(here)
    assert str(built.value) == str(replica.value)


def test_cli_generate_and_serve_take_ids(hub_cache, capsys, monkeypatch):
    from deploy import cli
    from deploy.cli import build_parser, main

    # serve's log handler would outlive capsys' stream, and later tests would log into it
    monkeypatch.setattr(cli, "setup_logging", lambda: None)

    args = ["generate", "--model", TARGET_ID, "--prompt-ids", "72,101,108", "--max-tokens", "6",
            "--ignore-eos", "--json"]
    assert main(args + ["--draft-model", DRAFT_ID, "--speculative-draft-model-revision",
                        COMMIT]) == 0
    by_id = json.loads(capsys.readouterr().out)
    args[2] = str(TINY / "target")
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["token_ids"] == by_id["token_ids"]
    # serve: an id that cannot be had fails before Ray starts, exit 2, naming what was tried
    assert main(["serve", "--model", "tiny-org/absent", "--device", "cpu"]) == 2
    assert "HF_HUB_OFFLINE=1" in capsys.readouterr().err
    parsed = build_parser().parse_args(["serve", "--model", TARGET_ID, "--revision", "v2",
                                        "--speculative-draft-model-revision", COMMIT])
    assert (parsed.revision, parsed.draft_revision) == ("v2", COMMIT)


def test_the_environment_alone_points_a_new_process_at_the_cache(hub_cache):
    """A fresh process (as a Serve replica or the CLI is) reads HF_HUB_CACHE and
    HF_HUB_OFFLINE from its environment: nothing patched."""
    env = {**os.environ, "HF_HUB_CACHE": str(hub_cache), "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "deploy.cli", "generate", "--model", TARGET_ID, "--draft-model",
         DRAFT_ID, "--prompt-ids", "1,2,3", "--max-tokens", "3", "--json"],
        capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(json.loads(proc.stdout)["token_ids"]) == 3

