// Block views and block multiplies shared by the fused collectives.
//
// A tensor that is the concatenation of `world` rank blocks along a dim (the gathered input, the
// scattered product) is viewed as [P, world, Q, C]: P = product of the dims before that dim, Q = the rest
// of one rank's rows, C the last dim. A pipeline piece (pipeline.h) covers units [u0, u1) of every rank's
// block; rank_block() is the part of rank j, as a batch of matrices [B, rows, C] with unit stride in C.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/ops/add.h>
#include <ATen/ops/bmm.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/mm.h>

#include <vector>

#include "fastmesh/pipeline.h"

namespace fastmesh {
namespace fused {

// `t` as a matrix [product of the leading dims, last dim] (a view; also for an empty last dim, where
// view({-1, 0}) is ambiguous).
inline at::Tensor rows_view(const at::Tensor& t) {
  int64_t rows = 1;
  for (int64_t i = 0; i + 1 < t.dim(); ++i) rows *= t.size(i);
  return t.view({rows, t.size(-1)});
}

inline at::Tensor rank_blocks_view(const at::Tensor& t, const pipeline::RowLayout& layout, int64_t world) {
  return t.view({layout.outer, world, layout.inner, t.size(-1)});
}

// [B, rows, C] part of rank `rank` of a [P, world, Q, C] view covering `piece`.
inline at::Tensor rank_block(const at::Tensor& blocks, const pipeline::RowLayout& layout, int64_t rank,
                             pipeline::Piece piece) {
  if (layout.outer == 1)
    return blocks.select(0, 0).select(0, rank).narrow(0, piece.unit_begin, piece.units()).unsqueeze(0);
  return blocks.narrow(0, piece.unit_begin, piece.units()).select(1, rank);
}

// A contiguous [rows, C] piece as the [B, rows', C] batch rank_block() gives for the same piece. (Sizes are
// computed, not inferred with -1: C may be 0.)
inline at::Tensor as_block(const at::Tensor& piece_rows, const pipeline::RowLayout& layout) {
  const int64_t rows = piece_rows.size(0);
  if (layout.outer == 1) return piece_rows.view({1, rows, piece_rows.size(-1)});
  return piece_rows.view({layout.inner > 0 ? rows / layout.inner : 0, layout.inner, piece_rows.size(-1)});
}

// A [batch, rows, cols] tensor as one [batch * rows, cols] matrix, when its batch stride continues its row
// stride (a strided matrix BLAS takes as it is); undefined otherwise.
inline at::Tensor folded_rows(const at::Tensor& t) {
  if (t.size(0) == 1 || t.stride(0) == t.size(1) * t.stride(1)) return t.view({t.size(0) * t.size(1), t.size(2)});
  return at::Tensor();
}

// out[i] = a[i] @ mat for every batch entry, written in place: `out` may be strided in its batch and row
// dims (BLAS takes the leading dimension as it is, no temporary). On CPU one mm when the batch folds into the
// rows, else one mm per entry: bmm would take `mat` expanded over the batch, which CPU bmm copies into a
// contiguous [batch, K, N] tensor for bf16/fp16 (profiled: ~13% of a bf16 Llama block step in copies) and
// runs slower than mm for fp32. CUDA's batched GEMM takes the zero batch stride as it is.
inline void matmul_into(at::Tensor out, const at::Tensor& a, const at::Tensor& mat) {
  if (out.is_cuda()) {
    at::bmm_out(out, a, mat.expand({a.size(0), mat.size(0), mat.size(1)}));
    return;
  }
  at::Tensor out_rows = folded_rows(out);
  at::Tensor a_rows = folded_rows(a);
  if (out_rows.defined() && a_rows.defined()) {
    at::mm_out(out_rows, a_rows, mat);
    return;
  }
  for (int64_t i = 0; i < a.size(0); ++i) {
    at::Tensor out_matrix = out.select(0, i);
    at::mm_out(out_matrix, a.select(0, i), mat);
  }
}

// out = parts[0] + parts[1] + ... added in this order, so that every rank that adds the same parts in the
// same order gets the same bits. bf16/fp16 parts are added in fp32 and rounded once.
inline void sum_in_order(at::Tensor out, const std::vector<at::Tensor>& parts) {
  if (parts.size() == 2) {
    // One pass; a bf16/fp16 add computes in fp32 and rounds once, as the general path does.
    at::add_out(out, parts[0], parts[1]);
    return;
  }
  const bool exact_dtype = out.scalar_type() == at::kFloat || out.scalar_type() == at::kDouble;
  at::Tensor sum = exact_dtype ? out : at::empty(out.sizes(), out.options().dtype(at::kFloat));
  sum.copy_(parts[0]);
  for (size_t i = 1; i < parts.size(); ++i) sum.add_(parts[i]);
  if (!exact_dtype) out.copy_(sum);
}

}  // namespace fused
}  // namespace fastmesh
