"""Environment variables set for the length of a block (rank processes are reused across tests, so whatever a
test sets must be restored)."""

import contextlib
import os


@contextlib.contextmanager
def environment(**values):
    previous = {name: os.environ.get(name) for name in values}
    os.environ.update({name: str(value) for name, value in values.items()})
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
