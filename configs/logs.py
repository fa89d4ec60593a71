"""The project's own log lines (start-up reports: the KV pool, the attention kernels, the
warm-up; requests that fail alone; restarts) on stderr at INFO, in whatever process logs them
(the CLI, the driver actor: Ray forwards an actor's stderr to the console that started it).
DFLASH_LOG_LEVEL sets the level (e.g. WARNING)."""

from __future__ import annotations

import logging
import os

PACKAGES = ("cluster", "configs", "deploy", "draft", "target", "tools", "workers")


def setup_logging() -> None:
    level = os.environ.get("DFLASH_LOG_LEVEL", "INFO").upper()
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(levelname)s %(asctime)s %(name)s: %(message)s"))
    for name in PACKAGES:
        logger = logging.getLogger(name)
        if not logger.handlers:  # once per process
            logger.addHandler(handler)
            logger.setLevel(level)
            logger.propagate = False


def setup_logging_if_actor() -> None:
    """setup_logging in a Ray actor's process (the TP workers, the draft: their loading and
    start-up lines); nothing in process, where the caller owns logging."""
    import sys

    if "ray" not in sys.modules:
        return
    import ray

    if ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None:
        setup_logging()
