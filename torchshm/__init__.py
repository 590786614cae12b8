"""torchshm: NumPy arrays between processes through torch shared memory.

`import torchshm` registers reducers with multiprocessing's ForkingPickler:
every non-object ndarray of at least get_threshold() bytes that a Queue, Pipe,
Pool or DataLoader sends travels through shared memory and is rebuilt on the
receiving side without a copy. Set TORCHSHM_DISABLE=1 to import without
registering.
"""

import torch  # noqa: F401  - loads libtorch before the extension

from torchshm._compat import load_native

_C = load_native()

from torchshm import _config  # noqa: E402
from torchshm._config import get_threshold, set_threshold  # noqa: E402
from torchshm._dataloader import (  # noqa: E402
    collate,
    convert,
    worker_init_fn,
)
from torchshm._handles import HandleError, dumps, loads, release  # noqa: E402
from torchshm._reduction import is_shared  # noqa: E402
from torchshm._registry import (  # noqa: E402
    disabled,
    is_registered,
    register,
    unregister,
)
from torchshm._share import share  # noqa: E402
from torchshm._segments import trim  # noqa: E402
from torchshm._stats import reset_stats, stats  # noqa: E402
from torchshm._torchdata import (  # noqa: E402
    datapipe_worker_init_fn,
    in_workers,
    map_fn,
    share_memory,
)
from torchshm._version import __version__  # noqa: E402, F401

__all__ = [
    "collate",
    "convert",
    "datapipe_worker_init_fn",
    "disabled",
    "dumps",
    "get_threshold",
    "HandleError",
    "in_workers",
    "is_registered",
    "is_shared",
    "loads",
    "map_fn",
    "register",
    "release",
    "reset_stats",
    "set_threshold",
    "share",
    "share_memory",
    "stats",
    "trim",
    "unregister",
    "worker_init_fn",
]

if not _config.registration_disabled():
    register()
