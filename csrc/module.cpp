// The Python module fastmesh._C. Kernels register themselves with the dispatcher from their own files
// (TORCH_LIBRARY_IMPL); this file only exposes what Python needs to know about the build.
#include <pybind11/pybind11.h>

#include "fastmesh/build_info.h"  // generated at build time by fastmesh/_build_config.py

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fastmesh C++/CUDA kernels (registered under torch.ops.fastmesh)";
  m.def("build_info", [] { return std::string(fastmesh::kBuildInfoJson); },
        "JSON text recorded when this extension was built: versions, sources, flags, CUDA settings.");
}
