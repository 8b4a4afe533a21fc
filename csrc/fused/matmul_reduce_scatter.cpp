// fastmesh::matmul_reduce_scatter: reduce-scatter of a @ b along scatter_dim, the reduce-scatter of one
// piece of the product overlapping the multiply of the next (schedule: fastmesh/pipeline.h); pieces of rows
// or of b's columns, or no pieces at all, as the call's plan says. Device agnostic for the same reason as
// all_gather_matmul.cpp.
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>

#include <string>
#include <vector>

#include "checks.h"
#include "fused_ops.h"
#include "scatter_pipeline.h"

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kOp = "fastmesh::matmul_reduce_scatter";

using pipeline::Piece;
using pipeline::RowLayout;

}  // namespace

at::Tensor matmul_reduce_scatter(const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim,
                                 c10::string_view reduce_op, c10::string_view group_name, int64_t pieces,
                                 c10::string_view split) {
  check_matmul_operands(a, b, kOp);
  const int64_t dim = wrap_dim(scatter_dim, a.dim(), kOp, "scatter_dim", "a");
  check_reduce_op(reduce_op, kOp);
  check_pieces(pieces, kOp);
  const pipeline::Split schedule = check_split(split, kOp);
  const Group group = resolve_group(group_name, kOp);
  const int64_t world = group->getSize();
  const int64_t n = b.size(1);
  const bool columns = dim == a.dim() - 1;
  check_scattered_divisible(columns ? n : a.size(dim), world, scatter_dim, kOp);
  if (world == 1) return at::matmul(a, b);

  const at::Tensor a_dense = a.contiguous();
  const at::Tensor a_rows = rows_view(a_dense);
  at::Tensor a_blocks;  // [P, W, Q, K]: rank j's rows of the product come from rows of a_blocks[:, j]
  const int64_t n_part = n / world;
  const auto multiply_columns = [&](at::Tensor send, int64_t c0, int64_t cw) {
    if (columns) {  // rank j's columns of the product: b's columns j*n/W + [c0, c0 + cw)
      for (int64_t j = 0; j < world; ++j) {
        at::Tensor part = send.select(0, j);
        at::mm_out(part, a_rows, b.narrow(1, j * n_part + c0, cw));
      }
      return;
    }
    // One multiply of all of a by the column slice; rank j's part is its block of the product's rows.
    const RowLayout layout = pipeline::row_layout(a.sizes(), dim);
    at::Tensor flat_send = send.view({-1, cw});
    if (layout.outer == 1) {
      at::mm_out(flat_send, a_rows, b.narrow(1, c0, cw));
      return;
    }
    const at::Tensor product = at::mm(a_rows, b.narrow(1, c0, cw));
    send.view({world, layout.outer, layout.inner / world, cw})
        .copy_(product.view({layout.outer, world, layout.inner / world, cw}).transpose(0, 1));
  };
  return reduce_scatter_product(
      group, a.sizes(), n, dim, a.options(), reduce_op, pieces, schedule, kOp,
      [&](at::Tensor send, int64_t j, Piece piece, const RowLayout& layout) {
        if (columns) {
          const int64_t n_part = n / world;
          at::mm_out(send, a_rows.narrow(0, piece.unit_begin, piece.units()), b.narrow(1, j * n_part, n_part));
          return;
        }
        if (!a_blocks.defined()) a_blocks = rank_blocks_view(a_dense, layout, world);
        matmul_into(as_block(send, layout), rank_block(a_blocks, layout, j, piece), b);
      },
      multiply_columns);
}

}  // namespace fused
}  // namespace fastmesh
