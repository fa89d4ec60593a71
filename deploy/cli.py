"""`dflash-serve` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from configs.logs import setup_logging


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"--prompt-ids must be comma-separated integers: {text!r}") from None


API_KEY_ENV = "DFLASH_SERVE_API_KEY"


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def _json_list(text: str) -> list[str]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f'expected a JSON list of strings such as '
                                         f'\'["http://localhost:3000"]\', got {text!r}')
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-serve")
    sub = parser.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate from one prompt, in process")
    g.add_argument("--model", required=True,
                   help="target checkpoint: a directory or a Hugging Face id (org/name)")
    g.add_argument("--draft-model", "--speculative-draft-model",
                   "--speculative-draft-model-path", dest="draft_model",
                   help="DFlash draft checkpoint: a directory or a Hugging Face id (omit for "
                        "plain decoding)")
    g.add_argument("--revision", help="the model's Hub revision when it is an id (default main)")
    g.add_argument("--draft-revision", "--speculative-draft-model-revision",
                   dest="draft_revision", help="the draft's Hub revision (default main)")
    g.add_argument("--speculative-dflash-block-size", type=int, dest="block_size",
                   help="verify block size B (proposes B-1 tokens); default: the draft's")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (tokenised with the target's tokenizer)")
    src.add_argument("--prompt-ids", type=_parse_ids, help="comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
    g.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel size; > 1 runs the target on Ray worker actors")
    g.add_argument("--address", help="Ray cluster to join (with --tp > 1); default: start one")

    s = sub.add_parser("serve", help="serve the OpenAI API with Ray Serve, until SIGINT/SIGTERM")
    add_serve_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of Ray Serve's HTTP proxy and replicas")
    s.add_argument("--num-replicas", type=int, default=1, help="engines (data parallel)")
    s.add_argument("--address", help="Ray cluster to join (e.g. auto); default: start one")
    s.add_argument("--metrics-export-port", type=int, default=None,
                   help="the Ray this command starts (no --address) exports every replica's "
                        "metrics on this port for Prometheus (ray start's flag of that name); "
                        "default: a random one")
    return parser


def generate(args: argparse.Namespace) -> dict:
    from cluster.engine import LLMEngine
    from configs.engine import EngineConfig, SamplingParams
    from configs.hub import resolve_model
    from configs.model import TargetConfig
    from deploy.tokenizer import load_tokenizer

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    if args.draft_revision and not args.draft_model:
        raise ValueError("--draft-revision needs --draft-model")
    model = resolve_model(args.model, "--model", args.revision)  # hub ids: the cache's copy
    draft = (resolve_model(args.draft_model, "--draft-model", args.draft_revision)
             if args.draft_model else None)
    cfg = EngineConfig(model=model, draft_model=draft, block_size=args.block_size,
                       device=args.device, dtype=args.dtype, max_num_seqs=1)
    target = TargetConfig.from_pretrained(model)  # a ValueError naming the file, first
    tokenizer = load_tokenizer(model)
    if args.prompt is not None:
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer; pass --prompt-ids instead")
        if args.chat:
            prompt_ids = tokenizer.apply_chat_template(
                [{"role": "user", "content": args.prompt}], add_generation_prompt=True,
                tokenize=True, return_dict=False)
        else:
            prompt_ids = tokenizer.encode(args.prompt, add_special_tokens=False)
    else:
        prompt_ids = args.prompt_ids
    if len(prompt_ids) + args.max_tokens > target.max_position_embeddings:
        raise ValueError(
            f"the context holds {target.max_position_embeddings} tokens; the prompt has "
            f"{len(prompt_ids)} and --max-tokens asks for {args.max_tokens} more; lower "
            f"--max-tokens")
    cluster = None
    if args.tp > 1 or args.address:
        import ray

        from cluster.ray_executor import RayEngineCluster

        _init_ray(args.address, args.tp)
        cluster = RayEngineCluster(cfg, args.tp)
        engine = cluster.engine
    else:
        engine = LLMEngine(cfg)
    try:
        start = time.perf_counter()
        out = engine.generate([list(prompt_ids)], params)[0]
        elapsed = time.perf_counter() - start
    finally:
        if cluster is not None:
            cluster.shutdown()
            ray.shutdown()
    text = tokenizer.decode(out.output_ids, skip_special_tokens=True) if tokenizer else None
    return {
        "token_ids": out.output_ids,
        "text": text,
        "finish_reason": out.finish_reason,
        "acceptance_lengths": out.acceptance_lengths,
        "num_rounds": len(out.acceptance_lengths),
        "mean_acceptance_length": (
            sum(out.acceptance_lengths) / len(out.acceptance_lengths)
            if out.acceptance_lengths else 0.0
        ),
        "elapsed_s": round(elapsed, 4),
    }


def _init_ray(address: str | None, tp: int, metrics_export_port: int | None = None) -> None:
    import os

    import ray

    if address:
        if metrics_export_port is not None:
            raise ValueError("--metrics-export-port sets up the Ray this command starts; with "
                             "--address pass it to `ray start` on each node instead")
        ray.init(address=address)
    else:  # logical CPUs: each TP worker holds one, whatever the core count
        extra = {} if metrics_export_port is None else {
            "_metrics_export_port": metrics_export_port}
        ray.init(num_cpus=max(os.cpu_count() or 1, tp), include_dashboard=False, **extra)


# Where the CLI's default differs from ServeArgs': resolved when the flags are read.
_CLI_DEFAULTS = {"device": None, "dtype": "auto"}
_CLI_CHOICES = {"device": ["cpu", "cuda"], "dtype": ["auto", "float32", "bfloat16"]}
_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float, "str": str,
          "str | None": str, "list[str]": None, "dict | None": None}


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServeArgs field (deploy/args.py): --field-name and its aliases, its help
    and default; lists and objects as JSON."""
    from dataclasses import MISSING, fields

    from deploy.args import ServeArgs

    for f in fields(ServeArgs):
        names = [f"--{f.name.replace('_', '-')}", *f.metadata.get("aliases", ())]
        kw: dict = {"dest": f.name, "help": f.metadata.get("help")}
        if f.metadata.get("required"):
            kw["required"] = True
        elif f.name in _CLI_DEFAULTS:
            kw["default"] = _CLI_DEFAULTS[f.name]
        elif f.name == "api_key":
            kw["default"] = os.environ.get(API_KEY_ENV) or None
        else:
            kw["default"] = f.default_factory() if f.default is MISSING else f.default
        if f.type == "bool":
            kw["action"] = "store_true"
        elif f.type == "list[str]":
            kw["type"] = _json_list
        elif f.type == "dict | None":
            kw["type"] = _json_object
        else:
            kw["type"] = _TYPES[f.type]
        if f.name in _CLI_CHOICES:
            kw["choices"] = _CLI_CHOICES[f.name]
        parser.add_argument(*names, **kw)


