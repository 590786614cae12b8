"""The fds torchshm keeps leave the process's own fd numbers where they would
be without it (Note [Kept fds above select's range] in
csrc/lifetime/segment.h): a worker whose Dataset caches born arrays, or a
sender whose sent arrays keep one copy each, can still select() on a socket
it opens, under the usual soft limit of 1024."""

import pytest

from tests.conftest import run_script

pytestmark = pytest.mark.multiprocess

# The usual limits of a login shell: soft 1024, hard 20000 (or this machine's
# hard limit, if lower; torchshm's kept fds need one above 1024).
LIMITS = """
import resource
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
hard = min(hard, 20000) if hard != resource.RLIM_INFINITY else 20000
resource.setrlimit(resource.RLIMIT_NOFILE, (1024, hard))
"""

# What a user's code sees when it opens a pipe and select()s it.
SELECT = """
import os, select

def select_a_new_pipe():
    r, w = os.pipe()
    try:
        select.select([r], [], [], 0)
        return {"fd": r, "failed": False}
    except ValueError:
        return {"fd": r, "failed": True}
    finally:
        os.close(r)
        os.close(w)

def kept_fds():
    return [int(fd) for fd in os.listdir("/proc/self/fd")]
"""

CACHING_DATASET = (
    LIMITS
    + SELECT
    + """
import json, sys
import numpy as np
import torchshm
from torch.utils.data import DataLoader, Dataset

ITEMS, ITEM_BYTES = 1200, 300 << 10

class Caching(Dataset):
    # Decodes each sample once and keeps it, as many Datasets do.
    def __init__(self):
        self.cache = []

    def __len__(self):
        return ITEMS

    def __getitem__(self, i):
        self.cache.append(np.full(ITEM_BYTES, i % 251, dtype=np.uint8))
        seen = select_a_new_pipe()
        seen["born shared"] = torchshm.is_shared(self.cache[-1])
        seen["highest fd"] = max(kept_fds())
        return seen

if __name__ == "__main__":
    loader = DataLoader(
        Caching(), batch_size=None, num_workers=1,
        multiprocessing_context=sys.argv[1],
    )
    items = list(loader)
    print(json.dumps({
        "items": len(items),
        "select failures": sum(s["failed"] for s in items),
        "highest user fd": max(s["fd"] for s in items),
        "born shared": sum(s["born shared"] for s in items),
        "highest fd": max(s["highest fd"] for s in items),
    }))
"""
)


@pytest.mark.parametrize("method", ["fork", "spawn"])
def test_a_worker_caching_born_arrays_can_select_on_its_own_fds(tmp_path, method):
    result = run_script(tmp_path, CACHING_DATASET, method)
    # Every cached array was born shared, an fd kept for each...
    assert result["items"] == result["born shared"] == 1200, result
    assert result["highest fd"] >= 1200, result
    # ... and the worker's own pipes stayed where select() reaches them.
    assert result["select failures"] == 0, result
    assert result["highest user fd"] < 1024, result


KEEPING_SENDER = (
    LIMITS
    + SELECT
    + """
import json
import multiprocessing as mp
import numpy as np
import torchshm

SENT, SENT_BYTES = 60, 4 << 20  # each sent array keeps its copy's segment

def receive(q, n):
    for _ in range(n):
        q.get()

if __name__ == "__main__":
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=receive, args=(q, SENT))
    child.start()
    low_before = sum(fd < 1024 for fd in kept_fds())
    kept = [np.full(SENT_BYTES, i % 251, dtype=np.uint8) for i in range(SENT)]
    for a in kept:
        q.put(a)
    q.close()
    q.join_thread()
    child.join()
    seen = select_a_new_pipe()
    fds = kept_fds()
    print(json.dumps({
        "exitcode": child.exitcode,
        "one copies held": torchshm._C.one_copy_held(),
        "select failed": seen["failed"],
        "fds below 1024 added": sum(fd < 1024 for fd in fds) - low_before,
        "fds at 1024 and up": sum(fd >= 1024 for fd in fds),
    }))
"""
)


def test_a_sender_keeping_what_it_sent_keeps_its_fds_above_selects_range(tmp_path):
    result = run_script(tmp_path, KEEPING_SENDER)
    assert result["exitcode"] == 0, result
    assert result["one copies held"] == 60, result
    assert result["fds at 1024 and up"] >= 60, result
    # The keeper's connection and the session table's: a few, once.
    assert result["fds below 1024 added"] <= 4, result
    assert not result["select failed"], result
