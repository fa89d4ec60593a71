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
