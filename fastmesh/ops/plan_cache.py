"""The file where measured plans are kept: one JSON file, sections per machine and versions, entries per call key.

Location: ``FASTMESH_TUNE_CACHE`` (a file path), else ``$XDG_CACHE_HOME/fastmesh/plans.json`` (``~/.cache``
without it). Several ranks and processes may read and write it at once: a writer takes an exclusive
``flock`` on ``<file>.lock``, merges its entries into what the file holds then, and replaces the file
atomically (``os.replace``), so readers never see half a file and no writer's entries are lost. A file that
cannot be read or parsed is ignored with a warning (and rewritten by the next store).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import platform
import tempfile
import warnings

import torch

from fastmesh import settings
from fastmesh.version import __version__

ENV_PATH = "FASTMESH_TUNE_CACHE"
FORMAT = 1


def default_path() -> str:
    given = settings.get(ENV_PATH)
    if given:
        return given
    root = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(root, "fastmesh", "plans.json")


def _cpu_model() -> str:
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine() -> dict:
    """What a measured plan depends on besides its key: the hardware and the versions."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "arch": platform.machine(),
        "torch": torch.__version__,
        "fastmesh": __version__,
    }


def fingerprint(about: dict | None = None) -> str:
    """The section of the cache this machine and these versions use: a change of either starts a new one."""
    text = json.dumps(about or machine(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class PlanCache:
    """Entries (dicts) by call key, for one machine fingerprint, in the file at ``path``."""

    def __init__(self, path: str | None = None, section: str | None = None):
        self.path = path or default_path()
        self.section = section or fingerprint()
        self._loaded_stamp = None
        self._entries: dict = {}
        self._write_failed = False

    def _read(self) -> dict:
        """The whole file as a dict; empty when missing, and when unreadable (with a warning)."""
        try:
            with open(self.path) as f:
                data = json.load(f)
            if not isinstance(data, dict) or data.get("format") != FORMAT or not isinstance(data.get("machines"), dict):
                raise ValueError(f"not a fastmesh plan cache of format {FORMAT}")
            return data
        except FileNotFoundError:
            return {"format": FORMAT, "machines": {}}
        except (OSError, ValueError) as error:
            warnings.warn(
                f"fastmesh: ignoring the plan cache {self.path} ({type(error).__name__}: {error}); "
                "plans are taken from the cost model until it is rewritten",
                stacklevel=3,
            )
            return {"format": FORMAT, "machines": {}}

    def _stamp(self):
        try:
            status = os.stat(self.path)
            return status.st_mtime_ns, status.st_size, status.st_ino
        except OSError:
            return None

    def entries(self) -> dict:
        """This section's entries, reread when the file changed since the last look."""
        stamp = self._stamp()
        if stamp != self._loaded_stamp:
            section = self._read()["machines"].get(self.section, {})
            self._entries = dict(section.get("plans", {}))
            self._loaded_stamp = stamp
        return self._entries

    def sections(self) -> dict:
        """Every section of the file (this machine's and others'), by fingerprint."""
        return self._read()["machines"]

    def lookup(self, key: str) -> dict | None:
        return self.entries().get(key)

    def store(self, key: str, entry: dict) -> None:
        """Adds or replaces one entry, merged with whatever other writers stored meanwhile. A file that cannot be
        written (a directory, no permission) costs a warning, once, not the call: the entry then lives in this
        process only, and other processes measure again."""
        self._entries[key] = entry
        try:
            self._write(key, entry)
        except OSError as error:
            if not self._write_failed:
                self._write_failed = True
                warnings.warn(
                    f"fastmesh: could not write the plan cache {self.path} ({type(error).__name__}: {error}); "
                    "measured plans are kept in this process only",
                    stacklevel=3,
                )

    def _write(self, key: str, entry: dict) -> None:
        directory = os.path.dirname(os.path.abspath(self.path))
        os.makedirs(directory, exist_ok=True)
        with open(self.path + ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data = self._read()
            section = data["machines"].setdefault(self.section, {"machine": machine(), "plans": {}})
            section["plans"][key] = entry
            fd, temporary = tempfile.mkstemp(dir=directory, prefix=".plans-", suffix=".json")
            try:
                with os.fdopen(fd, "w") as f:
                    json.dump(data, f, indent=1, sort_keys=True)
                os.replace(temporary, self.path)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(temporary)
                raise
