"""The `ray up` launcher configs pass Ray's own schema validation (no network, no cloud)."""

from __future__ import annotations

from pathlib import Path

import jsonschema
import pytest
import yaml
from ray.autoscaler._private.util import prepare_config, validate_config

CLUSTER = Path(__file__).resolve().parents[2] / "cluster"


@pytest.mark.parametrize("name", ["onprem.yaml", "aws-gpu.yaml"])
def test_launcher_config_validates(name):
    config = yaml.safe_load((CLUSTER / name).read_text())
    validate_config(prepare_config(config))  # what `ray up` does, minus the cloud calls
    # What serving relies on: GPUs declared to Ray on worker nodes, the project installed.
    assert all("--num-gpus=" in c for c in config["worker_start_ray_commands"] if "start" in c)
    assert "/opt/dflash-serve" in config["file_mounts"]
    assert any("/opt/dflash-serve" in c for c in config["setup_commands"])
    for node in config.get("available_node_types", {}).values():
        if node["max_workers"] > 0:
            assert node["resources"]["GPU"] > 0


def test_schema_rejects_a_broken_config():
    config = yaml.safe_load((CLUSTER / "onprem.yaml").read_text())
    config["max_worker"] = 1  # a typo of max_workers: the schema allows no unknown keys
    with pytest.raises(jsonschema.ValidationError, match="max_worker"):
        validate_config(prepare_config(config))
