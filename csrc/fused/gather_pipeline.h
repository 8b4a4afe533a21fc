// The all-gather side of the pipeline (fastmesh/pipeline.h): pieces of the shard gathered back to back,
// and the row-gather loop that multiplies each rank's part of a piece once it has arrived. Shared by the
// high-precision and FP8 all-gather ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "blocks.h"
#include "fastmesh/pipeline.h"
#include "process_group.h"

namespace fastmesh {
namespace fused {

using pipeline::Piece;
using pipeline::RowLayout;

// The pieces of every rank, as they arrive: parts(i)[j] is rank j's part of piece i, a contiguous
// [rows_i, K] matrix (this rank's own part is its shard's rows). Over a collective backend each piece is
// one all-gather into a piece-major [world, rows_i, K] buffer. Point-to-point (gloo), each part is one
// receive, straight into `destination` (the gathered a as [P, W, Q, K] blocks) where the caller wants
// the gathered a and its rank blocks are contiguous (P == 1), else into a buffer.
class GatheredPieces {
 public:
  std::vector<Piece> pieces;
  bool into_destination = false;  // the parts are the destination's blocks: nothing to copy there

  // Starts every piece's transfer; the transport runs them back to back. A group of one has nothing to
  // receive: no pieces. `op` names the op in the error of a failed wait.
  GatheredPieces(const Group& group, const char* op, const at::Tensor& shard_rows, const RowLayout& layout,
                 int64_t requested_pieces, const at::Tensor* destination = nullptr)
      : works_(group, op) {
    const int64_t world = group->getSize(), rank = group->getRank();
    if (world == 1) return;
    const bool p2p = point_to_point(group, shard_rows.device());
    into_destination = p2p && destination != nullptr && layout.outer == 1;
    const int64_t k = shard_rows.size(1);
    pieces = pipeline::split_units(
        layout.units,
        pipeline::choose_pieces(layout.units, layout.unit_rows * k * shard_rows.element_size(), requested_pieces));
    at::Tensor storage =
        into_destination ? at::Tensor() : at::empty({world * shard_rows.numel()}, shard_rows.options());
    int64_t offset = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const int64_t rows = pieces[i].units() * layout.unit_rows;
      const at::Tensor mine = shard_rows.narrow(0, pieces[i].unit_begin * layout.unit_rows, rows);
      std::vector<at::Tensor> piece_parts;
      at::Tensor buffer;
      if (!into_destination) {
        buffer = storage.narrow(0, offset, world * rows * k).view({world, rows, k});
        offset += world * rows * k;
      }
      for (int64_t j = 0; j < world; ++j) {
        if (j == rank) {
          piece_parts.push_back(mine);
        } else {
          piece_parts.push_back(into_destination ? rank_block(*destination, layout, j, pieces[i]).select(0, 0)
                                                 : buffer[j]);
        }
      }
      if (p2p) {
        works_.add(start_piece_exchange(group, mine, piece_parts, static_cast<int>(i)));
      } else {
        at::Tensor flat_out = buffer.view({world * rows, k});
        at::Tensor in = mine;
        works_.add({start_all_gather(group, flat_out, in)});
      }
      parts_.push_back(std::move(piece_parts));
    }
  }

  // Rank j's part of piece i, for every j, once piece i has arrived.
  const std::vector<at::Tensor>& wait(size_t i) {
    works_.wait(i);
    return parts_[i];
  }

 private:
  std::vector<std::vector<at::Tensor>> parts_;
  InFlight works_;
};

inline std::vector<int64_t> with_size(at::IntArrayRef sizes, int64_t dim, int64_t size) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out[dim] = size;
  return out;
}

// gather_dim < last: every rank's rows are a block of the output rows; no cross-rank sums. Calls
// multiply(rank, piece, rows) with rows the [B, rows, K] block of `shard`'s dtype (the transport dtype)
// that rank `rank` holds for `piece`: first the whole local shard, then the others' parts of each
// piece as it arrives. Copies every block into `a_blocks` ([P, W, Q, K] view of the gathered a) if given.
// `op` names the op in errors.
template <typename MultiplyBlock>
void gather_rows(const Group& group, const char* op, const at::Tensor& shard, int64_t dim, const at::Tensor* a_blocks,
                 int64_t pieces, const MultiplyBlock& multiply) {
  const int64_t world = group->getSize(), rank = group->getRank();
  const RowLayout layout = pipeline::row_layout(shard.sizes(), dim);
  const int64_t k = shard.size(-1);
  GatheredPieces gathered(group, op, rows_view(shard), layout, pieces, a_blocks);

  const at::Tensor shard_block = shard.view({layout.outer, layout.inner, k});
  const Piece whole{0, layout.units};
  multiply(rank, whole, shard_block);
  if (a_blocks) rank_block(*a_blocks, layout, rank, whole).copy_(shard_block);
  for (size_t p = 0; p < gathered.pieces.size(); ++p) {
    const Piece piece = gathered.pieces[p];
    const std::vector<at::Tensor>& parts = gathered.wait(p);
    for (int64_t j = 0; j < world; ++j) {
      if (j == rank) continue;
      const at::Tensor part = as_block(parts[j], layout);
      multiply(j, piece, part);
      if (a_blocks && !gathered.into_destination) rank_block(*a_blocks, layout, j, piece).copy_(part);
    }
  }
}

}  // namespace fused
}  // namespace fastmesh
