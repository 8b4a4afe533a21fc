// fastmesh::all_gather_matmul: all-gather a_shard along gather_dim and multiply by each b, the transfer of
// one piece overlapping the multiply of the previous one (schedule: fastmesh/pipeline.h), or, as the call's
// plan says, the whole gather and then one multiply per b.
//
// The kernel only talks to c10d through its ProcessGroup, so the same code runs on CPU tensors (gloo: a
// wait blocks the host until the piece has arrived) and on CUDA tensors (NCCL: the transfers run on
// NCCL's stream and a wait makes the current stream wait for that piece, so the host enqueues the
// whole pipeline without blocking).
#include <ATen/ops/empty.h>
#include <ATen/ops/matmul.h>
#include <ATen/ops/mm.h>
#include <ATen/ops/zeros.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "checks.h"
#include "fused_ops.h"
#include "gather_pipeline.h"

namespace fastmesh {
namespace fused {
namespace {

constexpr const char* kOp = "fastmesh::all_gather_matmul";

// gather_dim == last: the gathered dim is the contraction dim, so out = sum_j shard_j @ b[rows of rank j].
// Every rank adds the partial products in rank order, from products of the same shapes, so the
// replicated result is bitwise identical on every rank (low-precision inputs: summed in fp32).
void gather_contraction(const Group& group, const at::Tensor& shard, at::TensorList bs, std::vector<at::Tensor>& outs,
                        std::optional<at::Tensor>& a_full, int64_t pieces) {
  const int64_t world = group->getSize(), rank = group->getRank();
  const int64_t k = shard.size(-1);
  const at::Tensor shard_rows = rows_view(shard);
  const RowLayout layout = pipeline::row_layout(shard_rows.sizes(), 1);  // units = rows
  GatheredPieces gathered(group, kOp, shard_rows, layout, pieces);

  auto b_part = [&](size_t i, int64_t j) { return bs[i].narrow(0, j * k, k); };
  // The local partial products, per piece, while the first pieces travel.
  std::vector<std::vector<at::Tensor>> own(gathered.pieces.size());
  for (size_t p = 0; p < gathered.pieces.size(); ++p) {
    const Piece piece = gathered.pieces[p];
    for (size_t i = 0; i < bs.size(); ++i)
      own[p].push_back(at::mm(shard_rows.narrow(0, piece.unit_begin, piece.units()), b_part(i, rank)));
  }
  std::vector<at::Tensor> out_rows;
  for (const at::Tensor& out : outs) out_rows.push_back(rows_view(out));
  at::Tensor a_parts;
  if (a_full) {
    a_parts = a_full->view({-1, world, k});
    a_parts.select(1, rank).copy_(shard_rows);
  }
  for (size_t p = 0; p < gathered.pieces.size(); ++p) {
    const Piece piece = gathered.pieces[p];
    const std::vector<at::Tensor>& received = gathered.wait(p);
    for (size_t i = 0; i < bs.size(); ++i) {
      std::vector<at::Tensor> partials;
      for (int64_t j = 0; j < world; ++j) partials.push_back(j == rank ? own[p][i] : at::mm(received[j], b_part(i, j)));
      sum_in_order(out_rows[i].narrow(0, piece.unit_begin, piece.units()), partials);
    }
    if (a_full) {
      for (int64_t j = 0; j < world; ++j) {
        if (j != rank) a_parts.select(1, j).narrow(0, piece.unit_begin, piece.units()).copy_(received[j]);
      }
    }
  }
}

}  // namespace

std::tuple<std::optional<at::Tensor>, std::vector<at::Tensor>> all_gather_matmul(const at::Tensor& a_shard,
                                                                                 at::TensorList bs, int64_t gather_dim,
                                                                                 c10::string_view group_name,
                                                                                 bool return_a, int64_t pieces,
                                                                                 c10::string_view split) {
  check_tensor(a_shard, kOp, "a_shard", kMatmulDtypes, 1);
  const int64_t dim = wrap_dim(gather_dim, a_shard.dim(), kOp, "gather_dim", "a_shard");
  check_pieces(pieces, kOp);
  const pipeline::Split schedule = check_split(split, kOp);
  TORCH_CHECK_VALUE(schedule != pipeline::Split::kColumns, kOp,
                    ": split \"columns\" is a reduce-scatter schedule; an all-gather takes \"rows\" or \"none\"");
  TORCH_CHECK_VALUE(!bs.empty(), kOp, ": bs must hold at least one matrix, got an empty list");
  const Group group = resolve_group(group_name, kOp);
  const int64_t world = group->getSize();
  const bool contraction = dim == a_shard.dim() - 1;
  // The contraction's partial products are summed in rank order whatever the plan (bitwise the same on every
  // rank), so its only schedule is pieces of rows.
  TORCH_CHECK_VALUE(!contraction || schedule == pipeline::Split::kRows, kOp,
                    ": gathering the last dim takes split \"rows\" only, got \"", std::string(split), '"');
  const int64_t k_full = contraction ? a_shard.size(-1) * world : a_shard.size(-1);
  for (size_t i = 0; i < bs.size(); ++i) {
    const std::string arg = "bs[" + std::to_string(i) + "]";
    check_tensor(bs[i], kOp, arg, kMatmulDtypes, 2, 2);
    check_like(bs[i], a_shard, kOp, arg, "a_shard");
    TORCH_CHECK_VALUE(bs[i].size(0) == k_full, kOp, ": ", arg, " must have ", k_full, " rows (the last dim of ",
                      contraction ? "the gathered a: a_shard's last dim times the group size " + std::to_string(world)
                                  : std::string("a_shard"),
                      "), got shape ", bs[i].sizes());
  }

  const std::vector<int64_t> full_sizes = with_size(a_shard.sizes(), dim, a_shard.size(dim) * world);
  std::optional<at::Tensor> a_full;
  std::vector<at::Tensor> outs;
  if (world == 1) {
    for (const at::Tensor& b : bs) outs.push_back(at::matmul(a_shard, b));
    if (return_a) a_full = a_shard.clone();
    return {a_full, outs};
  }

  const int64_t last = a_shard.dim() - 1;
  for (const at::Tensor& b : bs) {
    outs.push_back(at::empty(with_size(full_sizes, last, b.size(1)), a_shard.options()));
  }
  if (return_a) a_full = at::empty(full_sizes, a_shard.options());
  if (a_shard.numel() == 0) {
    // Same shapes on every rank (checked), so every rank skips the transfer. The products are sums over
    // an empty contraction dim, or empty themselves.
    for (at::Tensor& out : outs) out.zero_();
    return {a_full, outs};
  }
  const at::Tensor shard = a_shard.contiguous();
  if (contraction) {
    gather_contraction(group, shard, bs, outs, a_full, pieces);
    return {a_full, outs};
  }
  const RowLayout layout = pipeline::row_layout(shard.sizes(), dim);
  if (schedule == pipeline::Split::kNone) {  // the whole gather, then one multiply per b (b read once)
    const at::Tensor gathered = a_full ? *a_full : at::empty(full_sizes, a_shard.options());
    if (layout.outer == 1 && !point_to_point(group, shard.device())) {
      // The ranks' rows are consecutive blocks of the gathered a, as the collective lays them out: one all-gather
      // straight into it, the unfused sequence itself.
      at::Tensor flat = gathered.view({-1, shard.size(-1)});
      at::Tensor shard_rows = rows_view(shard);
      InFlight transfer(group, kOp);
      transfer.add({start_all_gather(group, flat, shard_rows)});
      transfer.wait(0);
    } else {
      const at::Tensor blocks = rank_blocks_view(gathered, layout, world);
      gather_rows(group, kOp, shard, dim, &blocks, 1, [](int64_t, Piece, const at::Tensor&) {});
    }
    for (size_t i = 0; i < bs.size(); ++i) at::matmul_out(outs[i], gathered, bs[i]);
    return {a_full, outs};
  }
  std::vector<at::Tensor> out_blocks;
  for (const at::Tensor& out : outs) out_blocks.push_back(rank_blocks_view(out, layout, world));
  const at::Tensor a_blocks = a_full ? rank_blocks_view(*a_full, layout, world) : at::Tensor();
  gather_rows(group, kOp, shard, dim, a_full ? &a_blocks : nullptr, pieces,
              [&](int64_t j, Piece piece, const at::Tensor& rows) {
                for (size_t i = 0; i < bs.size(); ++i)
                  matmul_into(rank_block(out_blocks[i], layout, j, piece), rows, bs[i]);
              });
  return {a_full, outs};
}

}  // namespace fused
}  // namespace fastmesh
