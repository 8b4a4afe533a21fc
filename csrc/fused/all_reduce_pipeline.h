// The all-reduce side of the pipeline (fastmesh/pipeline.h): the product computed piece by piece of its rows
// into one contiguous output, each piece's all-reduce (the group's own, in place) started as soon as it is
// full. Shared by the high-precision and FP8 matmul + all-reduce ops.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <vector>

#include "blocks.h"
#include "checks.h"
#include "fastmesh/pipeline.h"
#include "process_group.h"

namespace fastmesh {
namespace fused {

// The all-reduced product ([out_sizes], `k` the contraction of this rank's multiply; the same on every rank,
// which the op's Python kernel checked): allocates it, then for each piece of its rows in order calls
// multiply_rows(slice, first_row, rows), which fills `slice` (those rows of the product as a contiguous
// matrix), and starts the slice's all-reduce, which runs while the next piece is multiplied. Split kNone is
// one piece: one multiply, then one all-reduce.
template <typename MultiplyRows>
at::Tensor all_reduce_product(const Group& group, const std::vector<int64_t>& out_sizes,
                              const at::TensorOptions& options, int64_t k, c10::string_view reduce_op, int64_t pieces,
                              pipeline::Split split, const char* op, const MultiplyRows& multiply_rows) {
  const int64_t world = group->getSize();
  at::Tensor out = at::empty(out_sizes, options);
  if (out.numel() == 0) return out;
  if (k == 0) return out.zero_();  // empty contraction on every rank: the sum of zeros

  at::Tensor out_rows = rows_view(out);
  const int64_t rows = out_rows.size(0);
  const int64_t count = split == pipeline::Split::kNone
                            ? 1
                            : pipeline::choose_pieces(rows, out_rows.size(1) * out.element_size(), pieces);
  InFlight works(group, op);
  for (const pipeline::Piece& piece : pipeline::split_units(rows, count)) {
    // A range of rows of a contiguous matrix is contiguous: each piece's all-reduce works in place.
    at::Tensor slice = out_rows.narrow(0, piece.unit_begin, piece.units());
    multiply_rows(slice, piece.unit_begin, piece.units());
    works.add({start_all_reduce_sum(group, slice)});
  }
  for (size_t i = 0; i < works.size(); ++i) works.wait(i);
  if (reduce_op == "avg") out.div_(world);  // gloo has no AVG; one spelling for every backend
  return out;
}

// Split "rows" or "none": pieces of columns would multiply all of a once per piece, for nothing.
inline pipeline::Split check_all_reduce_split(c10::string_view split, const char* op) {
  const pipeline::Split schedule = check_split(split, op);
  TORCH_CHECK_VALUE(schedule != pipeline::Split::kColumns, op,
                    ": split must be \"rows\" or \"none\" (pieces of columns would read a once per piece), got "
                    "\"columns\"");
  return schedule;
}

}  // namespace fused
}  // namespace fastmesh
