// fastmesh::matmul_all_gather: every rank's a @ b gathered along the product's columns (a column-parallel
// linear whose output is made replicated, the LM head), the gather of one piece of the product's rows
// overlapping the multiply of the next, or, as the call's plan says, one multiply and then one gather.
//
// Each piece's rows are multiplied into this rank's slot of a piece-major [world, rows, n] buffer, whose
// slots are contiguous: the transport receives every rank's rows of the piece straight into them (gloo:
// point-to-point, as the all-gather pipeline; other backends: one all-gather of the piece). Once a piece has
// arrived its slots are copied into the output's column blocks, while the later pieces are still in flight.
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <vector>

#include "blocks.h"
#include "checks.h"
#include "fastmesh/pipeline.h"
#include "fused_ops.h"
#include "process_group.h"

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kOp = "fastmesh::matmul_all_gather";

std::vector<int64_t> with_columns(const at::Tensor& a, int64_t columns) {
  std::vector<int64_t> sizes(a.sizes().begin(), a.sizes().end());
  sizes.back() = columns;
  return sizes;
}

}  // namespace

at::Tensor matmul_all_gather(const at::Tensor& a, const at::Tensor& b, c10::string_view group_name, int64_t pieces,
                             c10::string_view split) {
  check_matmul_operands(a, b, kOp);
  check_pieces(pieces, kOp);
  const pipeline::Split schedule = check_split(split, kOp);
  TORCH_CHECK_VALUE(schedule != pipeline::Split::kColumns, kOp,
                    ": split must be \"rows\" or \"none\" (this rank's columns are one block of the output), got "
                    "\"columns\"");
  const Group group = resolve_group(group_name, kOp);
  const int64_t world = group->getSize(), rank = group->getRank(), n = b.size(1);
  const at::Tensor a_rows = rows_view(a.contiguous());
  if (world == 1) return at::mm(a_rows, b).view(with_columns(a, n));

  at::Tensor out = at::empty(with_columns(a, world * n), a.options());
  if (out.numel() == 0) return out;
  at::Tensor out_rows = rows_view(out);
  const int64_t rows = out_rows.size(0);
  const int64_t count =
      schedule == pipeline::Split::kNone ? 1 : pipeline::choose_pieces(rows, world * n * out.element_size(), pieces);
  const std::vector<pipeline::Piece> row_pieces = pipeline::split_units(rows, count);
  const bool p2p = point_to_point(group, a.device());
  at::Tensor storage = at::empty({world * rows * n}, a.options());
  std::vector<at::Tensor> buffers;  // piece i's [world, rows_i, n]
  InFlight works(group, kOp);
  int64_t offset = 0;
  for (size_t i = 0; i < row_pieces.size(); ++i) {
    const pipeline::Piece& piece = row_pieces[i];
    at::Tensor buffer = storage.narrow(0, offset, world * piece.units() * n).view({world, piece.units(), n});
    offset += world * piece.units() * n;
    at::Tensor mine = buffer[rank];
    at::mm_out(mine, a_rows.narrow(0, piece.unit_begin, piece.units()), b);
    if (p2p) {
      std::vector<at::Tensor> parts;
      for (int64_t j = 0; j < world; ++j) parts.push_back(buffer[j]);
      works.add(start_piece_exchange(group, mine, parts, static_cast<int>(i)));
    } else {
      // The all-gather's input is a copy: not every backend takes an input inside its own output.
      at::Tensor flat = buffer.view({world * piece.units(), n});
      at::Tensor in = mine.clone();
      works.add({start_all_gather(group, flat, in)});
    }
    buffers.push_back(buffer);
  }
  for (size_t i = 0; i < row_pieces.size(); ++i) {
    works.wait(i);
    const pipeline::Piece& piece = row_pieces[i];
    // [rows_i, world * n] as [rows_i, world, n]: rank j's rows go to column block j.
    out_rows.narrow(0, piece.unit_begin, piece.units())
        .view({piece.units(), world, n})
        .copy_(buffers[i].transpose(0, 1));
  }
  return out;
}

}  // namespace fused
}  // namespace fastmesh
