"""fastmesh's runtime settings: every ``FASTMESH_*`` variable a running process reads, in one place.

Each is read from the environment once, on first use, not on every call (a fused call must not pay for
``os.environ``); the C++ side reads its two (``FASTMESH_TRANSPORT``, ``FASTMESH_SHAPE_CHECK``) once too.
:func:`reload` reads them all again: call it after changing ``os.environ`` in a running process (tests do). A value
a setting does not take is an error naming the variable when the setting is used (``fastmesh info`` lists it).

The variables, their values and what they set: ``docs/building.md`` ("Environment variables"), which a test holds
to :data:`SETTINGS`. Build-time variables (``FASTMESH_BUILD_CUDA`` ...) are ``fastmesh/_build_config.py``'s,
test-time ones the tests'.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class Setting:
    name: str
    default: str
    choices: tuple[str, ...] = ()  # the values it takes (empty: any text, or an int with minimum)
    meaning: str = ""  # what it sets, for errors
    minimum: int | None = None  # an int setting's least value

    def parse(self, raw: str | None):
        """The value ``raw`` (None: unset) gives, or a ValueError naming the variable."""
        value = self.default if raw is None or not raw.strip() else raw.strip()
        if self.minimum is not None:
            try:
                number = int(value)
            except ValueError:
                number = None
            if number is None or number < self.minimum:
                return ValueError(f"{self.name} must be an int >= {self.minimum} ({self.meaning}), got {raw!r}")
            return number
        if self.choices and value.lower() not in self.choices:
            return ValueError(f"{self.name} must be one of {', '.join(self.choices)}, got {raw!r}")
        return value.lower() if self.choices else value


SETTINGS = {
    s.name: s
    for s in (
        Setting("FASTMESH_TUNE", "model", ("off", "model", "measure"), "how each fused call's plan is chosen"),
        Setting("FASTMESH_TUNE_CACHE", "", meaning="the file of measured plans"),
        Setting("FASTMESH_SHAPE_CHECK", "first", ("first", "every"), "when the fused ops compare shapes across ranks"),
        Setting("FASTMESH_TRANSPORT", "auto", ("auto", "collective", "p2p"), "how the fused ops move their pieces"),
        Setting("FASTMESH_FP8_CUDA_IMPL", "triton", ("triton", "cuda"), "which implementation the CUDA casts run"),
        Setting("FASTMESH_CUDA_CONSUMER_GEMM", "0", ("0", "1"), "the Triton consumer GEMM on CUDA"),
        Setting("FASTMESH_CONSUMER_FREE_SMS", "16", meaning="SMs kept free for the transfers", minimum=1),
        Setting("FASTMESH_JIT", "0", ("0", "1"), "build fastmesh._C on import"),
        Setting("FASTMESH_JIT_CACHE", "", meaning="where the JIT build goes"),
        Setting("FASTMESH_JIT_VERBOSE", "0", ("0", "1"), "the JIT build's compiler output"),
        Setting("FASTMESH_ALLOW_STALE", "0", ("0", "1"), "run a stale editable build"),
    )
}

_lock = threading.Lock()
_values: dict[str, object] | None = None  # name -> value, or the ValueError its raw value gives
_reloaders: list[Callable[[], None]] = []  # what else reads again when the settings are reloaded (the C++ side)


def _read() -> dict[str, object]:
    return {name: setting.parse(os.environ.get(name)) for name, setting in SETTINGS.items()}


def get(name: str):
    """The value of the setting ``name`` (read from the environment on first use); raises the ValueError naming the
    variable if its value is not one it takes."""
    global _values
    values = _values
    if values is None:
        with _lock:
            if _values is None:
                _values = _read()
            values = _values
    value = values[name]
    if isinstance(value, ValueError):
        raise ValueError(str(value))
    return value


def problems() -> list[str]:
    """Every setting whose value it does not take, as the error its use raises."""
    get("FASTMESH_TUNE")  # read once
    return [str(v) for v in _values.values() if isinstance(v, ValueError)]


def reload() -> None:
    """Reads every setting from the environment again, and runs what :func:`on_reload` registered: the C++ side
    reads its settings again and the fused ops plan their next calls anew (a plan depends on the settings)."""
    global _values
    with _lock:
        _values = _read()
    for reloader in _reloaders:
        reloader()


def on_reload(reloader: Callable[[], None]) -> None:
    """Runs ``reloader()`` after every :func:`reload` (the ops register the C++ side's)."""
    _reloaders.append(reloader)
