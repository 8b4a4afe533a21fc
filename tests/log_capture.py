"""Capturing what fastmesh logs: the plan each fused call runs, the paths a style did not take."""

import contextlib
import logging


@contextlib.contextmanager
def captured_log(name: str, level: int = logging.INFO):
    """Yields the list of messages logged to logger ``name`` at ``level`` or above inside the block."""
    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger(name)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)


@contextlib.contextmanager
def plan_log():
    """Yields the messages logged to ``fastmesh.plans`` inside the block. The planner's agreed decisions and
    its once-per-decision memory are cleared first, so each key is decided and logged again."""
    from fastmesh.ops import plans

    plans.forget()
    with captured_log("fastmesh.plans") as messages:
        yield messages
