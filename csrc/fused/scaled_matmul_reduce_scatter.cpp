// fastmesh::scaled_matmul_reduce_scatter: the FP8 form of matmul_reduce_scatter (pieces of rows or of b's
// columns, or none, as the call's plan says). The multiplies are scaled
// matmuls of FP8 operands (any scale layout of scaled.h) into `out_dtype`; the product travels and is reduced in
// `out_dtype` (summing FP8-rounded partial products would add an error per rank).

#include <string>
#include <vector>

#include "checks.h"
#include "fused_ops.h"
#include "scaled.h"
#include "scatter_pipeline.h"

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kOp = "fastmesh::scaled_matmul_reduce_scatter";

using pipeline::Piece;
using pipeline::RowLayout;

}  // namespace

at::Tensor scaled_matmul_reduce_scatter(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                        const at::Tensor& b_scale, int64_t scatter_dim, c10::string_view reduce_op,
                                        c10::string_view group_name, at::ScalarType out_dtype, int64_t pieces,
                                        c10::string_view split) {
  const Scalings scalings = check_scaled_operands(a, a_scale, b, b_scale, out_dtype, kOp);
  const bool a_per_row = scalings.a_per_row();
  const int64_t dim = wrap_dim(scatter_dim, a.dim(), kOp, "scatter_dim", "a");
  check_reduce_op(reduce_op, kOp);
  check_pieces(pieces, kOp);
  const pipeline::Split schedule = check_split(split, kOp);
  const Group group = resolve_group(group_name, kOp);
  const int64_t world = group->getSize();
  const int64_t n = b.size(1);
  const bool columns = dim == a.dim() - 1;
  check_scattered_divisible(columns ? n : a.size(dim), world, scatter_dim, kOp);

  const at::Tensor a_dense = a.contiguous();
  const at::Tensor a_rows = rows_view(a_dense);
  const at::Tensor a_scale_rows = scale_rows(a_scale);
  at::Tensor a_blocks, scale_blocks;  // [P, W, Q, K] and [P, W, Q, groups] views (row blocks of the product)
  const int64_t n_part = n / world;
  // Column pieces are any width; a scatter of the columns multiplies each rank's n / W of them.
  const int64_t column_part = schedule == pipeline::Split::kColumns ? 0 : columns ? n_part : n;
  const ScaledB b_operand = prepare_b(b, b_scale, scalings, a.scalar_type(), out_dtype, column_part);
  const auto multiply_columns = [&](at::Tensor send, int64_t c0, int64_t cw) {
    if (columns) {  // rank j's columns of the product: b's columns j*n/W + [c0, c0 + cw)
      for (int64_t j = 0; j < world; ++j) {
        at::Tensor part = send.select(0, j);
        scaled_mm(a_rows, a_scale_rows, b_operand.columns(j * n_part + c0, cw), send.scalar_type(), &part);
      }
      return;
    }
    // One multiply of all of a by the column slice; rank j's part is its block of the product's rows.
    const RowLayout layout = pipeline::row_layout(a.sizes(), dim);
    const ScaledB b_part = b_operand.columns(c0, cw);
    at::Tensor flat_send = send.view({-1, cw});
    if (layout.outer == 1) {
      scaled_mm(a_rows, a_scale_rows, b_part, send.scalar_type(), &flat_send);
      return;
    }
    const at::Tensor product = scaled_mm(a_rows, a_scale_rows, b_part, send.scalar_type());
    send.view({world, layout.outer, layout.inner / world, cw})
        .copy_(product.view({layout.outer, world, layout.inner / world, cw}).transpose(0, 1));
  };
  return reduce_scatter_product(
      group, a.sizes(), n, dim, a.options().dtype(out_dtype), reduce_op, scaled_pieces(pieces, a.device()), schedule,
      kOp,
      [&](at::Tensor send, int64_t j, Piece piece, const RowLayout& layout) {
        if (columns) {
          const at::Tensor rows = a_rows.narrow(0, piece.unit_begin, piece.units());
          const at::Tensor rows_scale = a_per_row ? a_scale_rows.narrow(0, piece.unit_begin, piece.units()) : a_scale;
          scaled_mm(rows, rows_scale, b_operand.columns(j * n_part, n_part), send.scalar_type(), &send);
          return;
        }
        if (!a_blocks.defined()) {
          a_blocks = rank_blocks_view(a_dense, layout, world);
          if (a_per_row) scale_blocks = rank_blocks_view(a_scale_rows, layout, world);
        }
        // A block spanning several [Q, K] slabs is strided; _scaled_mm takes plain matrices.
        const at::Tensor rows = rows_view(rank_block(a_blocks, layout, j, piece).contiguous());
        const at::Tensor rows_scale =
            a_per_row ? rows_view(rank_block(scale_blocks, layout, j, piece).contiguous()) : a_scale;
        scaled_mm(rows, rows_scale, b_operand, send.scalar_type(), &send);
      },
      multiply_columns);
}

}  // namespace fused
}  // namespace fastmesh
