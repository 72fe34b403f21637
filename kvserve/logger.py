"""The `kvserve` logger: INFO to stderr by default, as vLLM does, so start-up facts are seen."""

from __future__ import annotations

import logging
import os


def init_logger() -> logging.Logger:
    logger = logging.getLogger("kvserve")
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[kvserve] %(message)s"))
        logger.addHandler(handler)
        logger.setLevel(os.environ.get("KVSERVE_LOG_LEVEL", "INFO"))
        logger.propagate = False
    return logger


logger = init_logger()
