"""`dflash-serve` command line."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from collections.abc import Collection

from configs.logs import setup_logging


def _parse_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None


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
    add_serve_args(g, GENERATE_FIELDS)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--ignore-eos", action="store_true")
    _add_control_args(g)
    src = g.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="text prompt (tokenised with the target's tokenizer)")
    src.add_argument("--prompt-ids", type=_parse_ids, help="comma-separated token ids")
    g.add_argument("--chat", action="store_true", help="wrap --prompt in the chat template")
    g.add_argument("--json", action="store_true", help="print one JSON object")
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


def _add_control_args(g: argparse.ArgumentParser) -> None:
    """The sampling controls and structured outputs (docs/API.md has their semantics)."""
    c = g.add_argument_group("sampling controls (vLLM's semantics)")
    c.add_argument("--presence-penalty", type=float, default=0.0)
    c.add_argument("--frequency-penalty", type=float, default=0.0)
    c.add_argument("--repetition-penalty", type=float, default=1.0)
    c.add_argument("--min-p", type=float, default=0.0)
    c.add_argument("--min-tokens", type=int, default=0)
    c.add_argument("--logit-bias", type=_parse_bias, default=(), metavar="ID=BIAS[,…]",
                   help="added to those tokens' logits, e.g. 13=-100,42=2.5")
    c.add_argument("--bad-words", action="append", default=[], metavar="WORD",
                   help="never generate this word (repeatable)")
    c.add_argument("--allowed-token-ids", type=_parse_ids, metavar="ID[,…]",
                   help="only these tokens may be generated")
    s = g.add_argument_group("structured output (one of)").add_mutually_exclusive_group()
    s.add_argument("--json-schema", metavar="FILE", help="JSON that validates against the "
                   "schema in FILE")
    s.add_argument("--json-object", action="store_true", help="any JSON object")
    s.add_argument("--regex", help="text the regular expression matches")
    s.add_argument("--choice", action="append", metavar="TEXT",
                   help="exactly one of the choices (repeat the flag for each)")
    s.add_argument("--grammar", metavar="FILE", help="text of the EBNF grammar in FILE")


def _parse_bias(value: str) -> tuple[tuple[int, float], ...]:
    try:
        pairs = [item.split("=", 1) for item in value.split(",") if item]
        return tuple((int(t), float(b)) for t, b in pairs)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ID=BIAS[,ID=BIAS…], got {value!r}") \
            from None


def _grammar_arg(args: argparse.Namespace):
    import json
    from pathlib import Path

    from configs.engine import GrammarSpec

    def read(path: str, flag: str) -> str:
        try:
            return Path(path).read_text()
        except OSError as e:
            raise ValueError(f"{flag}: cannot read {path}: {e.strerror}") from None

    if args.json_schema:
        return GrammarSpec("json", read(args.json_schema, "--json-schema"))
    if args.json_object:
        return GrammarSpec("json_object", "")
    if args.regex is not None:
        return GrammarSpec("regex", args.regex)
    if args.choice:
        return GrammarSpec("choice", json.dumps(args.choice))
    if args.grammar:
        return GrammarSpec("grammar", read(args.grammar, "--grammar"))
    return None


def generate(args: argparse.Namespace) -> dict:
    from dataclasses import replace

    from cluster.engine import LLMEngine
    from cluster.startup import resolve_max_model_len
    from configs.engine import SamplingParams
    from configs.hub import resolve_model
    from configs.model import TargetConfig
    from deploy.tokenizer import load_tokenizer

    grammar = _grammar_arg(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed,
                            ignore_eos=args.ignore_eos, presence_penalty=args.presence_penalty,
                            frequency_penalty=args.frequency_penalty,
                            repetition_penalty=args.repetition_penalty, min_p=args.min_p,
                            min_tokens=args.min_tokens, logit_bias=args.logit_bias,
                            allowed_token_ids=args.allowed_token_ids, grammar=grammar)
    if args.draft_revision and not args.draft_model:
        raise ValueError("--draft-revision needs --draft-model")
    sargs = serve_args(args, GENERATE_FIELDS)
    model = resolve_model(args.model, "--model", args.revision)  # hub ids: the cache's copy
    draft = (resolve_model(args.draft_model, "--draft-model", args.draft_revision)
             if args.draft_model else None)
    # serve's engine settings (dtype from the device, the block size), for one sequence
    cfg = replace(sargs.engine_config((model, draft)), max_num_seqs=1)
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
    if args.bad_words or grammar is not None:
        if tokenizer is None:
            raise ValueError(f"{args.model} has no tokenizer for --bad-words or a structured "
                             f"output")
        from deploy.sampling_controls import bad_words_token_ids
        from workers.grammar import Grammars

        if grammar is not None:  # a grammar that does not compile: refused before the load
            Grammars(tokenizer, target.vocab_size).compile(grammar)
        params = replace(params, bad_words_token_ids=bad_words_token_ids(tokenizer,
                                                                         args.bad_words)
                         if args.bad_words else ())
    params.check_vocab(target.vocab_size)
    max_model_len = resolve_max_model_len(cfg, target)  # checked before the engine loads
    if len(prompt_ids) + args.max_tokens > max_model_len:
        raise ValueError(
            f"the context holds {max_model_len} tokens; the prompt has "
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


def _init_ray(address: str | None, tp: int, metrics_export_port: int | None = None,
              dashboard: bool = False):
    """ray.init's context. `dashboard`: the Ray started here runs its dashboard (`serve`: the
    state API of `ray list actors` is served by it too)."""
    import os

    import ray

    if address:
        if metrics_export_port is not None:
            raise ValueError("--metrics-export-port sets up the Ray this command starts; with "
                             "--address pass it to `ray start` on each node instead")
        return ray.init(address=address)
    # logical CPUs: each TP worker holds one, whatever the core count
    extra = {} if metrics_export_port is None else {"_metrics_export_port": metrics_export_port}
    return ray.init(num_cpus=max(os.cpu_count() or 1, tp), include_dashboard=dashboard, **extra)


def ready_hints(base: str, model_name: str, api_key: str | None, gcs_address: str,
                dashboard_url: str | None) -> str:
    """The lines `serve` prints once it serves, each command working as pasted: the API key as
    $DFLASH_SERVE_API_KEY where it came from there, else as typed on the command line; Ray's
    CLI with RAY_AUTH_MODE=token where Ray's token authentication is on (Ray 2.60's default for
    a Ray that ray.init starts; the CLI given --address does not turn it on by itself, and
    finds the token in ~/.ray/auth_token, RAY_AUTH_TOKEN_PATH or RAY_AUTH_TOKEN)."""
    import shlex
    import shutil

    auth = ""
    if api_key:
        from_env = os.environ.get(API_KEY_ENV) == api_key
        header = f"Authorization: Bearer {'$' + API_KEY_ENV if from_env else api_key}"
        auth = f'-H "{header}" ' if from_env else f"-H {shlex.quote(header)} "
    body = json.dumps({"model": model_name, "prompt": "The quick brown fox", "max_tokens": 32})
    lines = [f"try:\n  curl {base}/v1/completions -H 'Content-Type: application/json' {auth}"
             f"-d {shlex.quote(body)}"]
    if dashboard_url:  # `ray list` asks the dashboard's state API
        # this environment's ray, also when its bin directory is not on PATH (make serve)
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")
        if not os.path.exists(ray_cli) or shutil.which("ray") == ray_cli:
            ray_cli = "ray"
        token = os.environ.get("RAY_AUTH_MODE", "").lower() == "token"
        # a local-only Ray (local_only_ray) answers Ray's CLI only under the same switch: else
        # "Timed out while waiting for GCS to become available"
        env = f"{LOCAL_RAY_ENV}=0 " if os.environ.get(LOCAL_RAY_ENV) == "0" else ""
        env += "RAY_AUTH_MODE=token " if token else ""
        lines.append(f"Ray cluster at {gcs_address}; its actors:\n  "
                     f"{env}{shlex.quote(ray_cli)} list actors --address {gcs_address}")
        url = dashboard_url if "://" in dashboard_url else f"http://{dashboard_url}"
        lines.append(f"Ray dashboard: {url}"
                     + (f" (its token: {shlex.quote(ray_cli)} get-auth-token)" if token else ""))
    else:
        lines.append(f"Ray cluster at {gcs_address} (no dashboard)")
    return "\n".join(lines)


# Where the CLI's default differs from ServeArgs': resolved when the flags are read.
_CLI_DEFAULTS = {"device": None, "dtype": "auto"}
_CLI_CHOICES = {"device": ["cpu", "cuda"], "dtype": ["auto", "float32", "bfloat16"]}
_TYPES = {"int": int, "int | None": int, "float": float, "float | None": float, "str": str,
          "str | None": str, "list[str]": None, "dict | None": None}


# The ServeArgs fields `generate` takes too: the same flags, defaults and help as `serve`'s.
GENERATE_FIELDS = ("model", "draft_model", "revision", "draft_revision", "tp",
                   "speculative_dflash_block_size", "device", "dtype")


def add_serve_args(parser: argparse.ArgumentParser,
                   names: Collection[str] | None = None) -> None:
    """One flag per ServeArgs field (deploy/args.py), or per field in `names`: --field-name
    and its aliases, its help and default; lists and objects as JSON."""
    from dataclasses import MISSING, fields

    from deploy.args import ServeArgs

    for f in fields(ServeArgs):
        if names is not None and f.name not in names:
            continue
        flags = [f"--{f.name.replace('_', '-')}", *f.metadata.get("aliases", ())]
        kw: dict = {"dest": f.name, "help": f.metadata.get("help")}
        if f.name == "model":  # `serve MODEL`, as `vllm serve MODEL`, or --model MODEL
            parser.add_argument("model_tag", nargs="?", metavar="MODEL",
                                help="the model, as --model")
            kw["default"] = None
        elif f.name in _CLI_DEFAULTS:
            kw["default"] = _CLI_DEFAULTS[f.name]
        elif f.name == "api_key":
            kw["default"] = os.environ.get(API_KEY_ENV) or None
        else:
            kw["default"] = f.default_factory() if f.default is MISSING else f.default
        if f.type == "bool":  # on by default: --no-NAME turns it off, as vLLM's flags
            kw["action"] = argparse.BooleanOptionalAction if kw["default"] else "store_true"
        elif f.type == "list[str]":
            kw["type"] = _json_list
        elif f.type == "dict | None":
            kw["type"] = _json_object
        else:
            kw["type"] = _TYPES[f.type]
        if f.name in _CLI_CHOICES:
            kw["choices"] = _CLI_CHOICES[f.name]
        parser.add_argument(*flags, **kw)


def serve_args(args: argparse.Namespace, names: Collection[str] | None = None):
    """The `serve` flags (or those of the fields in `names`, the others at their defaults) as
    the app's ServeArgs (ValueError naming a bad one)."""
    from dataclasses import fields

    import torch

    from deploy.args import ServeArgs

    values = {f.name: getattr(args, f.name) for f in fields(ServeArgs)
              if names is None or f.name in names}
    if values["device"] is None:
        values["device"] = "cuda" if torch.cuda.is_available() else "cpu"
    return ServeArgs(**values)


