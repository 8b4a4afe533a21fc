"""Counting the c10d calls an op issues, for tests of communication patterns."""

from __future__ import annotations

SEND, RECV = "c10d::send", "c10d::recv_"
PLAIN_GATHER = "_c10d_functional::all_gather_into_tensor"  # torch's functional all-gather, as fastmesh calls it


def c10d_calls(fn) -> dict[str, int]:
    """c10d collectives ``fn`` issues on this rank, by op name, as the profiler records them."""
    from torch.profiler import profile

    with profile() as prof:
        fn()
    counts: dict[str, int] = {}
    for event in prof.events():
        if event.name.startswith(("c10d::", "_c10d_functional")):
            counts[event.name] = counts.get(event.name, 0) + 1
    return counts


def p2p_pieces(world: int, pieces: int) -> dict[str, int]:
    """What the transfer of `pieces` pieces costs on gloo: each piece goes point-to-point to and from every
    other rank. (The shape check, one small all-gather, runs on an op's first call on a group only: the tests
    call each op once before they count.)"""
    return {SEND: pieces * (world - 1), RECV: pieces * (world - 1)}
