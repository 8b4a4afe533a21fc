// The pipeline schedule of fastmesh's fused collectives: how a shard is cut into pieces, in which order
// the pieces travel and which compute step overlaps which transfer. One schedule for every backend: the
// CPU (gloo) and CUDA (NCCL) implementations differ only in what "start a transfer" and "wait for it"
// mean (a host wait on gloo, a stream wait on NCCL), not in this plan. Host code only.
//
// Terms. The communicated tensor is viewed as [P, Q, K] (P = product of the dims before the gathered /
// scattered dim, Q = the rest of the rows of one rank's block). A *unit* is the smallest row range a
// piece may hold so that every rank's part of a piece is one contiguous block: a single row when P == 1,
// a whole [Q, K] slab otherwise. Pieces are consecutive unit ranges of nearly equal size.
//
// all-gather + matmul (per call):
//   1. start the all-gathers of every piece, in order (the transport runs them back to back);
//   2. multiply the local shard (no wait: it is already here), overlapping the first pieces' transfer;
//   3. for each piece in order: wait for it, multiply the other ranks' parts of it.
//   Transfer time is hidden except for the last piece's remote multiply (compute-bound) or the first
//   piece's transfer beyond step 2 (communication-bound): about max(comm, compute) + 1/pieces of the
//   smaller.
// matmul + reduce-scatter (per call):
//   for each piece in order: multiply every rank's part of it into a send buffer, start its
//   reduce-scatter; then wait for all. The first piece's multiply and the last piece's transfer are
//   exposed.
//
// Which rows or columns make a piece is the call's Split (chosen per call by fastmesh/ops/plans.py):
// pieces of rows (above), pieces of the product's columns (reduce-scatter only: each piece multiplies all
// of a by a column slice of b, so b is read once however many pieces), or none (the unfused sequence:
// the whole transfer, then one multiply, or one multiply, then the whole transfer).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

namespace fastmesh {
namespace pipeline {

enum class Split { kRows, kColumns, kNone };

// "rows" | "columns" | "none" (the names fastmesh/ops/plans.py uses); false for anything else.
inline bool parse_split(const std::string& name, Split* out) {
  if (name == "rows")
    *out = Split::kRows;
  else if (name == "columns")
    *out = Split::kColumns;
  else if (name == "none")
    *out = Split::kNone;
  else
    return false;
  return true;
}

// parse_split's inverse.
inline const char* split_name(Split split) {
  return split == Split::kRows ? "rows" : split == Split::kColumns ? "columns" : "none";
}

struct Piece {
  int64_t unit_begin;  // first unit of the piece
  int64_t unit_end;    // one past its last unit
  int64_t units() const { return unit_end - unit_begin; }
};

// Pieces are sized for the transport: a piece much below this is dominated by the per-collective latency
// (gloo over loopback TCP: tens of microseconds; NCCL: a few), one much above it leaves a long exposed
// tail. 1 MiB per rank moves in ~0.1-0.5 ms on the CPU machines and ~2 us over NVLink.
constexpr int64_t kTargetPieceBytes = int64_t{1} << 20;
// Past a handful of pieces the exposed tail is already small and every extra piece only adds latency.
constexpr int64_t kMaxAutoPieces = 8;

// Number of pieces for a shard of `units` units of `unit_bytes` bytes each (one rank's part), or the
// caller's `requested` count (> 0) capped at `units`. At least one piece, even for an empty shard.
inline int64_t choose_pieces(int64_t units, int64_t unit_bytes, int64_t requested) {
  if (units <= 1) return 1;
  if (requested > 0) return std::min(requested, units);
  const int64_t bytes = units * unit_bytes;
  const int64_t by_size = (bytes + kTargetPieceBytes - 1) / kTargetPieceBytes;
  // Two pieces at least: with one, nothing but the local multiply overlaps the transfer.
  return std::min({units, kMaxAutoPieces, std::max<int64_t>(2, by_size)});
}

// `pieces` consecutive, non-empty unit ranges covering [0, units); sizes differ by at most one unit,
// larger ones first. No pieces for zero units.
inline std::vector<Piece> split_units(int64_t units, int64_t pieces) {
  std::vector<Piece> out;
  if (units <= 0) return out;
  pieces = std::max<int64_t>(1, std::min(pieces, units));
  const int64_t base = units / pieces;
  const int64_t larger = units % pieces;
  int64_t begin = 0;
  for (int64_t i = 0; i < pieces; ++i) {
    const int64_t size = base + (i < larger ? 1 : 0);
    out.push_back(Piece{begin, begin + size});
    begin += size;
  }
  return out;
}

// The [P, Q] split of the rows of a tensor of `sizes` around `dim` (not its last dim): P is the product
// of sizes[:dim], Q of sizes[dim:-1]. `unit_rows` is Q when P > 1 (a piece spans whole [Q, K] slabs)
// and 1 otherwise (a piece is a plain row range).
struct RowLayout {
  int64_t outer;      // P
  int64_t inner;      // Q
  int64_t units;      // P when P > 1, else Q
  int64_t unit_rows;  // Q when P > 1, else 1
};

template <typename Sizes>
RowLayout row_layout(const Sizes& sizes, int64_t dim) {
  const int64_t ndim = static_cast<int64_t>(sizes.size());
  int64_t outer = 1, inner = 1;
  for (int64_t i = 0; i < dim; ++i) outer *= sizes[i];
  for (int64_t i = dim; i + 1 < ndim; ++i) inner *= sizes[i];
  // An empty outer product leaves no rows at all: zero units.
  if (outer != 1) return RowLayout{outer, inner, outer, inner};
  return RowLayout{outer, inner, inner, 1};
}

}  // namespace pipeline
}  // namespace fastmesh
