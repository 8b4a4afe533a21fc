// fastmesh::matmul_reduce_scatter: reduce-scatter of a @ b along scatter_dim, the reduce-scatter of one
// piece of the product overlapping the multiply of the next (schedule: fastmesh/pipeline.h). Device
// agnostic for the same reason as all_gather_matmul.cpp.
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "blocks.h"
#include "checks.h"
#include "fastmesh/pipeline.h"
#include "process_group.h"

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kOp = "fastmesh::matmul_reduce_scatter";

using pipeline::Piece;
using pipeline::RowLayout;

// Fills send[j] (the [rows, N'] part of the piece bound for rank j) for every rank j.
template <typename MultiplyPart>
void scatter_pieces(const Group& group, const at::Tensor& out, const RowLayout& layout, int64_t n_cols,
                    int64_t chunks, const MultiplyPart& multiply_part) {
  const int64_t world = group->getSize();
  const at::Tensor out_rows = out.view({-1, n_cols});
  const auto pieces = pipeline::split_units(
      layout.units, pipeline::choose_pieces(layout.units, layout.unit_rows * n_cols * out.element_size(), chunks));
  std::vector<Work> works;
  for (const Piece& piece : pieces) {
    const int64_t rows = piece.units() * layout.unit_rows;
    at::Tensor send = at::empty({world, rows, n_cols}, out.options());
    for (int64_t j = 0; j < world; ++j) multiply_part(send[j], j, piece);
    at::Tensor flat_send = send.view({world * rows, n_cols});
    at::Tensor received = out_rows.narrow(0, piece.unit_begin * layout.unit_rows, rows);
    works.push_back(start_reduce_scatter_sum(group, received, flat_send));
  }
  for (const Work& work : works) work->wait();
}

at::Tensor matmul_reduce_scatter(const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim,
                                 c10::string_view reduce_op, c10::string_view group_name, int64_t chunks) {
  check_matmul_operand(a, kOp, "a", 1, INT64_MAX);
  check_matmul_operand(b, kOp, "b", 2, 2);
  check_like(b, a, kOp, "b", "a");
  TORCH_CHECK_VALUE(b.size(0) == a.size(-1), kOp, ": b must have ", a.size(-1), " rows (a's last dim), got shape ",
                    b.sizes());
  const int64_t dim = wrap_dim(scatter_dim, a.dim(), kOp, "scatter_dim", "a");
  TORCH_CHECK_VALUE(reduce_op == "sum" || reduce_op == "avg", kOp, ": reduce_op must be \"sum\" or \"avg\", got \"",
                    std::string(reduce_op), '"');
  check_chunks(chunks, kOp);
  const Group group = resolve_group(group_name, kOp);
  const int64_t world = group->getSize();
  const int64_t last = a.dim() - 1;
  const int64_t n = b.size(1);
  const int64_t scattered = dim == last ? n : a.size(dim);
  TORCH_CHECK_VALUE(scattered % world == 0, kOp, ": the scattered dim ", scatter_dim, " of a @ b has size ", scattered,
                    ", which is not divisible by the group size ", world);
  if (world == 1) return at::matmul(a, b);

  std::vector<int64_t> out_sizes(a.sizes().begin(), a.sizes().end());
  out_sizes[last] = n;
  out_sizes[dim] /= world;
  at::Tensor out = at::empty(out_sizes, a.options());
  // The product's shape is what travels (b's column count included).
  check_same_shape_on_all_ranks(group, out, kOp, "a @ b");
  if (out.numel() == 0) return out;
  if (a.size(-1) == 0) return out.zero_();  // empty contraction on every rank: the sum of zeros

  const at::Tensor a_dense = a.contiguous();
  if (dim == last) {
    // Rank j's block is a @ b[:, columns of j]: pieces are row ranges of a.
    const int64_t n_part = n / world;
    const at::Tensor a_rows = a_dense.view({-1, a.size(-1)});
    const RowLayout layout = pipeline::row_layout(a_rows.sizes(), 1);
    scatter_pieces(group, out, layout, n_part, chunks, [&](at::Tensor send, int64_t j, Piece piece) {
      at::mm_out(send, a_rows.narrow(0, piece.unit_begin, piece.units()), b.narrow(1, j * n_part, n_part));
    });
  } else {
    // Rank j's block is rows of a (those of j's slice of scatter_dim) times b.
    const RowLayout layout = pipeline::row_layout(out.sizes(), dim);
    const at::Tensor a_blocks = rank_blocks_view(a_dense, layout, world);
    scatter_pieces(group, out, layout, n, chunks, [&](at::Tensor send, int64_t j, Piece piece) {
      matmul_into(as_block(send, layout), rank_block(a_blocks, layout, j, piece), b);
    });
  }
  if (reduce_op == "avg") out.div_(world);  // gloo has no AVG; one spelling for every backend
  return out;
}

}  // namespace
}  // namespace fused
}  // namespace fastmesh

TORCH_LIBRARY_IMPL(fastmesh, CPU, m) {
  m.impl("matmul_reduce_scatter", &fastmesh::fused::matmul_reduce_scatter);
}
TORCH_LIBRARY_IMPL(fastmesh, CUDA, m) {
  m.impl("matmul_reduce_scatter", &fastmesh::fused::matmul_reduce_scatter);
}
