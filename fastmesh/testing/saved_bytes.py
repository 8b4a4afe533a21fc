"""Counting what autograd keeps for backward, eager or compiled: every tensor saved inside a block, by storage
(tests and the tp_block benchmark)."""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor import DTensor


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


class SavedBytes:
    """The storages saved for backward (each once, whatever views of it are saved), less those of ``excluded``."""

    def __init__(self, excluded):
        self._excluded = {_local(t).untyped_storage().data_ptr() for t in excluded}
        self.storages: dict[int, int] = {}

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = _local(t).untyped_storage()
        if storage.data_ptr() not in self._excluded:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


@contextlib.contextmanager
def saved_bytes(excluded=()):
    """Records, in the yielded :class:`SavedBytes`, every tensor autograd saves inside the block (a compiled
    graph's saved activations too), leaving out the storages of ``excluded`` (parameters, weights)."""
    record = SavedBytes(excluded)
    with torch.autograd.graph.saved_tensors_hooks(record.pack, lambda t: t):
        yield record
