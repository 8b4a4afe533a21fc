// fastmesh::all_gather_scaled_matmul: the FP8 form of all_gather_matmul. The gathered operand travels as
// FP8 data (one byte per element, as raw bytes: gloo has no float8 types) plus its scales (tensor-wise,
// row-wise, MX or block: scaled.h), and every multiply is a scaled matmul into a chosen output dtype. Rows
// only: gathering the contraction dim would mix ranks' scales inside one dot product.
#include <ATen/ops/empty.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "fused_ops.h"
#include "gather_pipeline.h"
#include "scaled.h"

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kOp = "fastmesh::all_gather_scaled_matmul";

// The gathered a's scales: one row of `groups` per row of a (tensor-wise shards: one per row).
std::vector<int64_t> scale_sizes(at::IntArrayRef sizes, int64_t groups) {
  std::vector<int64_t> out(sizes.begin(), sizes.end());
  out.back() = groups;
  return out;
}

}  // namespace

std::tuple<std::optional<at::Tensor>, std::optional<at::Tensor>, std::vector<at::Tensor>> all_gather_scaled_matmul(
    const at::Tensor& a_shard, const at::Tensor& a_scale, at::TensorList bs, at::TensorList b_scales,
    int64_t gather_dim, c10::string_view group_name, at::ScalarType out_dtype, bool return_a, int64_t pieces,
    c10::string_view split) {
  check_tensor(a_shard, kOp, "a_shard", kFp8Dtypes, 2);
  const int64_t dim = wrap_dim(gather_dim, a_shard.dim(), kOp, "gather_dim", "a_shard");
  TORCH_CHECK_VALUE(dim != a_shard.dim() - 1, kOp, ": the FP8 form gathers rows: gather_dim must not be the last dim (",
                    gather_dim, " for a_shard with ", a_shard.dim(),
                    " dims), since ranks' scales cannot share a dot product");
  const Scaling a_scaling = check_a_scale(a_scale, a_shard, kOp, "a_scale", "a_shard");
  check_out_dtype(out_dtype, kOp);
  check_pieces(pieces, kOp);
  const pipeline::Split schedule = check_split(split, kOp);
  TORCH_CHECK_VALUE(schedule != pipeline::Split::kColumns, kOp,
                    ": split \"columns\" is a reduce-scatter schedule; an all-gather takes \"rows\" or \"none\"");
  // One multiply of the whole gathered a needs one scale per row: tensor-wise shards of several ranks differ.
  TORCH_CHECK_VALUE(schedule != pipeline::Split::kNone || a_scale.dim() > 0, kOp,
                    ": split \"none\" needs a_scale per row (row-wise, MX or block: one multiply over every rank's "
                    "rows)");
  TORCH_CHECK_VALUE(!bs.empty(), kOp, ": bs must hold at least one matrix, got an empty list");
  TORCH_CHECK_VALUE(b_scales.size() == bs.size(), kOp, ": b_scales must hold one scale per b (", bs.size(), "), got ",
                    b_scales.size());
  std::vector<Scalings> scalings;
  for (size_t i = 0; i < bs.size(); ++i) {
    const std::string arg = "bs[" + std::to_string(i) + "]";
    check_scaled_b(bs[i], a_shard, kOp, arg, "a_shard", "the last dim of a_shard");
    scalings.push_back({a_scaling, check_b_scale(b_scales[i], bs[i], kOp, "b_scales[" + std::to_string(i) + "]", arg)});
    check_scales_supported(scalings.back().needs_rowwise_scaled_mm(), a_shard.device(), kOp);
  }
  const Group group = resolve_group(group_name, kOp);
  const int64_t world = group->getSize(), rank = group->getRank();

  const std::vector<int64_t> full_sizes = with_size(a_shard.sizes(), dim, a_shard.size(dim) * world);
  std::vector<at::Tensor> outs;
  for (const at::Tensor& b : bs)
    outs.push_back(at::empty(with_size(full_sizes, a_shard.dim() - 1, b.size(1)), a_shard.options().dtype(out_dtype)));
  const bool scale_per_row = a_scale.dim() > 0;
  const int64_t groups = scale_per_row ? a_scale.size(-1) : 1;
  std::optional<at::Tensor> a_full, a_scale_full;
  if (return_a) {
    a_full = at::empty(full_sizes, a_shard.options());
    a_scale_full = at::empty(scale_sizes(full_sizes, groups), a_scale.options());
  }
  const RowLayout layout = pipeline::row_layout(a_shard.sizes(), dim);
  if (layout.outer * layout.inner == 0) return {a_full, a_scale_full, outs};  // no rows: nothing to gather

  std::vector<ScaledB> b_operands;
  for (size_t i = 0; i < bs.size(); ++i) {
    b_operands.push_back(prepare_b(bs[i], b_scales[i], scalings[i], a_shard.scalar_type(), out_dtype, bs[i].size(1)));
  }

  // The scales travel first, in one small all-gather, so that every piece's multiply can use them.
  const at::Tensor shard = a_shard.contiguous();
  // [rows, groups]; tensor-wise [1, 1]
  const at::Tensor scale_shard = scale_per_row ? rows_view(a_scale.contiguous()) : a_scale.view({1, 1});
  const int64_t scale_rows = scale_shard.size(0);
  at::Tensor scales = at::empty({world * scale_rows, groups}, a_scale.options());
  InFlight scales_transfer(group, kOp, "a_scale (gathered before the pieces)");
  if (world > 1) {
    at::Tensor scales_bytes = flat_bytes(scales), shard_bytes = flat_bytes(scale_shard);
    scales_transfer.add({start_all_gather(group, scales_bytes, shard_bytes)});
  }
  if (world == 1) scales.copy_(scale_shard);
  bool scales_arrived = world == 1;
  auto scale_of = [&](int64_t j, Piece piece) -> at::Tensor {
    if (!scale_per_row) return j == rank ? a_scale : scales.select(0, j).select(0, 0);
    const at::Tensor mine = j == rank ? scale_shard : scales.narrow(0, j * scale_rows, scale_rows);
    return mine.narrow(0, piece.unit_begin * layout.unit_rows, piece.units() * layout.unit_rows);
  };

  if (schedule == pipeline::Split::kNone) {  // the whole gather, then one scaled multiply per b (b read once)
    const at::Tensor gathered = a_full ? *a_full : at::empty(full_sizes, a_shard.options());
    const at::Tensor gathered_bytes = rank_blocks_view(gathered.view(at::kByte), layout, world);
    gather_rows(group, kOp, shard.view(at::kByte), dim, &gathered_bytes, 1, [](int64_t, Piece, const at::Tensor&) {});
    if (world > 1) scales_transfer.wait(0);
    const at::Tensor gathered_scale =
        a_scale_full ? *a_scale_full : at::empty(scale_sizes(full_sizes, groups), a_scale.options());
    rank_blocks_view(gathered_scale, layout, world)
        .copy_(scales.view({world, layout.outer, layout.inner, groups}).permute({1, 0, 2, 3}));
    const at::Tensor a_rows = rows_view(gathered), a_rows_scale = rows_view(gathered_scale);
    for (size_t i = 0; i < bs.size(); ++i) {
      scaled_mm_into(rows_view(outs[i]).unsqueeze(0), a_rows, a_rows_scale, b_operands[i]);
    }
    return {a_full, a_scale_full, outs};
  }
  std::vector<at::Tensor> out_blocks;
  for (const at::Tensor& out : outs) out_blocks.push_back(rank_blocks_view(out, layout, world));
  const at::Tensor a_bytes = a_full ? rank_blocks_view(a_full->view(at::kByte), layout, world) : at::Tensor();
  gather_rows(group, kOp, shard.view(at::kByte), dim, a_full ? &a_bytes : nullptr,
              scaled_pieces(pieces, shard.device()), [&](int64_t j, Piece piece, const at::Tensor& block_bytes) {
                if (j != rank && !scales_arrived) {
                  scales_transfer.wait(0);
                  scales_arrived = true;
                }
                const at::Tensor a_rows = rows_view(block_bytes.view(shard.scalar_type()).flatten(0, 1));
                const at::Tensor a_rows_scale = scale_of(j, piece);
                for (size_t i = 0; i < bs.size(); ++i) {
                  scaled_mm_into(rank_block(out_blocks[i], layout, j, piece), a_rows, a_rows_scale, b_operands[i]);
                }
              });
  if (!scales_arrived) scales_transfer.wait(0);
  if (a_scale_full) {
    // The gathered a's scales per row: per-rank tensor-wise scales are expanded to their rows.
    const at::Tensor per_rank = scale_per_row
                                    ? scales.view({world, layout.outer, layout.inner, groups}).permute({1, 0, 2, 3})
                                    : scales.view({1, world, 1, 1});
    rank_blocks_view(*a_scale_full, layout, world).copy_(per_rank.expand({layout.outer, world, layout.inner, groups}));
  }
  return {a_full, a_scale_full, outs};
}

}  // namespace fused
}  // namespace fastmesh
