"""Builds torchshm's native extension against the torch and numpy in use."""

import glob
import json
import os

try:
    import numpy
    import torch
except ImportError as exc:  # an isolated build: pyproject.toml lists neither
    raise SystemExit(
        "torchshm builds against the torch and numpy of the environment it is"
        f" installed into, and this build cannot import them ({exc}): pip's"
        " isolated build environment holds neither, even where they are"
        " installed. Install them first, then, in torchshm's source folder:"
        " pip install --no-build-isolation --no-deps ."
    ) from None
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))


def cxx_standard_flags():
    """No -std= flag where cpp_extension's own choice is right: it appends the
    standard its torch's headers need (C++17 on torch 2.0-2.13, C++20 from
    2.14, whose ATen.h errors below it) only when no -std= is passed, so an
    explicit flag would win over it. torch 1.x picks C++14, below what csrc/
    is written in."""
    major = int(torch.__version__.split(".")[0])
    return ["-std=c++17"] if major < 2 else []


def optimization_flags():
    """DEBUG=1 builds for gdb: no optimization, debug info, assertions on
    (Python's own flags define NDEBUG). Otherwise optimized, and -g0: no
    debug info for torch's headers, which every file includes (a fifth to a
    third of the compile time, measured)."""
    if os.environ.get("DEBUG", "0") not in ("", "0"):
        return ["-O0", "-g", "-UNDEBUG"]
    return ["-O3", "-g0"]


# Recorded so that an import against another torch names both versions.
with open(os.path.join(HERE, "torchshm", "_build_info.json"), "w") as f:
    json.dump({"torch": torch.__version__, "numpy": numpy.__version__}, f)

setup(
    ext_modules=[
        CppExtension(
            "torchshm._C",
            # Relative to the project, as setuptools wants sources, but
            # found from here: a build started elsewhere finds them too.
            sorted(
                os.path.relpath(p, HERE)
                for p in glob.glob(os.path.join(HERE, "csrc", "*.cpp"))
            ),
            include_dirs=[numpy.get_include()],
            define_macros=[
                ("TORCHSHM_TORCH_VERSION", f'"{torch.__version__}"'),
                ("TORCHSHM_NUMPY_VERSION", f'"{numpy.__version__}"'),
            ],
            # -Wall whatever Python's own flags say. -fvisibility=hidden, as
            # pybind11 asks of its modules: pybind11 3 (torch 2.14 bundles
            # it) hides its own types, and a type of ours that holds a
            # py::object must not be more visible.
            extra_compile_args=optimization_flags()
            + ["-Wall", "-fvisibility=hidden"]
            + cxx_standard_flags(),
            libraries=["rt"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
