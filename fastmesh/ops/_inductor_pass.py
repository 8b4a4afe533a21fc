"""What fastmesh's inductor passes share: a pass installed where another may already be, which runs that one after
its own and gives inductor's caches a key covering both (:class:`ChainedPass`). Imported only where a pass is
installed: it imports inductor."""

from __future__ import annotations

import hashlib

from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.fx import Graph


class ChainedPass(CustomGraphPass):
    """A custom graph pass that keeps the pass it replaced (``previous``: None, a pass, or, torch >= 2.12, a list of
    them) and runs it after :meth:`run`. Subclasses give :meth:`run`, their source files and their settings' key."""

    sources: tuple[str, ...] = ()

    def __init__(self, previous=None):
        self.previous = previous

    def previous_passes(self) -> tuple:
        previous = self.previous if isinstance(self.previous, (list, tuple)) else (self.previous,)
        return tuple(p for p in previous if p is not None)

    def run(self, graph: Graph) -> None:
        raise NotImplementedError

    def settings_key(self) -> str:
        """What, besides its sources, changes what the pass does."""
        return ""

    def __call__(self, graph: Graph) -> None:
        self.run(graph)
        for previous in self.previous_passes():
            previous(graph)

    def uuid(self) -> bytes | None:
        digest = hashlib.sha256(get_hash_for_files(self.sources, extra=self.settings_key()))
        for previous in self.previous_passes():
            uuid = previous.uuid() if hasattr(previous, "uuid") else None
            if uuid is None:  # inductor cannot cache graphs compiled with an uncacheable pass
                return None
            digest.update(repr(uuid).encode())
        return digest.digest()
