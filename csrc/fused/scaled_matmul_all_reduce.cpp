// fastmesh::scaled_matmul_all_reduce: the FP8 form of matmul_all_reduce. The multiplies are scaled matmuls of
// FP8 operands into `out_dtype`; the product travels and is reduced in `out_dtype` (summing FP8-rounded partial
// products would add an error per rank).
#include <vector>

#include "all_reduce_pipeline.h"
#include "checks.h"
#include "fused_ops.h"
#include "scaled.h"

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kOp = "fastmesh::scaled_matmul_all_reduce";

}  // namespace

at::Tensor scaled_matmul_all_reduce(const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b,
                                    const at::Tensor& b_scale, c10::string_view reduce_op, c10::string_view group_name,
                                    at::ScalarType out_dtype, int64_t pieces, c10::string_view split) {
  const Scalings scalings = check_scaled_operands(a, a_scale, b, b_scale, out_dtype, kOp);
  check_reduce_op(reduce_op, kOp);
  check_pieces(pieces, kOp);
  const pipeline::Split schedule = check_all_reduce_split(split, kOp);
  const Group group = resolve_group(group_name, kOp);

  if (group->getSize() == 1) return scaled_matmul(a, a_scale, b, b_scale, out_dtype);
  std::vector<int64_t> out_sizes(a.sizes().begin(), a.sizes().end());
  out_sizes.back() = b.size(1);
  const at::Tensor a_rows = rows_view(a.contiguous());
  const at::Tensor a_scale_rows = scale_rows(a_scale);
  const ScaledB b_operand = prepare_b(b, b_scale, scalings, a.scalar_type(), out_dtype, b.size(1));
  return all_reduce_product(
      group, out_sizes, a.options().dtype(out_dtype), a.size(-1), reduce_op, scaled_pieces(pieces, a.device()),
      schedule, kOp, [&](at::Tensor slice, int64_t first_row, int64_t rows) {
        const at::Tensor scale = scalings.a_per_row() ? a_scale_rows.narrow(0, first_row, rows) : a_scale_rows;
        scaled_mm(a_rows.narrow(0, first_row, rows), scale, b_operand, out_dtype, &slice);
      });
}

}  // namespace fused
}  // namespace fastmesh
