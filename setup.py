"""Builds torchshm's native extension against the torch and numpy in use."""

import glob
import json
import os

import numpy
import torch
from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CppExtension

HERE = os.path.dirname(os.path.abspath(__file__))

# Recorded so that an import against another torch names both versions.
with open(os.path.join(HERE, "torchshm", "_build_info.json"), "w") as f:
    json.dump({"torch": torch.__version__, "numpy": numpy.__version__}, f)

setup(
    ext_modules=[
        CppExtension(
            "torchshm._C",
            sorted(glob.glob("csrc/*.cpp")),
            include_dirs=[numpy.get_include()],
            define_macros=[
                ("TORCHSHM_TORCH_VERSION", f'"{torch.__version__}"'),
                ("TORCHSHM_NUMPY_VERSION", f'"{numpy.__version__}"'),
            ],
            # -g0: no debug info for torch's headers, which every file
            # includes (a fifth to a third of the compile time, measured).
            extra_compile_args=["-O3", "-g0", "-std=c++17"],
            libraries=["rt"],
        )
    ],
    cmdclass={"build_ext": BuildExtension},
)
