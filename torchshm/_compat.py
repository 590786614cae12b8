"""Every difference between torch 1.13-2.x and numpy 1.24-2.x, and every
private attribute of torch, numpy, multiprocessing and threading that
torchshm uses, in one place.

Nothing else in torchshm touches a private attribute or branches on a
version.
"""

import json
import os
import re
import sys
import threading
from multiprocessing import connection, forkserver, queues, util
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch


def _major_minor(version):
    """(major, minor) of a version string such as '1.13.0a0' or '2.5.1+cpu'."""
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match.group(1)), int(match.group(2))) if match else (0, 0)


TORCH_VERSION = _major_minor(torch.__version__)
NUMPY_VERSION = _major_minor(np.__version__)


BUILD_INFO = os.path.join(os.path.dirname(__file__), "_build_info.json")


def _build_info(path=BUILD_INFO):
    """setup.py's record of the versions built for: {} if it is missing, or
    anything but a JSON object of strings."""
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(info, dict):
        return {}
    return {k: v for k, v in info.items() if isinstance(v, str)}


# How to rebuild, wherever the extension does not fit this process: from the
# source folder (no package index carries torchshm), with --no-deps (else pip
# may replace this torch with the newest, a CUDA build of several GB).
REBUILD = (
    "pip install --no-build-isolation --no-deps --force-reinstall SOURCE, SOURCE"
    " being torchshm's source folder (in a checkout: pip install"
    " --no-build-isolation --no-deps -e .)"
)


def wheel_remedy():
    """The other remedy: the wheel made for this torch."""
    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    return (
        f"install the torchshm wheel built for torch {minor}"
        f" (torchshm-*+torch{minor}-*.whl; in a checkout, make wheel"
        f" PYTHON={sys.executable} builds it)"
    )


def launched_as_report():
    """Whether this process is `python -m torchshm ...` (sys.orig_argv: what
    the interpreter was started with)."""
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and b == "torchshm" for a, b in zip(argv, argv[1:]))


def _fits(built):
    """Whether an extension built for `built` (torch and numpy versions)
    runs with this process's."""
    # The numpy 2 ABI runs on numpy 1.x too; a 1.x build does not run on 2.
    return _major_minor(built["torch"]) == TORCH_VERSION and not (
        _major_minor(built["numpy"])[0] < 2 <= NUMPY_VERSION[0]
    )


def _mismatch_message(built, cause=""):
    return (
        f"torchshm's native extension was built for torch {built.get('torch', '?')}"
        f" and numpy {built.get('numpy', '?')}, but this process has torch"
        f" {torch.__version__} and numpy {np.__version__}{cause}. Rebuild it in"
        f" this environment: {REBUILD}; or {wheel_remedy()}. `python -m"
        " torchshm` says what it finds"
    )


def build_info():
    """What setup.py recorded: the torch and numpy the extension was built
    for ({} if it did not)."""
    return _build_info()


def check_native(native):
    """Raises an ImportError naming both versions unless the native module
    `native` was built for this process's torch and numpy, or naming the fix
    if it carries a C++ runtime of its own (Note [One C++ runtime] in
    csrc/base/cxx_runtime.h)."""
    if getattr(native, "own_cxx_runtime", False):
        raise ImportError(
            "torchshm's native module was linked with a C++ runtime of its own"
            " (libstdc++ linked statically, e.g. by a compiler wrapper): torch's"
            " errors cannot cross into it and the first one would crash the"
            " process. Rebuild it with a compiler that links libstdc++"
            f" dynamically, as torch does, e.g. CXX=/usr/bin/g++ {REBUILD}"
        )
    built = {"torch": native.built_with_torch, "numpy": native.built_with_numpy}
    if not _fits(built):
        raise ImportError(_mismatch_message(built))


def native_import_error(exc, built=None):
    """The ImportError for a native module that failed to import at all: a
    version mismatch only where the build record says so; else the file
    itself is missing or damaged."""
    built = _build_info() if built is None else built
    recorded = "torch" in built and "numpy" in built
    if recorded and not _fits(built):
        return ImportError(_mismatch_message(built, f" ({exc})"))
    record = (
        f"built for torch {built['torch']} and numpy {built['numpy']}, which"
        f" fit this process's torch {torch.__version__} and numpy"
        f" {np.__version__}"
        if recorded
        else "without a build record (_build_info.json)"
    )
    return ImportError(
        f"torchshm's native extension cannot be loaded ({exc}): it was"
        f" {record}, so the file is missing, truncated or damaged. Rebuild it"
        f" in this environment: {REBUILD}; or {wheel_remedy()}. `python -m"
        " torchshm` says what it finds"
    )


def untyped_storage(tensor):
    """The tensor's byte storage (torch 2.0 added Tensor.untyped_storage)."""
    if hasattr(tensor, "untyped_storage"):
        return tensor.untyped_storage()
    return tensor.storage()._storage


def int8_tensor_over(storage):
    """A flat int8 tensor viewing all of an untyped storage."""
    return torch.empty(0, dtype=torch.int8).set_(storage)


def numpy_handler_name(array=None):
    """The name of NumPy's memory handler for `array` (or the current one);
    NumPy 2 moved numpy.core to numpy._core."""
    core = getattr(np, "_core", None) or np.core
    get = core.multiarray.get_handler_name
    return get() if array is None else get(array)


# --- multiprocessing: what it keeps private and torchshm needs


def forking_reducers():
    """ForkingPickler's table of reducers by exact type: it has no public
    way to read or remove one."""
    return ForkingPickler._extra_reducers


def forkserver_preload():
    """The forkserver's preload list, or None (no public getter)."""
    return getattr(forkserver._forkserver, "_preload_modules", None)


# The frames that write a pickled message to a Connection: Connection.send
# (Pipe, Pool's queues), SimpleQueue.put, and Queue's feeder thread (_feed).
MESSAGE_WRITERS = (
    connection.Connection.send.__code__,
    queues.SimpleQueue.put.__code__,
    queues.Queue._feed.__code__,
)


def dataloader_get_iterator():
    """The DataLoader method that starts its workers (iter() and, with
    persistent workers, the first epoch)."""
    import torch.utils.data

    return torch.utils.data.DataLoader._get_iterator


def set_dataloader_get_iterator(method):
    import torch.utils.data

    torch.utils.data.DataLoader._get_iterator = method


def dataloader_pin_memory():
    """The function DataLoader's pin thread calls on each batch (a module
    global its loop looks up at each call)."""
    from torch.utils.data._utils import pin_memory

    return pin_memory.pin_memory


def set_dataloader_pin_memory(function):
    from torch.utils.data._utils import pin_memory

    pin_memory.pin_memory = function


def connection_send_bytes():
    """The method every multiprocessing write of a message ends in."""
    return connection.Connection._send_bytes


def set_connection_send_bytes(method):
    connection.Connection._send_bytes = method


def run_finalizers(minpriority=None):
    """Runs multiprocessing's exit finalizers of at least `minpriority`, or
    all of them (then the registry is emptied), as its exit function does."""
    util._run_finalizers(minpriority)


# --- threading: where a process's non-daemon threads are joined


def threading_shutdown():
    """The function that joins a process's non-daemon threads at its end:
    the interpreter calls it before atexit's handlers, a multiprocessing
    child's bootstrap after the finalizers (threading._shutdown on Python
    3.8 to 3.13, called by name each time)."""
    return threading._shutdown


def set_threading_shutdown(function):
    threading._shutdown = function
