"""The `ray up` launcher configs pass Ray's own schema validation (no network, no cloud) and
hold what a fresh account or fresh hosts need: the pinned Ray image, the project installed with
the test constraints and the CUDA extra, a repository upload without the local venv, and the
weights downloaded on every GPU node, the ids deploy/dflash.yaml serves."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import ray
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

from configs.hub import ALLOW_PATTERNS

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = ROOT / "cluster"
NAMES = ["onprem.yaml", "aws-gpu.yaml"]


def load(name: str) -> dict:
    return yaml.safe_load((CLUSTER / name).read_text())


def pinned_ray() -> str:
    pins = dict(line.split("==") for line in (ROOT / "tools" / "constraints.txt").read_text()
                .splitlines() if "==" in line and not line.startswith("#"))
    return pins["ray"]


def gpu_node_setup(config: dict) -> tuple[list[str], list[str]]:
    """(the setup commands, the docker run options) of the nodes that hold GPUs: the workers
    on AWS (a CPU head), every node on-prem (the head serves too)."""
    docker = config["docker"]
    if config["provider"]["type"] == "local":
        return config["setup_commands"], docker["run_options"]
    return (config["setup_commands"] + config["worker_setup_commands"],
            docker.get("run_options", []) + docker["worker_run_options"])


def downloads(commands: list[str]) -> tuple[list[str], list[str]]:
    """The repo ids `hf download` fetches and its --include patterns."""
    (command,) = [c for c in commands if "hf download" in c]
    ids = re.search(r"for id in (.+?); do", command).group(1).split()
    words = shlex.split(command.split("hf download", 1)[1])
    patterns = [words[i + 1] for i, w in enumerate(words) if w == "--include"]
    return ids, patterns


@pytest.mark.parametrize("name", NAMES)
def test_launcher_config_validates(name):
    config = load(name)
    validate_config(prepare_config(config))  # what `ray up` does, minus the cloud calls
    if config["provider"]["type"] == "local":  # the local provider's bootstrap needs no cloud
        from ray.autoscaler._private.commands import _bootstrap_config

        _bootstrap_config(config, no_config_cache=True)
    # What serving relies on: GPUs declared to Ray on worker nodes.
    assert all("--num-gpus=" in c for c in config["worker_start_ray_commands"] if "start" in c)
    for node in config.get("available_node_types", {}).values():
        if node["max_workers"] > 0:
            assert node["resources"]["GPU"] > 0


@pytest.mark.parametrize("name", NAMES)
def test_a_fresh_node_gets_the_pinned_stack(name):
    """The image's Ray = tools/constraints.txt's = this venv's; the project installed from the
    uploaded tree with those constraints and the CUDA extra (fla), in a directory the
    container's user owns; the upload leaves the local venv, git and caches behind."""
    config = load(name)
    image = config["docker"]["image"]
    match = re.fullmatch(r"rayproject/ray:(\d+\.\d+\.\d+)-py3\d+-(gpu|cu\d+)", image)
    assert match, image
    assert match.group(1) == pinned_ray() == ray.__version__
    ((target, source),) = config["file_mounts"].items()
    assert (target, source) == ("~/dflash-serve", ".")
    (install,) = [c for c in config["setup_commands"] if "pip install" in c]
    words = shlex.split(install)
    assert words[:4] == ["python", "-m", "pip", "install"]
    assert words[words.index("-c") + 1] == "~/dflash-serve/tools/constraints.txt"
    assert words[words.index("-e") + 1] == "$HOME/dflash-serve[cuda]"
    assert {".venv", ".git", ".whl", "**/__pycache__"} <= set(config["rsync_exclude"])


@pytest.mark.parametrize("name", NAMES)
def test_every_gpu_node_downloads_the_served_models(name):
    """One `hf download` of the ids deploy/dflash.yaml serves, with the files the loaders read
    (configs/hub.py's list), into a Hugging Face cache on a host volume: HF_HOME is set in the
    container (so `ray start`, hence every replica, sees it) and mounted from the host."""
    config = load(name)
    commands, run_options = gpu_node_setup(config)
    ids, patterns = downloads(commands)
    serve = yaml.safe_load((ROOT / "deploy" / "dflash.yaml").read_text())
    args = serve["applications"][0]["args"]
    assert ids == [args["model"], args["draft_model"]]
    assert tuple(patterns) == ALLOW_PATTERNS
    (home,) = [o.split("=", 1)[1] for o in run_options if o.startswith("-e HF_HOME=")]
    assert any(o.startswith("-v ") and home.startswith(o.split(":")[1]) for o in run_options)
    assert "--gpus all" in run_options
    assert commands.index(next(c for c in commands if "pip install" in c)) < commands.index(
        next(c for c in commands if "hf download" in c))  # `hf` comes with the install


def test_the_aws_image_is_looked_up_not_made_up():
    """No placeholder AMI: every node type launches AWS's Deep Learning Base GPU AMI, which EC2
    resolves from AWS's public SSM parameter at launch."""
    for node in load("aws-gpu.yaml")["available_node_types"].values():
        image_id = node["node_config"]["ImageId"]
        assert image_id.startswith("resolve:ssm:/aws/service/deeplearning/ami/x86_64/"), image_id


def test_schema_rejects_a_broken_config():
    config = load("onprem.yaml")
    config["max_worker"] = 1  # a typo of max_workers: the schema allows no unknown keys
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        validate_config(prepare_config(config))