def check_port_free(host: str, port: int) -> None:
    """ValueError if something listens on host:port already. Ray Serve's proxy binds with
    SO_REUSEPORT, so a second server on a port in use would start and split its requests with
    the first; a bind without it fails while any other socket listens there."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ValueError(f"--host {host!r} does not resolve: {e}") from None
    family, _, _, _, address = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # TIME_WAIT is no conflict
        try:
            s.bind(address)
        except OSError as e:
            raise ValueError(f"port {port} on {host} is in use ({e.strerror}): another server "
                             f"listens there; stop it or pick another --port") from None


class NodeWatch:
    """Whether the Ray node this command serves from is still there. With the Ray it started,
    its raylet and GCS processes are watched directly (a death is seen within a poll); joined
    to a cluster (--address), the GCS's view of this node is asked every `every_s`."""

    def __init__(self, started_here: bool, every_s: float = 5.0):
        import ray

        self.started_here, self.every_s = started_here, every_s
        self.node_id = ray.get_runtime_context().get_node_id()
        self._next = 0.0

    def lost(self) -> str | None:
        """Why the node is gone, or None while it is there."""
        import ray

        if self.started_here:
            from ray._private import ray_constants
            from ray._private.worker import _global_node as node

            vital = (ray_constants.PROCESS_TYPE_RAYLET, ray_constants.PROCESS_TYPE_GCS_SERVER)
            for kind, proc in node.dead_processes() if node is not None else ():
                if kind in vital:
                    return f"Ray's {kind} exited (code {proc.poll()})"
            return None
        if time.monotonic() < self._next:
            return None
        self._next = time.monotonic() + self.every_s
        try:
            alive = {n["NodeID"]: n["Alive"] for n in ray.nodes()}
        except Exception as e:  # the GCS itself is gone
            return f"the Ray cluster does not answer ({type(e).__name__}: {e})"
        if not alive.get(self.node_id, False):
            return f"the Ray cluster reports this node ({self.node_id[:12]}) dead"
        return None


