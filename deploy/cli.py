"""`dflash-serve` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

from configs.logs import setup_logging
from deploy.protocol import DEFAULT_MAX_REQUEST_BYTES, DEFAULT_SHUTDOWN_GRACE_S


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
    g.add_argument("--model", required=True, help="target checkpoint directory")
    g.add_argument("--draft-model",
                   help="DFlash draft checkpoint directory (omit for plain decoding)")
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
    g.add_argument("--tp", type=int, default=1,
                   help="tensor-parallel size; > 1 runs the target on Ray worker actors")
    g.add_argument("--address", help="Ray cluster to join (with --tp > 1); default: start one")

    s = sub.add_parser("serve", help="serve the OpenAI API with Ray Serve, until SIGINT/SIGTERM")
    s.add_argument("--model", required=True, help="target checkpoint directory")
    s.add_argument("--draft-model", "--speculative-draft-model",
                   "--speculative-draft-model-path", dest="draft_model",
                   help="DFlash draft checkpoint directory")
    s.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                   help="tensor-parallel size (GPUs per engine)")
    s.add_argument("--speculative-algorithm",
                   help="dflash (any case; implied by --draft-model)")
    s.add_argument("--speculative-dflash-block-size", type=int,
                   help="verify block size B (the anchor + B-1 proposed tokens); default: the "
                        "draft's")
    s.add_argument("--speculative-num-draft-tokens", type=int,
                   help="K, the tokens proposed per round: B = K+1 (vLLM's "
                        "num_speculative_tokens; SGLang's flag of this name counts B). "
                        "Refused if it contradicts the block size or exceeds the draft's")
    s.add_argument("--speculative-config", type=_json_object,
                   help='vLLM\'s form: \'{"method": "dflash", "model": DIR, '
                        '"num_speculative_tokens": K}\'')
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", choices=["cpu", "cuda"],
                   help="default: cuda when this machine has a GPU, else cpu")
    s.add_argument("--dtype", choices=["auto", "float32", "bfloat16"], default="auto",
                   help="auto: bfloat16 on cuda, float32 on cpu")
    s.add_argument("--seed", type=int, default=0,
                   help="seeds the sampling of requests that bring no seed")
    s.add_argument("--chat-template",
                   help="a Jinja chat template, or a file holding one, instead of the "
                        "tokenizer's")
    s.add_argument("--uvicorn-log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="log level of Ray Serve's HTTP proxy and replicas")
    s.add_argument("--served-model-name", help="the API's model id (default: the model dir name)")
    s.add_argument("--max-num-seqs", type=int, default=64)
    s.add_argument("--max-model-len", type=int)
    s.add_argument("--max-num-batched-tokens", type=int)
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of each GPU for weights, activations and the KV cache")
    s.add_argument("--enforce-eager", action="store_true",
                   help="GPU: run every step eagerly instead of replaying CUDA graphs")
    s.add_argument("--load-format", default="auto",
                   help="auto (the checkpoints) or dummy: random weights from the model dirs' "
                        "config.json (benchmarks); checked with the other engine settings")
    s.add_argument("--draft-placement", default="colocated",
                   help="colocated (the draft shares TP rank 0's GPU) or separate (a GPU of "
                        "its own; aux features over NCCL)")
    s.add_argument("--control-channel", default="auto",
                   help="what carries the per-step messages between the driver and its actors: "
                        "auto (shared memory when they share a node), shm or tcp")
    s.add_argument("--control-spin-us", type=int,
                   help="microseconds a process waiting on that channel spins before it sleeps "
                        "(default: 50000 on GPU hosts with 8+ cores, else 0)")
    s.add_argument("--attention-backend", default="auto",
                   help="the kernel of decode steps, verify rounds and draft blocks: triton (the "
                        "KV pages read in place), torch (pages gathered), or auto (triton on "
                        "CUDA, torch elsewhere)")
    s.add_argument("--max-waiting", type=int,
                   help="requests queued for admission before 429 (default 4 x max-num-seqs)")
    s.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_REQUEST_BYTES,
                   help="larger request bodies get 413 (default 16 MiB)")
    s.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                   help=f"require Authorization: Bearer <key> on every route but /health and "
                        f"/version (default: ${API_KEY_ENV}, else open)")
    s.add_argument("--allowed-origins", type=_json_list, default=["*"],
                   help='CORS origins, a JSON list (default ["*"])')
    s.add_argument("--allowed-methods", type=_json_list, default=["*"],
                   help='CORS methods, a JSON list (default ["*"])')
    s.add_argument("--allowed-headers", type=_json_list, default=["*"],
                   help='CORS headers, a JSON list (default ["*"])')
    s.add_argument("--allow-credentials", action="store_true", help="CORS credentials")
    s.add_argument("--generation-config", default="auto",
                   help="sampling defaults of requests that leave temperature/top_p/top_k "
                        "out: auto (the model's generation_config.json), vllm (OpenAI's: "
                        "temperature 1), or a directory holding a generation_config.json")
    s.add_argument("--shutdown-grace-s", type=float, default=DEFAULT_SHUTDOWN_GRACE_S,
                   help="on SIGTERM or Ctrl-C: seconds the requests in flight may run on "
                        "(new ones get 503); those still running then end with an error "
                        "event (default 30; a second signal stops at once)")
    s.add_argument("--num-replicas", type=int, default=1, help="engines (data parallel)")
    s.add_argument("--address", help="Ray cluster to join (e.g. auto); default: start one")
    return parser


def generate(args: argparse.Namespace) -> dict:
    from cluster.engine import LLMEngine
    from configs.engine import EngineConfig, SamplingParams
    from configs.model import TargetConfig
    from deploy.tokenizer import load_tokenizer

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos)
    cfg = EngineConfig(model=args.model, draft_model=args.draft_model, block_size=args.block_size,
                       device=args.device, dtype=args.dtype, max_num_seqs=1)
    target = TargetConfig.from_pretrained(args.model)  # a ValueError naming the file, first
    tokenizer = load_tokenizer(args.model)
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


def _init_ray(address: str | None, tp: int) -> None:
    import os

    import ray

    if address:
        ray.init(address=address)
    else:  # logical CPUs: each TP worker holds one, whatever the core count
        ray.init(num_cpus=max(os.cpu_count() or 1, tp), include_dashboard=False)


def serve_args(args: argparse.Namespace):
    """The `serve` flags as the app's ServeArgs (ValueError naming a bad one)."""
    import torch

    from deploy.app import ServeArgs

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    return ServeArgs(
        model=args.model, draft_model=args.draft_model, tp=args.tp,
        speculative_algorithm=args.speculative_algorithm,
        speculative_dflash_block_size=args.speculative_dflash_block_size,
        speculative_num_draft_tokens=args.speculative_num_draft_tokens, device=device,
        dtype=args.dtype, served_model_name=args.served_model_name,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        max_num_batched_tokens=args.max_num_batched_tokens, max_waiting=args.max_waiting,
        max_request_bytes=args.max_request_bytes, shutdown_grace_s=args.shutdown_grace_s,
        api_key=args.api_key, allowed_origins=args.allowed_origins,
        allowed_methods=args.allowed_methods, allowed_headers=args.allowed_headers,
        allow_credentials=args.allow_credentials, generation_config=args.generation_config,
        speculative_config=args.speculative_config, seed=args.seed,
        chat_template=args.chat_template,
        gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
        load_format=args.load_format, draft_placement=args.draft_placement,
        control_channel=args.control_channel, control_spin_us=args.control_spin_us,
        attention_backend=args.attention_backend)


def serve_forever(args: argparse.Namespace) -> int:
    import signal
    import threading

    from deploy.app import build_deployment

    sargs = serve_args(args)
    device = sargs.device
    app = build_deployment(sargs, num_replicas=args.num_replicas)  # ValueError: bad args

    import ray
    from ray import serve

    from deploy.ray_client import drain_engines

    _init_ray(args.address, args.tp)
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
              f"\"max_tokens\": 32}}'\nstop with Ctrl-C", flush=True)
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
