// The Python module fastmesh._C. Kernels register themselves with the dispatcher from their own files
// (TORCH_LIBRARY_IMPL); this file only exposes what Python needs to know about the build.
#include <pybind11/pybind11.h>

#include <pybind11/stl.h>

#include <utility>
#include <vector>

#include "fastmesh/build_info.h"  // generated at build time by fastmesh/_build_config.py
#include "fastmesh/pipeline.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastmesh C++/CUDA kernels (registered under torch.ops.fastmesh)";
  m.def("build_info", [] { return std::string(fastmesh::kBuildInfoJson); },
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
}
