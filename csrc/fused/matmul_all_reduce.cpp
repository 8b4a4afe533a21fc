// fastmesh::matmul_all_reduce: all-reduce of a @ b over the group, the all-reduce of one piece of the
// product's rows overlapping the multiply of the next (all_reduce_pipeline.h), or, as the call's plan says,
// one multiply and then one all-reduce. Device agnostic for the same reason as all_gather_matmul.cpp: the
// all-reduces are the group's own (gloo runs them on its worker threads while this thread multiplies the next
// piece; NCCL on its stream).
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>

#include <vector>

#include "all_reduce_pipeline.h"
#include "checks.h"
#include "fused_ops.h"

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kOp = "fastmesh::matmul_all_reduce";

}  // namespace

at::Tensor matmul_all_reduce(const at::Tensor& a, const at::Tensor& b, c10::string_view reduce_op,
                             c10::string_view group_name, int64_t pieces, c10::string_view split) {
  check_matmul_operands(a, b, kOp);
  check_reduce_op(reduce_op, kOp);
  check_pieces(pieces, kOp);
  const pipeline::Split schedule = check_all_reduce_split(split, kOp);
  const Group group = resolve_group(group_name, kOp);
  if (group->getSize() == 1) return at::matmul(a, b);

  std::vector<int64_t> out_sizes(a.sizes().begin(), a.sizes().end());
  out_sizes.back() = b.size(1);
  const at::Tensor a_rows = rows_view(a.contiguous());
  return all_reduce_product(group, out_sizes, a.options(), a.size(-1), reduce_op, pieces, schedule, kOp,
                            [&](at::Tensor slice, int64_t first_row, int64_t rows) {
                              at::mm_out(slice, a_rows.narrow(0, first_row, rows), b);
                            });
}

}  // namespace fused
}  // namespace fastmesh
