"""What `python -m torchshm` says when torchshm's native extension cannot
load (torch swapped under it, a wheel for another torch, a broken build):
the versions it was built for and the ones installed, the error, and both
remedies. The doctor is how a user finds out why the import fails, so it
must not die with it (torchshm/_native.py runs this instead of raising)."""

import json
import os
import platform
import sys

import numpy as np
import torch

from torchshm import _compat
from torchshm._version import __version__


def report(error):
    """The findings, as a dict."""
    built = _compat.build_info()
    return {
        "torchshm": __version__,
        "torchshm_path": os.path.dirname(os.path.abspath(__file__)),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "torch": {"running": torch.__version__, "built_for": built.get("torch")},
        "numpy": {"running": np.__version__, "built_for": built.get("numpy")},
        "native_extension": "cannot load",
        "error": str(error),
        "remedies": [
            f"rebuild it in this environment: {_compat.REBUILD}",
            _compat.wheel_remedy(),
        ],
    }


def format_report(info):
    built_torch = info["torch"]["built_for"] or "unknown (no _build_info.json)"
    built_numpy = info["numpy"]["built_for"] or "unknown"
    lines = [
        f"torchshm {info['torchshm']} ({info['torchshm_path']})",
        f"Python   {info['python']} ({info['python_executable']})",
        f"torch    {info['torch']['running']} installed; the extension was built"
        f" for torch {built_torch}",
        f"numpy    {info['numpy']['running']} installed; the extension was built"
        f" for numpy {built_numpy}",
        "",
        "torchshm's native extension cannot load here, so nothing else can be"
        " checked (the sessions, the round trip):",
        f"  {info['error']}",
        "",
        "Either remedy:",
    ]
    lines += [f"  - {remedy}" for remedy in info["remedies"]]
    return "\n".join(lines)


def main(error):
    """Prints the report (JSON with --json); 1, as the exit status."""
    info = report(error)
    if "--json" in sys.argv[1:]:
        print(json.dumps(info, indent=1))
    else:
        print(format_report(info))
    return 1