# The Ray that `serve` starts itself serves this machine alone: with this variable at 0 its
# node address is 127.0.0.1, so everything it listens on (the dashboard, Ray's and the
# autoscaler's metrics exports, its gRPC ports, the TP rendezvous) is on loopback; only
# Serve's HTTP proxy listens where --host says. (Ray's variable of this name allows clusters
# on macOS and Windows; at 0 it makes a single-machine Ray anywhere.)
LOCAL_RAY_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _quiet_serve_reconnect():
    """serve.run says "Connecting to existing Serve app … New http_options/controller_options
    will not be applied" of the Serve that serve.start started just before with these very
    options: a line nobody can act on, left out."""
    import logging

    from ray.serve._private.constants import SERVE_LOGGER_NAME

    def keep(record: logging.LogRecord) -> bool:
        return "will not be applied" not in record.getMessage()

    logger = logging.getLogger(SERVE_LOGGER_NAME)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


def local_only_ray() -> None:
    """For the Ray this process is about to start, and the processes it starts."""
    os.environ[LOCAL_RAY_ENV] = "0"
    constants = sys.modules.get("ray._private.ray_constants")
    if constants is not None:  # imported already, so it read the variable before
        constants.ENABLE_RAY_CLUSTER = False


def serve_forever(args: argparse.Namespace) -> int:
    import signal
    import threading

    from deploy.process_tree import become_subreaper, end_descendants
    from deploy.proxy_auth import proxy_env

    sargs = serve_args(args)
    check_port_free(args.host, args.port)  # before anything slow: fail at once
    started_here = not args.address
    if started_here:
        local_only_ray()  # before Ray is imported

    from deploy.app import build_deployment, check_placement

    device = sargs.device
    if started_here:  # the replicas run here: hub ids downloaded once, before Ray starts
        sargs.model_dirs()
    app = build_deployment(sargs, num_replicas=args.num_replicas)  # ValueError: bad args

    import ray
    from ray import serve

    from deploy.ray_client import drain_engines

    if started_here:
        # Ray's processes orphaned by a dying raylet come back to this process, which ends
        # them; the proxies of the Ray started here ask for the API key on their own routes.
        become_subreaper()
        os.environ.update(proxy_env(sargs.api_key))
    context = _init_ray(args.address, args.tp, args.metrics_export_port, dashboard=True)
    try:  # the Ray started here gains no nodes; a joined cluster is asked
        check_placement(sargs, may_grow=False if started_here else None)
    except ValueError:
        ray.shutdown()
        raise
    stop, force = threading.Event(), threading.Event()

    def on_signal(*_) -> None:  # the first: drain; a second: stop now
        (force if stop.is_set() else stop).set()

    for sig in (signal.SIGINT, signal.SIGTERM):  # after ray.init, which installs its own
        signal.signal(sig, on_signal)
    lost = None
    try:
        level = "DEBUG" if args.uvicorn_log_level == "trace" else args.uvicorn_log_level.upper()
        serve.start(http_options={"host": args.host, "port": args.port},
                    logging_config={"log_level": level})
        with _quiet_serve_reconnect():
            serve.run(app, name="dflash", route_prefix="/")
        node = NodeWatch(started_here)
        base = f"http://{args.host}:{args.port}"
        hints = ready_hints(base, sargs.model_name, args.api_key,
                            ray.get_runtime_context().gcs_address, context.dashboard_url)
        print(f"dflash-serve: serving {sargs.model_name!r} (tp {args.tp}, {device}) at {base}\n"
              f"{hints}\nstop with Ctrl-C", flush=True)
        while not stop.wait(1.0):
            lost = node.lost()
            if lost is not None:
                break
        if lost is not None:
            print(f"dflash-serve: error: the Ray node this server runs on is gone: {lost}; "
                  f"stopping (no drain: the requests in flight are lost with it)",
                  file=sys.stderr, flush=True)
        else:
            print(f"dflash-serve: shutting down: draining the requests in flight (up to "
                  f"{args.shutdown_grace_s:g} s; a second Ctrl-C stops at once)", flush=True)
            drained = drain_engines(args.shutdown_grace_s, force)
            time.sleep(DRAIN_SETTLE_S)  # the streams' last bytes: replica → proxy → client
            print(f"dflash-serve: drained: {json.dumps(drained)}", flush=True)
    finally:
        if lost is None:
            with contextlib.suppress(Exception):
                if started_here:
                    # the app's replicas stop gracefully; Serve's own actors go with this Ray
                    # (serve.shutdown() would kill its controller from inside one of its
                    # tasks, which Ray reports as a failed task)
                    serve.delete("dflash")
                else:  # a cluster joined with --address: Serve shut down as it was started
                    serve.shutdown()
            ray.shutdown()
        elif started_here:  # Ray cannot stop what it lost: end it here, the port first
            end_descendants()
            threading.Thread(target=ray.shutdown, daemon=True).start()  # may hang: not waited
        if started_here:
            end_descendants()  # whatever outlived the shutdown
    return 1 if lost is not None else 0


# After the drain, how long the last chunks of the stopped streams get to pass through Serve's
# proxy before it is shut down.
DRAIN_SETTLE_S = 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the positional MODEL and --model made one `model`."""
    parser = build_parser()
    args = parser.parse_args(argv)
    tag = args.__dict__.pop("model_tag", None)
    if tag is not None and args.model is not None and tag != args.model:
        parser.error(f"the model is given twice, as {tag!r} and --model {args.model!r}: "
                     f"give one")
    args.model = tag or args.model
    if args.model is None:
        parser.error("the model is required: dflash-serve "
                     f"{args.command} MODEL (or --model MODEL)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
