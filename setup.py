"""Builds torchshm's native extension against the torch and numpy in use."""

import glob
import json
import os
import re

import sys

try:
    import torch  # first: the one a bare environment lacks, named below
    import numpy
except ImportError as exc:
    # pip's isolated build environment (pyproject.toml lists neither), or an
    # environment that has no torch at all: each needs its own remedy.
    # pip's build environment is a folder of its own on sys.path, without
    # the site-packages (as python -S).
    if sys.flags.no_site or any("pip-build-env" in entry for entry in sys.path):
        raise SystemExit(
            "torchshm builds against the torch and numpy of the environment it"
            f" is installed into, and this build cannot import them ({exc}):"
            " pip's isolated build environment holds neither, even where they"
            " are installed. In torchshm's source folder: pip install"
            " --no-build-isolation --no-deps ."
        ) from None
    raise SystemExit(
        f"torchshm builds against the torch and numpy of the environment it is"
        f" installed into, and this environment ({sys.executable}) has no"
        f" {exc.name or 'torch'}: install torch and numpy there first (pip"
        " install torch numpy), then, in torchshm's source folder: pip install"
        " --no-build-isolation --no-deps ."
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


CSRC = os.path.join(HERE, "csrc")


def translation_units():
    """csrc/ compiled as two translation units, not one per file: each file
    of csrc/ that uses torch pays about 10 s to parse and instantiate torch's
    and pybind11's headers, whatever its own size; two units pay it twice and
    keep both cores busy (a clean build on 2 cores: 25-33 s and 0.7 GB per
    compiler, against 18 such files' 124 s; `python -m benchmarks.build_cost`
    measures it). Each unit is a file of #includes written under build/, so
    that a compiler error still names the file and line in csrc/. A name
    private to one file (static, or in an anonymous namespace) must not be
    reused by another of its unit: that is a compile error, or an overload
    that the other file may pick (tests/test_native_build.py)."""
    files = sorted(
        os.path.relpath(p, CSRC)
        for p in glob.glob(os.path.join(CSRC, "**", "*.cpp"), recursive=True)
    )
    # The bindings' unit: the files on top of csrc/ (module.cpp and the parts
    # it calls in bindings.h); the wings below them are the mechanism's.
    units = {
        "bindings": [f for f in files if os.sep not in f],
        "mechanism": [f for f in files if os.sep in f],
    }
    folder = os.path.join(HERE, "build", "units")
    os.makedirs(folder, exist_ok=True)
    sources = []
    for name, members in units.items():
        path = os.path.join(folder, f"{name}.cpp")
        text = "// Written by setup.py (translation_units): edit csrc/, not this.\n"
        text += "".join(f'#include "../../csrc/{m}"\n' for m in members)
        # Rewritten only when it changes, so that ninja rebuilds only what did.
        if _read(path) != text:
            with open(path, "w") as f:
                f.write(text)
        sources.append(os.path.relpath(path, HERE))
    return sources


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except FileNotFoundError:
        return None


def version():
    """torchshm/_version.py's version (read, not imported: torchshm's import
    needs its extension). A wheel made for others (`make wheel` sets
    TORCHSHM_TORCH_LABEL=1) adds the torch it was built for as a local
    label, 0.1.0+torch2.14, so that its name says what it runs with: the
    extension imports only beside that torch's major.minor
    (torchshm/_compat.py, check_native)."""
    text = _read(os.path.join(HERE, "torchshm", "_version.py"))
    base = re.search(r'^__version__ = "([^"]+)"', text, re.M).group(1)
    if os.environ.get("TORCHSHM_TORCH_LABEL", "0") in ("", "0"):
        return base
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    return f"{base}+torch{major}.{minor}"


def requirements():
    """What the package needs at run time. A wheel made for others (the
    torch label) needs the torch minor it was built against, so that pip
    refuses it beside another torch (the extension would not import), and,
    built against NumPy 1, NumPy 1 (NumPy 2's ABI runs on 1.x, not the
    reverse: torchshm/_compat.py, check_native)."""
    if os.environ.get("TORCHSHM_TORCH_LABEL", "0") in ("", "0"):
        # 1.13.0a0: Debian builds torch 1.13.1 with that version string.
        return ["torch>=1.13.0a0", "numpy>=1.24"]
    major, minor = re.match(r"(\d+)\.(\d+)", torch.__version__).groups()
    numpy_major = int(numpy.__version__.split(".")[0])
    numpy_range = "numpy>=1.24,<2" if numpy_major < 2 else "numpy>=1.24"
    return [f"torch=={major}.{minor}.*", numpy_range]


# Recorded so that an import against another torch names both versions.
with open(os.path.join(HERE, "torchshm", "_build_info.json"), "w") as f:
    json.dump({"torch": torch.__version__, "numpy": numpy.__version__}, f)

setup(
    version=version(),
    install_requires=requirements(),
    ext_modules=[
        CppExtension(
            "torchshm._C",
            translation_units(),
            # Files of csrc/ include each other by their path from it.
            include_dirs=[CSRC, numpy.get_include()],
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
