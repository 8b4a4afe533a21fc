// The reduce-scatter side of the pipeline (fastmesh/pipeline.h): the product computed piece by piece into
// per-piece send buffers, each piece's reduce-scatter started as soon as it is full. Shared by the
// high-precision and FP8 ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "blocks.h"
#include "fastmesh/pipeline.h"
#include "process_group.h"

namespace fastmesh {
namespace fused {

// Reduce-scatters into `out` ([..., n_cols], its rows cut into pieces): for each piece, in order,
// multiply_part(send_j, j, piece, layout) fills send_j, the [rows, n_cols] part of the product bound for
// rank j, for every rank j; then that piece's transfer starts while the next piece is multiplied. Over a
// collective backend the transfer is a reduce-scatter; point-to-point (gloo), each rank receives the
// others' partials of its block and sums them itself, in rank order, piece by piece as they arrive. `op` names
// the op in errors.
template <typename MultiplyPart>
void scatter_pieces(const Group& group, const char* op, const at::Tensor& out, const pipeline::RowLayout& layout,
                    int64_t n_cols, int64_t requested_pieces, const MultiplyPart& multiply_part) {
  const int64_t world = group->getSize(), rank = group->getRank();
  const bool p2p = point_to_point(group, out.device());
  const at::Tensor out_rows = rows_view(out);
  const auto pieces = pipeline::split_units(
      layout.units,
      pipeline::choose_pieces(layout.units, layout.unit_rows * n_cols * out.element_size(), requested_pieces));
  std::vector<at::Tensor> sends, receives;  // alive until their transfers end (declared before `works`)
  InFlight works(group, op);
  for (size_t i = 0; i < pieces.size(); ++i) {
    const pipeline::Piece& piece = pieces[i];
    const int64_t rows = piece.units() * layout.unit_rows;
    at::Tensor result = out_rows.narrow(0, piece.unit_begin * layout.unit_rows, rows);
    if (world == 1) {  // nothing to reduce: multiply straight into the result
      multiply_part(result, 0, piece, layout);
      continue;
    }
    at::Tensor send = at::empty({world, rows, n_cols}, out.options());
    if (p2p) {
      // Receives first, then each peer's partial is sent as soon as it is computed (ring order, so
      // that ranks do not all start on the same destination); this rank's own partial last.
      receives.push_back(at::empty({world, rows, n_cols}, out.options()));
      std::vector<Transfer> piece_works;
      start_piece_receives(group, receives.back(), static_cast<int>(i), piece_works);
      for (int64_t step = 1; step < world; ++step) {
        const int64_t to = (rank + step) % world;
        try {
          multiply_part(send[to], to, piece, layout);
        } catch (...) {
          works.add(std::move(piece_works));  // the receives already posted are drained too
          throw;
        }
        start_piece_send(group, send[to], to, static_cast<int>(i), piece_works);
      }
      works.add(std::move(piece_works));
      multiply_part(send[rank], rank, piece, layout);
    } else {
      for (int64_t j = 0; j < world; ++j) multiply_part(send[j], j, piece, layout);
      at::Tensor flat_send = send.view({world * rows, n_cols});
      works.add({start_reduce_scatter_sum(group, result, flat_send)});
    }
    sends.push_back(send);
  }
  for (size_t i = 0; i < works.size(); ++i) {
    works.wait(i);
    if (!p2p) continue;
    // The reduction is ours: every rank sums its block's partials in rank order.
    std::vector<at::Tensor> parts;
    for (int64_t j = 0; j < world; ++j) parts.push_back(j == rank ? sends[i][rank] : receives[i][j]);
    const pipeline::Piece& piece = pieces[i];
    const int64_t rows = piece.units() * layout.unit_rows;
    sum_in_order(out_rows.narrow(0, piece.unit_begin * layout.unit_rows, rows), parts);
  }
}

// Reduce-scatters into `out_rows` ([rows, n_cols], this rank's block as a matrix) piece by piece of its
// columns: for each piece [c0, c0 + cw), multiply_columns(send, c0, cw) fills send ([W, rows, cw],
// contiguous) with every rank's partial of those columns (send[j] for rank j), then the piece's transfer
// starts while the next piece is multiplied. One piece is the unfused sequence: one multiply, then the
// whole transfer. Transports as in scatter_pieces.
template <typename MultiplyColumns>
void scatter_column_pieces(const Group& group, const char* op, const at::Tensor& out_rows, int64_t pieces,
                           const MultiplyColumns& multiply_columns) {
  const int64_t world = group->getSize(), rank = group->getRank();
  const bool p2p = point_to_point(group, out_rows.device());
  const int64_t rows = out_rows.size(0);
  const auto column_pieces = pipeline::split_units(out_rows.size(1), pieces);
  std::vector<at::Tensor> sends, receives;  // alive until their transfers end (declared before `works`)
  InFlight works(group, op);
  for (size_t i = 0; i < column_pieces.size(); ++i) {
    const int64_t c0 = column_pieces[i].unit_begin, cw = column_pieces[i].units();
    at::Tensor send = at::empty({world, rows, cw}, out_rows.options());
    std::vector<Transfer> piece_works;
    if (p2p && world > 1) {
      receives.push_back(at::empty({world, rows, cw}, out_rows.options()));
      start_piece_receives(group, receives.back(), static_cast<int>(i), piece_works);
    }
    try {
      multiply_columns(send, c0, cw);
    } catch (...) {
      works.add(std::move(piece_works));  // the receives already posted are drained too
      throw;
    }
    sends.push_back(send);
    if (world == 1) continue;
    if (p2p) {
      for (int64_t step = 1; step < world; ++step) {
        const int64_t to = (rank + step) % world;
        start_piece_send(group, send[to], to, static_cast<int>(i), piece_works);
      }
      works.add(std::move(piece_works));
    } else {
      receives.push_back(at::empty({rows, cw}, out_rows.options()));
      at::Tensor flat_send = send.view({world * rows, cw});
      works.add({start_reduce_scatter_sum(group, receives.back(), flat_send)});
    }
  }
  for (size_t i = 0; i < column_pieces.size(); ++i) {
    at::Tensor result = out_rows.narrow(1, column_pieces[i].unit_begin, column_pieces[i].units());
    if (world == 1) {
      result.copy_(sends[i][0]);
      continue;
    }
    works.wait(i);
    if (!p2p) {
      result.copy_(receives[i]);
      continue;
    }
    // The reduction is ours: every rank sums its block's partials in rank order.
    std::vector<at::Tensor> parts;
    for (int64_t j = 0; j < world; ++j) parts.push_back(j == rank ? sends[i][rank] : receives[i][j]);
    sum_in_order(result, parts);
  }
}

// What both reduce-scatter ops do around their multiplies. Returns this rank's block of the reduced
// product of a ([..., K], sizes `a_sizes`) and b ([K, n]) along `dim` (of one shape on every rank, which the op's
// Python kernel checked): allocates it, then runs the pipeline `split` names:
// - kRows, with multiply(send_j, j, piece, layout), where the layout's units are the rows of a (dim == last:
//   rank j gets columns [j*n/W, (j+1)*n/W)) or the [P, W, Q] row blocks of the product (dim < last: rank j
//   gets rows of block j);
// - kColumns / kNone (one piece), with multiply_columns(send, c0, cw) as in scatter_column_pieces, the
//   columns counted within one rank's block of the result.
template <typename Multiply, typename MultiplyColumns>
at::Tensor reduce_scatter_product(const Group& group, at::IntArrayRef a_sizes, int64_t n, int64_t dim,
                                  const at::TensorOptions& options, c10::string_view reduce_op, int64_t pieces,
                                  pipeline::Split split, const char* op, const Multiply& multiply,
                                  const MultiplyColumns& multiply_columns) {
  const int64_t world = group->getSize();
  const int64_t last = static_cast<int64_t>(a_sizes.size()) - 1;
  std::vector<int64_t> out_sizes(a_sizes.begin(), a_sizes.end());
  out_sizes[last] = n;
  out_sizes[dim] /= world;
  at::Tensor out = at::empty(out_sizes, options);
  if (out.numel() == 0) return out;
  if (a_sizes[last] == 0) return out.zero_();  // empty contraction on every rank: the sum of zeros

  if (split != pipeline::Split::kRows) {
    const at::Tensor out_rows = rows_view(out);
    const int64_t column_pieces =
        split == pipeline::Split::kNone
            ? 1
            : pipeline::choose_pieces(out_rows.size(1), out_rows.size(0) * out.element_size(), pieces);
    scatter_column_pieces(group, op, out_rows, column_pieces, multiply_columns);
  } else if (dim == last) {
    const int64_t rows = out.numel() / out.size(-1);
    scatter_pieces(group, op, out, pipeline::row_layout(std::vector<int64_t>{rows, 1}, 1), n / world, pieces, multiply);
  } else {
    scatter_pieces(group, op, out, pipeline::row_layout(out.sizes(), dim), n, pieces, multiply);
  }
  if (reduce_op == "avg") out.div_(world);  // gloo has no AVG; one spelling for every backend
  return out;
}

}  // namespace fused
}  // namespace fastmesh
