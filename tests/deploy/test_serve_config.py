"""The Serve configs validate against Ray Serve's own schema, their application args parse into
ServeArgs, and the demo config builds an application (nothing is deployed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from configs.engine import EngineConfig
from deploy.app import DFlashServer, ServeArgs, app_builder

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"


@pytest.mark.parametrize("name", ["dflash.yaml", "dflash-demo.yaml"])
def test_serve_config_validates(name):
    config = yaml.safe_load((DEPLOY / name).read_text())
    schema = ServeDeploySchema.model_validate(config)  # what `serve run/deploy` checks
    (app,) = schema.applications
    assert app.import_path == "deploy.app:app_builder"
    (dep,) = app.deployments
    assert dep.name == DFlashServer.name
    args = ServeArgs.from_dict(app.args)
    assert args.speculative_algorithm == "dflash" and args.draft_model
    assert args.block_size == args.speculative_dflash_block_size


def test_demo_config_builds_the_application():
    config = yaml.safe_load((DEPLOY / "dflash-demo.yaml").read_text())
    app = app_builder(config["applications"][0]["args"])
    bundles = app._bound_deployment._replica_config.placement_group_bundles
    assert bundles == [{"CPU": 1}] * 2  # one bundle per TP rank


def test_serve_args_errors_name_the_field(tiny_demo):
    target, draft = map(str, tiny_demo)
    with pytest.raises(ValueError, match="unknown application args.*'tp_size'"):
        ServeArgs.from_dict({"model": target, "tp_size": 2})
    with pytest.raises(ValueError, match="speculative_algorithm"):
        ServeArgs(model=target, draft_model=draft, speculative_algorithm="eagle")
    with pytest.raises(ValueError, match="needs draft_model"):
        ServeArgs(model=target, speculative_algorithm="dflash")
    with pytest.raises(ValueError, match="tp"):
        app_builder({"model": target, "tp": 3, "device": "cpu"})  # tiny heads split by 1/2/4
    # the block size overrides the number of draft tokens; K alone gives B = K + 1
    assert ServeArgs(model=target, speculative_dflash_block_size=8,
                     speculative_num_draft_tokens=3).block_size == 8
    assert ServeArgs(model=target, speculative_num_draft_tokens=3).block_size == 4


def test_memory_share_reaches_the_engine(tiny_demo):
    target, _ = map(str, tiny_demo)
    cfg = ServeArgs.from_dict({"model": target, "gpu_memory_utilization": 0.5}).engine_config()
    assert cfg.gpu_memory_utilization == 0.5


def test_load_format_reaches_the_engine_and_is_checked(tiny_demo):
    target, _ = map(str, tiny_demo)
    cfg = ServeArgs.from_dict({"model": target, "load_format": "dummy"}).engine_config()
    assert cfg.load_format == "dummy"
    with pytest.raises(ValueError, match="load_format"):
        ServeArgs.from_dict({"model": target, "load_format": "npz"}).engine_config()


def test_attention_backend_reaches_the_engine_and_resolves_per_device(tiny_demo, monkeypatch):
    from target.kernels import attention_triton

    target, _ = map(str, tiny_demo)
    cfg = ServeArgs.from_dict({"model": target, "attention_backend": "torch"}).engine_config()
    assert cfg.attention_backend == "torch" and cfg.attention_kernel("cuda") == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        ServeArgs.from_dict({"model": target, "attention_backend": "flash"}).engine_config()
    auto = ServeArgs.from_dict({"model": target}).engine_config()
    assert auto.attention_kernel("cpu") == "torch"  # never the interpreter by default
    assert auto.attention_kernel("cuda") == ("triton" if attention_triton.triton else "torch")
    # asked for explicitly where it cannot run: an error naming the field, not a fallback
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton'"):
        EngineConfig(model=target, device="cpu", attention_backend="triton")
