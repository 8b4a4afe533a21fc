"""Capturing what fastmesh's ops log about the path they take."""

import contextlib
import logging


@contextlib.contextmanager
def path_log():
    """Yields the list of messages logged to ``fastmesh.ops`` inside the block. The ops' once-per-path memory
    is cleared first, so each path is logged again."""
    from fastmesh.ops import _fused_common

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("fastmesh.ops")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    _fused_common._logged.clear()
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
