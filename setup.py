"""Builds ``fastmesh._C`` from ``csrc/`` with ninja through ``torch.utils.cpp_extension``.

Install with ``pip install --no-build-isolation .`` (or ``-e .``): the extension must be compiled
against the torch that is already installed, not a second copy pulled into an isolated build
environment. What is built and why is decided in ``fastmesh/_build_config.py``, which the JIT path
(``FASTMESH_JIT=1``) shares.
"""

import importlib.util
import os
import sys

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _load_build_config():
    path = os.path.join(ROOT, "fastmesh", "_build_config.py")
    spec = importlib.util.spec_from_file_location("fastmesh_build_config", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the file executes
    spec.loader.exec_module(module)
    return module


def _missing_torch_message() -> str:
    return (
        "fastmesh builds against the installed torch: install torch first, then build without "
        "isolation: pip install torch && pip install --no-build-isolation ."
    )


def extension_and_cmdclass():
    try:
        import torch  # noqa: F401
    except ImportError as error:
        raise RuntimeError(_missing_torch_message()) from error

    config = _load_build_config()
    plan = config.plan_build(ROOT)
    config.configure_cuda_environment(plan)
    print(f"fastmesh: {plan.reason}", flush=True)

    from torch.utils.cpp_extension import BuildExtension, CppExtension, CUDAExtension, is_ninja_available

    if not is_ninja_available():
        raise RuntimeError("fastmesh builds with ninja: pip install ninja")

    class BuildWithInfo(BuildExtension):
        """Writes the build-metadata header into the build folder before compiling."""

        def finalize_options(self):
            super().finalize_options()
            if getattr(self, "editable_mode", False) or self.inplace:
                # setuptools gives each editable build a new temporary build folder, so a second
                # `pip install -e` (the README's test command after its install command) recompiled every
                # source; in a fixed folder ninja rebuilds only what changed.
                self.build_temp = os.path.join(ROOT, "build", "editable")

        def build_extensions(self):
            generated = os.path.join(os.path.abspath(self.build_temp), "fastmesh_generated")
            config.write_if_changed(
                os.path.join(generated, "fastmesh", "build_info.h"), config.build_info_header(plan, ROOT)
            )
            for extension in self.extensions:
                extension.include_dirs.append(generated)
            super().build_extensions()

    extension_type = CUDAExtension if plan.build_cuda else CppExtension
    extra_compile_args = {"cxx": plan.cxx_flags}
    if plan.build_cuda:
        extra_compile_args["nvcc"] = plan.nvcc_flags
    extension = extension_type(
        name="fastmesh._C",
        sources=plan.sources,
        include_dirs=[os.path.join(ROOT, d) for d in plan.include_dirs],
        define_macros=[("FASTMESH_WITH_CUDA", "1" if plan.build_cuda else "0")],
        extra_compile_args=extra_compile_args,
        extra_link_args=plan.link_flags,
    )
    return [extension], {"build_ext": BuildWithInfo.with_options(use_ninja=True)}


ext_modules, cmdclass = extension_and_cmdclass()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
