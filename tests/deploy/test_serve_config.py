"""The Serve configs validate against Ray Serve's own schema, their application args parse into
ServeArgs, and the demo config builds an application (nothing is deployed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from configs.engine import EngineConfig
from deploy.app import DFlashServer, ServeArgs, app_builder
from draft.config import DraftConfig

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
    # K alone gives B = K + 1; both must agree
    assert ServeArgs(model=target, speculative_dflash_block_size=4,
                     speculative_num_draft_tokens=3).block_size == 4
    assert ServeArgs(model=target, speculative_num_draft_tokens=3).block_size == 4
    # the parsers: known names; auto tool choice needs a tool parser (as vLLM)
    with pytest.raises(ValueError, match="reasoning_parser must be one of"):
        ServeArgs(model=target, reasoning_parser="deepseek_r9")
    with pytest.raises(ValueError, match="tool_call_parser must be one of"):
        ServeArgs(model=target, tool_call_parser="mistral")
    with pytest.raises(ValueError, match="enable_auto_tool_choice needs a tool_call_parser"):
        ServeArgs(model=target, enable_auto_tool_choice=True)
    parsing = ServeArgs(model=target, reasoning_parser="qwen3", enable_auto_tool_choice=True,
                        tool_call_parser="hermes").chat_parsing()
    assert (parsing.reasoning_parser, parsing.tool_call_parser) == ("qwen3", "hermes")


def test_memory_share_reaches_the_engine(tiny_demo):
    target, _ = map(str, tiny_demo)
    cfg = ServeArgs.from_dict({"model": target, "gpu_memory_utilization": 0.5}).engine_config()
    assert cfg.gpu_memory_utilization == 0.5


def test_prefix_caching_flags_reach_the_engine(tiny_demo):
    from deploy.cli import parse_args, serve_args

    target, _ = map(str, tiny_demo)
    assert ServeArgs(model=target).engine_config().enable_prefix_caching  # on by default
    for flags, on in (([], True), (["--enable-prefix-caching"], True),
                      (["--no-enable-prefix-caching"], False)):
        args = serve_args(parse_args(["serve", target, "--device", "cpu", *flags]))
        assert args.engine_config().enable_prefix_caching is on
    cfg = ServeArgs.from_dict({"model": target, "prefix_cache_state_gb": 0.5}).engine_config()
    assert cfg.prefix_cache_state_gb == 0.5
    with pytest.raises(ValueError, match="prefix_cache_state_gb"):
        ServeArgs.from_dict({"model": target, "prefix_cache_state_gb": -1}).engine_config()


def test_speculation_flags_reach_the_engine(tiny_demo, tmp_path, monkeypatch):
    """--speculative-adaptive and --acceptance-replay (a length, or a file made absolute: the
    draft's actor reads it from another working directory); a replay without a draft is
    refused."""
    from deploy.cli import parse_args, serve_args

    target, draft = map(str, tiny_demo)
    cfg = serve_args(parse_args(["serve", target, "--draft-model", draft, "--device", "cpu",
                                 "--speculative-adaptive", "--acceptance-replay", "6.3"])
                     ).engine_config()
    assert cfg.speculative_adaptive and cfg.acceptance_replay == "6.3"
    assert not ServeArgs(model=target, draft_model=draft).engine_config().speculative_adaptive
    (tmp_path / "curve.json").write_text("[0.9, 0.8]")
    monkeypatch.chdir(tmp_path)
    cfg = ServeArgs(model=target, draft_model=draft,
                    acceptance_replay="curve.json").engine_config()
    assert cfg.acceptance_replay == str((tmp_path / "curve.json").resolve())
    with pytest.raises(ValueError, match="acceptance_replay needs --draft-model"):
        ServeArgs(model=target, acceptance_replay="6.3").engine_config()


def test_load_format_reaches_the_engine_and_is_checked(tiny_demo):
    target, _ = map(str, tiny_demo)
    cfg = ServeArgs.from_dict({"model": target, "load_format": "dummy"}).engine_config()
    assert cfg.load_format == "dummy"
    with pytest.raises(ValueError, match="load_format"):
        ServeArgs.from_dict({"model": target, "load_format": "npz"}).engine_config()


def test_kernel_backends_reach_the_engine_and_resolve_per_device(tiny_demo, monkeypatch):
    from cluster.startup import EnginePlan
    from target.kernels import attention_triton, selection

    target, _ = map(str, tiny_demo)
    cfg = ServeArgs.from_dict({"model": target, "attention_backend": "torch",
                               "moe_backend": "grouped"}).engine_config()
    assert cfg.kernels.attention == "torch"
    assert selection.attention_kernel(cfg.kernels, "cuda") == "torch"
    assert cfg.kernels.moe == "grouped"
    for field, bad in (("attention_backend", "flash"), ("moe_backend", "cutlass")):
        with pytest.raises(ValueError, match=field):
            ServeArgs.from_dict({"model": target, field: bad}).engine_config()
    auto = ServeArgs.from_dict({"model": target}).engine_config().kernels
    assert selection.attention_kernel(auto, "cpu") == "torch"  # never the interpreter by default
    assert selection.attention_kernel(auto, "cuda") == ("triton" if attention_triton.triton
                                                        else "torch")
    assert auto.moe == "auto"
    # asked for explicitly where it cannot run: an error naming the field, not a fallback, in
    # `serve run` (the args) and wherever an engine starts (its plan, before loading)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match="attention_backend 'triton'"):
        ServeArgs.from_dict({"model": target, "device": "cpu",
                             "attention_backend": "triton"}).engine_config()
    with pytest.raises(ValueError, match="attention_backend 'triton'"):
        EnginePlan.from_config(EngineConfig(model=target, device="cpu",
                                            attention_backend="triton"))
    # the other choices, as one setting
    cfg = ServeArgs.from_dict({"model": target,
                               "kernel_overrides": "pdl=off"}).engine_config()
    assert cfg.kernel_overrides == "pdl=off" and cfg.kernels.pdl == "off"
    with pytest.raises(ValueError, match="kernel_overrides"):
        ServeArgs.from_dict({"model": target, "kernel_overrides": "gpu=fast"}).engine_config()


def test_the_speculative_flags_of_vllm_sglang_and_lmdeploy(tiny_demo):
    """--speculative-algorithm in any case, --speculative-config (vLLM), K = B − 1 with both
    given only if they agree, and a K one too many for the draft refused with the reason."""
    from deploy.cli import build_parser

    target, draft = map(str, tiny_demo)
    a = ServeArgs(model=target, draft_model=draft, speculative_algorithm="DFLASH")
    assert a.engine_config().draft_model is not None
    v = ServeArgs(model=target, speculative_config={"method": "dflash", "model": draft,
                                                    "num_speculative_tokens": 3})
    assert (v.draft_model, v.block_size) == (draft, 4)
    with pytest.raises(ValueError, match="speculative_config.model"):
        ServeArgs(model=target, draft_model=target, speculative_config={"model": draft})
    with pytest.raises(ValueError, match="unsupported keys"):
        ServeArgs(model=target, speculative_config={"method": "eagle", "draft_tp": 1})
    with pytest.raises(ValueError, match="contradicts speculative_dflash_block_size"):
        ServeArgs(model=target, draft_model=draft, speculative_num_draft_tokens=16,
                  speculative_dflash_block_size=16)
    trained = DraftConfig.from_pretrained(draft).block_size
    ServeArgs(model=target, draft_model=draft,
              speculative_num_draft_tokens=trained - 1).check_draft_block()
    with pytest.raises(ValueError, match=f"trained for blocks of {trained}.*SGLang"):
        ServeArgs(model=target, draft_model=draft,
                  speculative_num_draft_tokens=trained).check_draft_block()
    assert ServeArgs(model=target, dtype="auto", device="cpu").engine_config().dtype == "float32"

    args = build_parser().parse_args([
        "serve", "--model", target, "-tp", "2", "--speculative-draft-model", draft,
        "--speculative-config", '{"num_speculative_tokens": 3}', "--seed", "7"])
    assert (args.tp, args.draft_model, args.speculative_config, args.seed) == (
        2, draft, {"num_speculative_tokens": 3}, 7)
    assert build_parser().parse_args(["serve", "--model", target, "--tensor-parallel-size",
                                      "4", "--speculative-draft-model-path", draft]).tp == 4
    gen = build_parser().parse_args(["generate", "--model", target, "-tp", "2",
                                     "--speculative-draft-model", draft, "--prompt-ids", "1"])
    assert (gen.tp, gen.draft_model) == (2, draft)


def test_chat_template_from_a_file_or_inline(tmp_path):
    from deploy.tokenizer import chat_template_text, load_tokenizer, with_chat_template

    inline = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"
    (tmp_path / "t.jinja").write_text(inline)
    assert chat_template_text(str(tmp_path / "t.jinja")) == inline == chat_template_text(inline)
    with pytest.raises(ValueError, match="not a valid Jinja"):
        chat_template_text("{% for m in messages %}")
    tok = with_chat_template(load_tokenizer(str(Path(__file__).parents[1] / "assets/tiny/target")),
                             str(tmp_path / "t.jinja"))
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "[hi]"


def test_one_field_list_for_the_yaml_the_cli_and_the_engine(tiny_demo):
    """Every engine setting is an app arg (block_size is derived from the speculative ones);
    every app arg is a CLI flag with its help, and the flags come back as the same args."""
    from dataclasses import fields

    from deploy.cli import build_parser, serve_args

    app_args = {f.name for f in fields(ServeArgs)}
    assert {f.name for f in fields(EngineConfig)} - app_args == {"block_size"}
    assert all(f.metadata.get("help") for f in fields(ServeArgs))
    target, _ = map(str, tiny_demo)
    parsed = build_parser().parse_args(["serve", "--model", target, "--page-size", "8",
                                        "--max-num-seqs", "3", "--device", "cpu"])
    assert {n for n in vars(parsed)} >= app_args
    got = serve_args(parsed)
    assert got == ServeArgs(model=target, page_size=8, max_num_seqs=3, device="cpu")
    cfg = got.engine_config()
    assert (cfg.page_size, cfg.max_num_seqs, cfg.dtype) == (8, 3, "float32")


def test_page_size_keeps_its_other_spellings(tiny_demo):
    """The KV page: vLLM's --block-size and the old --kv-block-size / YAML kv_block_size (the
    DFlash block keeps its own flag, --speculative-dflash-block-size)."""
    from deploy.cli import build_parser, serve_args

    target, _ = map(str, tiny_demo)
    for flag in ("--block-size", "--kv-block-size"):
        parsed = build_parser().parse_args(["serve", "--model", target, flag, "8",
                                            "--num-kv-blocks", "40", "--device", "cpu"])
        got = serve_args(parsed)
        assert (got.page_size, got.num_pages, got.block_size) == (8, 40, None)
    old = ServeArgs.from_dict({"model": target, "kv_block_size": 8, "num_kv_blocks": 40})
    assert old == ServeArgs(model=target, page_size=8, num_pages=40)
    with pytest.raises(ValueError, match="kv_block_size is the old name of page_size"):
        ServeArgs.from_dict({"model": target, "kv_block_size": 8, "page_size": 8})


def test_serve_run_key_value_args_are_strings_parsed_by_the_fields_type(tiny_demo):
    # `serve run deploy.app:app_builder model=… tp=2 …` hands every value over as a string
    target, draft = map(str, tiny_demo)
    app = app_builder({"model": target, "draft_model": draft, "device": "cpu", "tp": "2",
                       "gpu_memory_utilization": "0.5", "enforce_eager": "yes",
                       "max_model_len": "none", "allowed_origins": '["http://a"]',
                       "speculative_config": '{"num_speculative_tokens": 3}'})
    a = app._bound_deployment.init_args[0]
    assert (a.tp, a.gpu_memory_utilization, a.enforce_eager, a.max_model_len) == (
        2, 0.5, True, None)
    assert a.allowed_origins == ["http://a"] and a.speculative_num_draft_tokens == 3
    assert ServeArgs.from_dict({"model": target, "allow_credentials": "0"}).allow_credentials \
        is False
    for key, value, expected in [("tp", "two", "tp must be an integer"),
                                 ("enforce_eager", "maybe", "enforce_eager must be a boolean"),
                                 ("allowed_origins", "*", "allowed_origins must be a JSON list"),
                                 ("tp", "none", "tp must be an integer, got 'none'")]:
        with pytest.raises(ValueError, match=expected):
            app_builder({"model": target, "device": "cpu", key: value})


def test_max_model_len_above_the_models_context_is_refused_unless_allowed(tiny_demo,
                                                                        monkeypatch):
    target, _ = map(str, tiny_demo)  # max_position_embeddings 1024
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    app_builder({"model": target, "device": "cpu", "max_model_len": 1024})
    with pytest.raises(ValueError, match="max_position_embeddings 1024.*"
                                         "--allow-long-max-model-len"):
        app_builder({"model": target, "device": "cpu", "max_model_len": "2048"})
    app_builder({"model": target, "device": "cpu", "max_model_len": 2048,
                 "allow_long_max_model_len": "true"})
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    app_builder({"model": target, "device": "cpu", "max_model_len": 2048})


def test_one_demo_name_and_the_documented_port_override(tmp_path):
    """`make serve` and deploy/dflash-demo.yaml serve the demo pair under one name; the copy
    DEPLOYMENT.md gives for another port is what Serve's schema reads as that port."""
    import subprocess

    repo = DEPLOY.parent
    demo = yaml.safe_load((DEPLOY / "dflash-demo.yaml").read_text())
    assert demo["applications"][0]["args"]["served_model_name"] == "tiny-dflash"
    make = subprocess.run(["make", "-n", "serve"], cwd=repo, capture_output=True, text=True,
                          check=True).stdout
    assert "--served-model-name tiny-dflash" in make
    other = subprocess.run(["make", "-n", "serve", "MODEL=org/m"], cwd=repo,
                           capture_output=True, text=True, check=True).stdout
    assert "--served-model-name" not in other
    copy = tmp_path / "dflash-demo.yaml"
    subprocess.run(f"sed 's/port: 8000/port: 9000/' deploy/dflash-demo.yaml > {copy}",
                   shell=True, cwd=repo, check=True)
    moved = ServeDeploySchema.model_validate(yaml.safe_load(copy.read_text()))
    assert ServeDeploySchema.model_validate(demo).http_options.port == 8000
    assert moved.http_options.port == 9000
    assert moved.applications[0].args == demo["applications"][0]["args"]
