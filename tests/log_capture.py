"""Capturing what fastmesh's fused ops log about the plan each call runs."""

import contextlib
import logging


@contextlib.contextmanager
def plan_log():
    """Yields the list of messages logged to ``fastmesh.plans`` inside the block. The planner's agreed
    decisions and its once-per-decision memory are cleared first, so each key is decided and logged again."""
    from fastmesh.ops import plans

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("fastmesh.plans")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    plans.forget()
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
