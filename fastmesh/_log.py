"""Messages said once per process: which implementation runs, why a fused path was not taken."""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable

import torch

_said: set[Hashable] = set()


def log_once(logger: logging.Logger, level: int, key: Hashable, message: str, *args) -> bool:
    """Log ``message % args`` at ``level`` the first time ``key`` is seen in this process; True if it logged.
    Nothing while dynamo traces (it cannot trace a logger call: fullgraph would fail); the key stays unseen, so an
    eager call still says it."""
    if key in _said or torch.compiler.is_compiling():
        return False
    _said.add(key)
    logger.log(level, message, *args)
    return True


def forget(matches: Callable[[Hashable], bool]) -> None:
    """Let the keys ``matches`` accepts be logged again (a plan that was forgotten is decided, and said, anew)."""
    for key in [key for key in _said if matches(key)]:
        _said.discard(key)
