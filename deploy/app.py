"""The Ray Serve application: `serve run deploy/dflash.yaml` (import path
`deploy.app:app_builder`, application args: `ServeArgs`, deploy/args.py) or
`dflash-serve serve …`.

One engine per replica: Serve places each replica with `placement_group_bundles` =
{GPU: 1, CPU: 1} × tp, STRICT_PACK (the replica itself needs no resources); the replica's
`RayEngineClient` starts the driver actor in that group, and the driver the TP workers and the
draft. More replicas = data parallel; Serve's autoscaler and Ray's cluster autoscaler see the
GPU bundles.

`model` and `draft_model` are directories or Hugging Face ids (configs/hub.py). The checkpoints
are resolved where they are loaded: in each replica, on its GPU node (a hub id downloaded once
into that node's cache). The application builder (`serve run`, often on a CPU head without
the checkpoints) checks what needs no files, and the files too where they are on its machine."""

from __future__ import annotations

import asyncio
import logging

from ray import serve
from ray.serve import Application

from cluster.capacity import check_capacity
from cluster.ray_executor import engine_bundles, separate_draft
from configs.engine import EngineConfig
from deploy.args import ServeArgs
from deploy.openai_api import build_app
from deploy.protocol import SamplingDefaults
from deploy.ray_client import DRAIN_MARGIN_S, RayEngineClient
from deploy.ray_metrics import RayMetricsExport
from deploy.tokenizer import chat_template_text, load_tokenizer, with_chat_template

log = logging.getLogger(__name__)


@serve.deployment(
    name="DFlashServer",
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=512,
    health_check_period_s=10,
    health_check_timeout_s=120,
    graceful_shutdown_timeout_s=30,
)
@serve.ingress()
class DFlashServer:
    async def __init__(self, args: ServeArgs):
        self.args = args
        # A download must not block the replica's event loop (Serve's control calls use it).
        cfg, self.defaults = await asyncio.to_thread(prepare_engine, args)
        self.client = await RayEngineClient.start(
            cfg, args.tp, args.model_name,
            max_waiting=args.max_waiting or 4 * args.max_num_seqs)
        self.tokenizer = with_chat_template(load_tokenizer(cfg.model), args.chat_template)
        log.info("sampling defaults (%s): temperature %g, top_p %g, top_k %d",
                 self.defaults.source, self.defaults.temperature, self.defaults.top_p,
                 self.defaults.top_k)

    def __serve_build_asgi_app__(self):
        app = build_app(self.client, self.tokenizer, shutdown_client=True,
                        max_request_bytes=self.args.max_request_bytes,
                        options=self.args.api_options(), defaults=self.defaults,
                        parsing=self.args.chat_parsing())
        # /metrics' series, also in Ray's metrics export: totals across replicas.
        self.ray_metrics = RayMetricsExport(app.state.metrics.registry, self.client.refresh)
        self.ray_metrics.start()
        return app

    async def check_health(self) -> None:
        # Only a dead engine fails the replica: a restart after a worker death is the
        # engine's own recovery (GET /health reports it as 503 meanwhile).
        await self.client.check_alive()


def prepare_engine(a: ServeArgs) -> tuple[EngineConfig, SamplingDefaults]:
    """In the replica, before its engine starts: the checkpoints on this node (a hub id
    downloaded into the node's cache once; later replicas find it there) and the file checks
    that `serve run` made only if it had the files, failing with the same errors."""
    cfg = a.engine_config()
    return cfg, a.check_files(cfg)


def app_builder(args: dict) -> Application:
    """Serve's application builder: `serve run deploy.app:app_builder model=…` or the YAML."""
    return build_deployment(ServeArgs.from_dict(dict(args)))


def check_placement(a: ServeArgs, cfg=None, may_grow: bool | None = None) -> list[dict]:
    """One engine's placement bundles, checked against the connected Ray cluster (a no-op
    before Ray is up): Ray would wait forever for a group that fits no node. `cfg`: the engine
    config where the caller has it; `may_grow` as check_capacity's."""
    if cfg is None:
        cfg = a.engine_config(a.model_dirs(download=False) or (a.model, a.draft_model))
    bundles = engine_bundles(a.tp, a.on_gpu, separate_draft(cfg))
    check_capacity(bundles, "STRICT_PACK", f"this application (tp {a.tp}, GPUs per engine: "
                   f"{sum(b.get('GPU', 0) for b in bundles):g})", may_grow)
    return bundles


def build_deployment(a: ServeArgs, num_replicas: int | None = None) -> Application:
    """The application from its args alone. Fails here, in `serve run`, rather than in replicas
    that Serve would restart: every check that needs no files always, and those that read the
    checkpoints where they are on this machine already (a local directory, or in the hub
    cache); nothing is downloaded. Without them (a CPU head) each replica checks the files."""
    dirs = a.model_dirs(download=False)
    cfg = a.engine_config(dirs or (a.model, a.draft_model))  # the names stand in for the dirs
    bundles = check_placement(a, cfg)  # before the files
    if dirs is not None:
        a.check_files(cfg)
    else:
        if a.chat_template is not None and "{" in a.chat_template:
            chat_template_text(a.chat_template)  # inline: it parses anywhere
        log.info("the checkpoints (%s) are not all on this machine: each replica resolves "
                 "them on its node and checks their files there",
                 ", ".join(filter(None, (a.model, a.draft_model))))
    options = {"num_replicas": num_replicas} if num_replicas is not None else {}
    # Serve waits this long for a replica's requests when it stops it (serve run's Ctrl-C, a
    # redeploy, a downscale): past the grace period, so a drain (drain_engines) ends first.
    options["graceful_shutdown_timeout_s"] = a.shutdown_grace_s + DRAIN_MARGIN_S
    return DFlashServer.options(
        placement_group_bundles=bundles, placement_group_strategy="STRICT_PACK", **options,
    ).bind(a)
