"""Environment variables set for the length of a block (rank processes are reused across tests, so whatever a
test sets must be restored). fastmesh reads its settings once (:mod:`fastmesh.settings`): they are reloaded when the
block starts and when it ends."""

import contextlib
import os

from fastmesh import settings


@contextlib.contextmanager
def environment(**values):
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update({name: str(value) for name, value in values.items()})
    settings.reload()
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        settings.reload()
