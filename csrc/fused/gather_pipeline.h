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

// The received pieces, piece-major: piece i holds every rank's part of it as [world, rows_i, K], one
// contiguous buffer per piece (the target of one all-gather, or of one receive per peer over gloo).
struct GatheredPieces {
  std::vector<Piece> pieces;
  std::vector<at::Tensor> received;       // [world, rows, K] per piece
  std::vector<std::vector<Work>> works;  // per piece

  // Starts every piece's transfer; the transport runs them back to back. A group of one has nothing to
  // receive: no pieces.
  GatheredPieces(const Group& group, const at::Tensor& shard_rows, const RowLayout& layout, int64_t chunks) {
    const int64_t world = group->getSize();
    if (world == 1) return;
    const bool p2p = point_to_point(group, shard_rows.device());
    const int64_t k = shard_rows.size(1);
    pieces = pipeline::split_units(
        layout.units, pipeline::choose_pieces(layout.units, layout.unit_rows * k * shard_rows.element_size(), chunks));
    at::Tensor storage = at::empty({world * shard_rows.numel()}, shard_rows.options());
    int64_t offset = 0;
    for (size_t i = 0; i < pieces.size(); ++i) {
      const int64_t rows = pieces[i].units() * layout.unit_rows;
      at::Tensor out = storage.narrow(0, offset, world * rows * k).view({world, rows, k});
      offset += world * rows * k;
      const at::Tensor in = shard_rows.narrow(0, pieces[i].unit_begin * layout.unit_rows, rows);
      works.push_back(start_piece_gather(group, p2p, in, out, static_cast<int>(i)));
      received.push_back(out);
    }
  }

  const at::Tensor& wait(size_t i) {
    for (const Work& work : works[i]) work->wait();
    return received[i];
  }
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
template <typename MultiplyBlock>
void gather_rows(const Group& group, const at::Tensor& shard, int64_t dim, const at::Tensor* a_blocks, int64_t chunks,
                 const MultiplyBlock& multiply) {
  const int64_t world = group->getSize(), rank = group->getRank();
  const RowLayout layout = pipeline::row_layout(shard.sizes(), dim);
  const int64_t k = shard.size(-1);
  GatheredPieces gathered(group, rows_view(shard), layout, chunks);

  const at::Tensor shard_block = shard.view({layout.outer, layout.inner, k});
  const Piece whole{0, layout.units};
  multiply(rank, whole, shard_block);
  if (a_blocks) rank_block(*a_blocks, layout, rank, whole).copy_(shard_block);
  for (size_t p = 0; p < gathered.pieces.size(); ++p) {
    const Piece piece = gathered.pieces[p];
    const at::Tensor& received = gathered.wait(p);
    for (int64_t j = 0; j < world; ++j) {
      if (j == rank) continue;
      const at::Tensor part = as_block(received[j], layout);
      multiply(j, piece, part);
      if (a_blocks) rank_block(*a_blocks, layout, j, piece).copy_(part);
    }
  }
}

}  // namespace fused
}  // namespace fastmesh