def serve_args(args: argparse.Namespace):
    """The `serve` flags as the app's ServeArgs (ValueError naming a bad one)."""
    from dataclasses import fields

    import torch

    from deploy.args import ServeArgs

    values = {f.name: getattr(args, f.name) for f in fields(ServeArgs)}
    if values["device"] is None:
        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return ServeArgs(**values)


def serve_forever(args: argparse.Namespace) -> int:
    import signal
    import threading

    from deploy.app import build_deployment

    sargs = serve_args(args)
    device = sargs.device
    if not args.address:  # the replicas run here: hub ids downloaded once, before Ray starts
        sargs.model_dirs()
    app = build_deployment(sargs, num_replicas=args.num_replicas)  # ValueError: bad args

    import ray
    from ray import serve

    from deploy.ray_client import drain_engines

    _init_ray(args.address, args.tp, args.metrics_export_port)
    stop, force = threading.Event(), threading.Event()

    def on_signal(*_) -> None:  # the first: drain; a second: stop now
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, on_signal)
    try:
        level = "DEBUG" if args.uvicorn_log_level == "trace" else args.uvicorn_log_level.upper()
        serve.start(http_options={"host": args.host, "port": args.port},
                    logging_config={"log_level": level})
        serve.run(app, name="dflash", route_prefix="/")
        base = f"http://{args.host}:{args.port}"
        auth = "-H \"Authorization: Bearer $" + API_KEY_ENV + "\" " if args.api_key else ""
        print(f"dflash-serve: serving {sargs.model_name!r} (tp {args.tp}, {device}) at {base}\n"
              f"try:\n  curl {base}/v1/completions -H 'Content-Type: application/json' "
              f"{auth}"
              f"-d '{{\"model\": \"{sargs.model_name}\", \"prompt\": \"The quick brown fox\", "
              f"\"max_tokens\": 32}}'\n"
              f"Ray cluster at {ray.get_runtime_context().gcs_address} (ray list actors "
              f"--address …)\nstop with Ctrl-C", flush=True)
        while not stop.wait(1.0):
            pass
        print(f"dflash-serve: shutting down: draining the requests in flight (up to "
              f"{args.shutdown_grace_s:g} s; a second Ctrl-C stops at once)", flush=True)
        drained = drain_engines(args.shutdown_grace_s, force)
        time.sleep(DRAIN_SETTLE_S)  # the streams' last bytes: replica → proxy → client
        print(f"dflash-serve: drained: {json.dumps(drained)}", flush=True)
    finally:
        with contextlib.suppress(Exception):
            serve.shutdown()
        ray.shutdown()
    return 0


# After the drain, how long the last chunks of the stopped streams get to pass through Serve's
# proxy before it is shut down.
DRAIN_SETTLE_S = 1.0


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            setup_logging()
            return serve_forever(args)
        if args.command == "generate":
            result = generate(args)
            if args.json:
                print(json.dumps(result))
            else:
                print(result["text"] if result["text"] is not None else result["token_ids"])
                print(f"[{len(result['token_ids'])} tokens, {result['num_rounds']} rounds, "
                      f"mean acceptance {result['mean_acceptance_length']:.2f}, "
                      f"{result['elapsed_s']:.2f} s]", file=sys.stderr)
    except ValueError as e:
        print(f"dflash-serve: error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
