// The Python module fastmesh._C. The FP8 cast kernels register themselves with the dispatcher from their own
// files (TORCH_LIBRARY_IMPL); this file exposes what Python needs to know about the build and the pipeline
// schedule, and the fused collectives, whose kernels are Python functions that pick a plan per call
// (fastmesh/ops/plans.py) and run it through these.
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>
#include <torch/python.h>

#include <optional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/cast_loops.h"
#include "fastmesh/build_info.h"  // generated at build time by fastmesh/_build_config.py
#include "fastmesh/mx_math.h"
#include "fastmesh/pipeline.h"
#include "fused/fused_ops.h"
#include "fused/kernels.h"
#include "fused/planned.h"
#include "fused/process_group.h"
#include "fused/scaled.h"
#include "fused/settings.h"

namespace {

// The arguments of the test hooks on the bf16 MX lanes: a contiguous bf16 CPU x of `dims` dims, one contiguous
// float32 multiplier per block (`blocks` of them), an FP8 dtype.
void check_mx_lanes_args(const char* hook, const at::Tensor& x, const at::Tensor& q, at::ScalarType dtype, int64_t dims,
                         int64_t blocks) {
  TORCH_CHECK_VALUE(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && x.dim() == dims && x.is_contiguous(),
                    hook, ": x must be a contiguous ", dims, "-D bfloat16 CPU tensor, got ", x.toString(), " of shape ",
                    x.sizes());
  TORCH_CHECK_VALUE(
      q.device().is_cpu() && q.scalar_type() == at::kFloat && q.dim() == 1 && q.is_contiguous() && q.numel() == blocks,
      hook, ": q must be a contiguous 1-D float32 CPU tensor of one multiplier per block of x (", blocks, "), got ",
      q.toString(), " of shape ", q.sizes());
  TORCH_CHECK_VALUE(dtype == at::kFloat8_e4m3fn || dtype == at::kFloat8_e5m2, hook,
                    ": dtype must be torch.float8_e4m3fn or torch.float8_e5m2, got ", dtype);
}

template <typename Fn>
auto with_fp8_format(at::ScalarType dtype, Fn&& fn) {
  return dtype == at::kFloat8_e4m3fn ? fn(fastmesh::cpu::E4M3{}) : fn(fastmesh::cpu::E5M2{});
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastmesh C++/CUDA kernels (registered under torch.ops.fastmesh)";
  m.def(
      "build_info", [] { return std::string(fastmesh::kBuildInfoJson); },
      "JSON text recorded when this extension was built: versions, sources, flags, CUDA settings.");
  m.def(
      "pipeline_pieces",
      [](int64_t units, int64_t unit_bytes, int64_t requested) {
        std::vector<std::pair<int64_t, int64_t>> out;
        const int64_t count = fastmesh::pipeline::choose_pieces(units, unit_bytes, requested);
        for (const auto& piece : fastmesh::pipeline::split_units(units, count)) {
          out.emplace_back(piece.unit_begin, piece.unit_end);
        }
        return out;
      },
      "The fused collectives' pipeline pieces (fastmesh/pipeline.h) as [(first unit, end unit)] for a shard of "
      "`units` units of `unit_bytes` bytes, with `requested` pieces (0: chosen from the size).",
      pybind11::arg("units"), pybind11::arg("unit_bytes"), pybind11::arg("requested"));
  m.def(
      "gather_row_pieces",
      [](const std::vector<int64_t>& sizes, int64_t dim, int64_t element_size, int64_t requested) {
        const fastmesh::pipeline::RowLayout layout = fastmesh::pipeline::row_layout(sizes, dim);
        const int64_t k = sizes.back();
        std::vector<std::pair<int64_t, int64_t>> out;
        const int64_t count =
            fastmesh::pipeline::choose_pieces(layout.units, layout.unit_rows * k * element_size, requested);
        for (const auto& piece : fastmesh::pipeline::split_units(layout.units, count)) {
          out.emplace_back(piece.unit_begin * layout.unit_rows, piece.unit_end * layout.unit_rows);
        }
        return out;
      },
      "The pipeline pieces of all_gather_matmul for a contiguous shard of `sizes` gathered along `dim` (not "
      "the last), as [(first row, end row)] of the shard's rows (leading dims flattened): the pieces the CPU "
      "kernel sends, with `requested` pieces (0: chosen from the size).",
      pybind11::arg("sizes"), pybind11::arg("dim"), pybind11::arg("element_size"), pybind11::arg("requested"));
  // The fused collectives, with the schedule the ops' kernels chose (fastmesh/ops/plans.py). The GIL is
  // released: a call waits on its peers for as long as the group's timeout.
  const auto gil = pybind11::call_guard<pybind11::gil_scoped_release>();
  using pybind11::arg;
  m.def(
      "all_gather_matmul",
      [](const at::Tensor& a_shard, const std::vector<at::Tensor>& bs, int64_t gather_dim,
         const std::string& group_name, bool return_a, int64_t pieces, const std::string& split) {
        return fastmesh::fused::all_gather_matmul(a_shard, bs, gather_dim, group_name, return_a, pieces, split);
      },
      "fastmesh::all_gather_matmul with the given schedule (split \"rows\" with `pieces` pieces, or \"none\").",
      arg("a_shard"), arg("bs"), arg("gather_dim"), arg("group_name"), arg("return_a"), arg("pieces"), arg("split"),
      gil);
  m.def(
      "matmul_reduce_scatter",
      [](const at::Tensor& a, const at::Tensor& b, int64_t scatter_dim, const std::string& reduce_op,
         const std::string& group_name, int64_t pieces, const std::string& split) {
        return fastmesh::fused::matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name, pieces, split);
      },
      "fastmesh::matmul_reduce_scatter with the given schedule (split \"rows\", \"columns\" or \"none\").", arg("a"),
      arg("b"), arg("scatter_dim"), arg("reduce_op"), arg("group_name"), arg("pieces"), arg("split"), gil);
  m.def(
      "matmul_all_reduce",
      [](const at::Tensor& a, const at::Tensor& b, const std::string& reduce_op, const std::string& group_name,
         int64_t pieces, const std::string& split) {
        return fastmesh::fused::matmul_all_reduce(a, b, reduce_op, group_name, pieces, split);
      },
      "fastmesh::matmul_all_reduce with the given schedule (split \"rows\" or \"none\").", arg("a"), arg("b"),
      arg("reduce_op"), arg("group_name"), arg("pieces"), arg("split"), gil);
  m.def(
      "matmul_all_gather",
      [](const at::Tensor& a, const at::Tensor& b, const std::string& group_name, int64_t pieces,
         const std::string& split) { return fastmesh::fused::matmul_all_gather(a, b, group_name, pieces, split); },
      "fastmesh::matmul_all_gather with the given schedule (split \"rows\" or \"none\").", arg("a"), arg("b"),
      arg("group_name"), arg("pieces"), arg("split"), gil);
  m.def(
      "all_gather_scaled_matmul",
      [](const at::Tensor& a_shard, const at::Tensor& a_scale, const std::vector<at::Tensor>& bs,
         const std::vector<at::Tensor>& b_scales, int64_t gather_dim, const std::string& group_name,
         at::ScalarType out_dtype, bool return_a, int64_t pieces, const std::string& split) {
        return fastmesh::fused::all_gather_scaled_matmul(a_shard, a_scale, bs, b_scales, gather_dim, group_name,
                                                         out_dtype, return_a, pieces, split);
      },
      "fastmesh::all_gather_scaled_matmul with the given schedule.", arg("a_shard"), arg("a_scale"), arg("bs"),
      arg("b_scales"), arg("gather_dim"), arg("group_name"), arg("out_dtype"), arg("return_a"), arg("pieces"),
      arg("split"), gil);
  m.def(
      "scaled_matmul_reduce_scatter",
      [](const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& b_scale,
         int64_t scatter_dim, const std::string& reduce_op, const std::string& group_name, at::ScalarType out_dtype,
         int64_t pieces, const std::string& split) {
        return fastmesh::fused::scaled_matmul_reduce_scatter(a, a_scale, b, b_scale, scatter_dim, reduce_op, group_name,
                                                             out_dtype, pieces, split);
      },
      "fastmesh::scaled_matmul_reduce_scatter with the given schedule.", arg("a"), arg("a_scale"), arg("b"),
      arg("b_scale"), arg("scatter_dim"), arg("reduce_op"), arg("group_name"), arg("out_dtype"), arg("pieces"),
      arg("split"), gil);
  m.def(
      "scaled_matmul_all_reduce",
      [](const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& b_scale,
         const std::string& reduce_op, const std::string& group_name, at::ScalarType out_dtype, int64_t pieces,
         const std::string& split) {
        return fastmesh::fused::scaled_matmul_all_reduce(a, a_scale, b, b_scale, reduce_op, group_name, out_dtype,
                                                         pieces, split);
      },
      "fastmesh::scaled_matmul_all_reduce with the given schedule (split \"rows\" or \"none\").", arg("a"),
      arg("a_scale"), arg("b"), arg("b_scale"), arg("reduce_op"), arg("group_name"), arg("out_dtype"), arg("pieces"),
      arg("split"), gil);
  m.def(
      "scaled_matmul",
      [](const at::Tensor& a, const at::Tensor& a_scale, const at::Tensor& b, const at::Tensor& b_scale,
         at::ScalarType out_dtype) { return fastmesh::fused::scaled_matmul(a, a_scale, b, b_scale, out_dtype); },
      "fastmesh::scaled_matmul: the fused FP8 ops' scaled multiply alone, local.", arg("a"), arg("a_scale"), arg("b"),
      arg("b_scale"), arg("out_dtype"), gil);
  m.def(
      "block_scaled_mm_runs",
      [](at::ScalarType a_dtype, const at::Tensor& b, at::ScalarType out_dtype, int64_t column_part) {
        using fastmesh::fused::Scaling;
        return fastmesh::fused::block_scaled_mm_runs({Scaling::kBlock, Scaling::kBlock}, a_dtype, b, out_dtype,
                                                     column_part);
      },
      "Whether the scaled fused ops multiply a 1x128-scaled a (of `a_dtype`) by the 128x128-scaled `b` through "
      "torch._scaled_mm, in column slices `column_part` wide, rather than dequantize-and-multiply "
      "(csrc/fused/scaled.h).",
      arg("a_dtype"), arg("b"), arg("out_dtype"), arg("column_part"));
  m.def(
      "check_same_shapes_on_all_ranks",
      [](const std::vector<at::Tensor>& tensors, const std::vector<std::string>& args,
         const std::vector<fastmesh::fused::Option>& options, const std::string& group_name, const std::string& op) {
        fastmesh::fused::check_same_shapes_on_all_ranks(fastmesh::fused::resolve_group(group_name, op.c_str()), tensors,
                                                        args, options, op.c_str());
      },
      "The fused ops' cross-rank check (csrc/fused/process_group.h) of `tensors`' shapes, named `args`, and of "
      "`options` ((name, value as text) pairs): on the first call per op and arguments on CPU groups; on every "
      "call with FASTMESH_SHAPE_CHECK=every or TORCH_DISTRIBUTED_DEBUG=DETAIL.",
      arg("tensors"), arg("args"), arg("options"), arg("group_name"), arg("op"), gil);
  // The plan memo of the fused ops' dispatcher kernels (fused/planned.h), driven by fastmesh/ops/plans.py.
  m.def(
      "set_planner", [](pybind11::object planner) { fastmesh::fused::set_planner(std::move(planner)); },
      "Registers the Python planner the fused ops' kernels call on a key's first call: planner(op, args) -> (result, "
      "(split, pieces, decision id) or None).",
      arg("planner"));
  m.def("forget_plans", &fastmesh::fused::forget_plans,
        "Forgets every remembered plan: each key asks the planner again.");
  m.def("set_plan_memo", &fastmesh::fused::set_plan_memo,
        "Turns the plan memo on or off (off: every call asks the Python planner).", arg("enabled"));
  m.def("reload_settings", &fastmesh::fused::reload_settings,
        "Reads the C++ side's settings (FASTMESH_TRANSPORT, FASTMESH_SHAPE_CHECK) from the environment again.");
  m.def("shape_check_every_call", &fastmesh::fused::checks_every_call,
        "Whether the cross-rank shape check runs on every call (FASTMESH_SHAPE_CHECK=every).");
  m.def(
      "planned_op_names",
      [] {
        std::vector<std::string> names;
        for (int i = 0; i < static_cast<int>(fastmesh::fused::PlannedOp::kCount); ++i) {
          names.emplace_back(fastmesh::fused::planned_op_name(static_cast<fastmesh::fused::PlannedOp>(i)));
        }
        return names;
      },
      "The ops whose C++ kernels remember plans (fused/planned.h), by name: the specs' planned ops.");
  m.def(
      "planned_decision",
      [](const std::string& op) { return fastmesh::fused::planned_decision(fastmesh::fused::planned_op_named(op)); },
      "The planner's id of the latest decision a call of the fused op `op` (\"all_gather_matmul\" ...) took; -1: none.",
      arg("op"));
  m.def(
      "inject_fault", [](int64_t after, const std::string& action) { fastmesh::fused::inject_fault(after, action); },
      "Test-only: after `after` more pipeline pieces of the fused ops have started in this process, the next "
      "one starts and then `action` strikes (\"exit\", \"raise\", \"stall\"; \"none\" disarms): "
      "csrc/fused/process_group.h.",
      arg("after"), arg("action"));
  m.def(
      "mx_bf16_lanes",
      [](const at::Tensor& x, const at::Tensor& q, at::ScalarType dtype) -> std::optional<at::Tensor> {
        check_mx_lanes_args("mx_bf16_lanes", x, q, dtype, 1, x.numel() / fastmesh::kMxBlock);
        TORCH_CHECK_VALUE(x.numel() % fastmesh::kMxBlock == 0,
                          "mx_bf16_lanes: x must hold whole blocks of 32, got shape ", x.sizes());
        at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
        const bool cast = with_fp8_format(dtype, [&](auto format) {
          return fastmesh::cpu::quantize_mx_bf16_lanes(static_cast<const uint16_t*>(x.const_data_ptr()),
                                                       q.const_data_ptr<float>(), q.numel(),
                                                       static_cast<uint8_t*>(out.mutable_data_ptr()), format);
        });
        return cast ? std::optional<at::Tensor>(out) : std::nullopt;
      },
      "Test-only: the CPU MX cast's 16-bit lanes for bf16 rows (csrc/cpu/fp8_quantize.cpp) on their own: "
      "fp8(x[i] * q[i // 32]) for the blocks of the 1-D bf16 `x`, or None where they leave the blocks to the fp32 "
      "loop (quantize_mx_blocks_shifted says when), as the kernel casts a group of blocks.",
      arg("x"), arg("q"), arg("dtype"));
  m.def(
      "mx_bf16_column_lanes",
      [](const at::Tensor& x, const at::Tensor& q, at::ScalarType dtype) {
        check_mx_lanes_args("mx_bf16_column_lanes", x, q, dtype, 2, x.dim() == 2 ? x.size(1) : 0);
        TORCH_CHECK_VALUE(x.size(1) <= fastmesh::kFp8Block, "mx_bf16_column_lanes: x must have at most ",
                          fastmesh::kFp8Block, " columns, got shape ", x.sizes());
        at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
        const int64_t rows = x.size(0), cols = x.size(1);
        const int64_t recast = with_fp8_format(dtype, [&](auto format) {
          return fastmesh::cpu::quantize_mx_columns(
              fastmesh::cpu::Panel<const c10::BFloat16>{x.const_data_ptr<c10::BFloat16>(), rows, cols, cols},
              q.const_data_ptr<float>(),
              fastmesh::cpu::Panel<uint8_t>{static_cast<uint8_t*>(out.mutable_data_ptr()), rows, cols, cols}, format);
        });
        return std::make_tuple(out, recast);
      },
      "Test-only: the column cast of the CPU MX kernel's transposed pass (csrc/cpu/fp8_quantize.cpp) on its own: "
      "fp8(x[r, c] * q[c]) for the 2-D bf16 `x` of at most 128 columns, and how many columns its 16-bit lanes left "
      "to the fp32 loop.",
      arg("x"), arg("q"), arg("dtype"));
}
