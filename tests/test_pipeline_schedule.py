"""The pipeline schedule shared by the fused collectives' CPU and CUDA paths (csrc/include/fastmesh/pipeline.h),
through ``fastmesh._C.pipeline_pieces``: how a shard is cut into pieces."""

import itertools

import pytest

from fastmesh import _cpp_lib

MIB = 1 << 20


@pytest.fixture(scope="module")
def pieces():
    return _cpp_lib.load().pipeline_pieces


@pytest.mark.parametrize("units", [1, 2, 3, 7, 127, 1000, 4096])
@pytest.mark.parametrize("unit_bytes", [4, 4096, 64 * 1024, MIB])
@pytest.mark.parametrize("requested", [0, 1, 3, 8, 5000])
def test_pieces_cover_the_shard_in_order(pieces, units, unit_bytes, requested):
    got = pieces(units, unit_bytes, requested)
    assert got[0][0] == 0 and got[-1][1] == units
    assert all(end == begin for (_, end), (begin, _) in itertools.pairwise(got)), "pieces must be consecutive"
    sizes = [end - begin for begin, end in got]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1, sizes
    assert sizes == sorted(sizes, reverse=True), "larger pieces first"
    if requested:
        assert len(got) == min(requested, units)


@pytest.mark.parametrize(
    "units, unit_bytes, expected",
    [
        (1, MIB, 1),  # one unit cannot be split
        (100, 100, 2),  # tiny shard: still two pieces, so the transfer overlaps something
        (1024, 4096, 4),  # 4 MiB: one piece per MiB
        (4096, 8192, 8),  # 32 MiB: capped at 8 pieces
        (3, 4 * MIB, 3),  # capped at the unit count
    ],
)
def test_automatic_piece_count(pieces, units, unit_bytes, expected):
    assert len(pieces(units, unit_bytes, 0)) == expected


def test_empty_shard_has_no_pieces(pieces):
    assert pieces(0, 4, 0) == []
