"""Every remedy the by-value warning prints works where the user is (Note
[Arrays that arrive by value] in torchshm/_send/arrivals.py): a user's
script that imports torchshm only inside main(), so that spawn and
forkserver workers do not have it, gives its workers the hook exactly as
the warning words it (REMEDIES), and the arrays they return arrive shared,
with no warning. Before, `Pool(initializer=torchshm.worker_init_fn)` raised
in every worker and the Pool replaced them for ever (a hang)."""

import pytest

from tests.conftest import run_script
from torchshm._send import arrivals

pytestmark = pytest.mark.multiprocess

# Workers return 2 MiB arrays: over the size the receiver looks at.
SCRIPT = """
import json, sys, warnings
from concurrent.futures import ProcessPoolExecutor

N = 1 << 18


def make(n):
    import numpy as np
    return np.full(n, 7.0)


def main():
    import multiprocessing as mp
    import torch.utils.data as tud
    import torchshm  # here only: spawn and forkserver workers lack it

    where, method, remedy = sys.argv[1], sys.argv[2], sys.argv[3]
    ctx = mp.get_context(method)
    hook = eval(f"dict({remedy})", {"torchshm": torchshm}) if remedy else {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if where == "DataLoader":
            loader = tud.DataLoader(
                [N, N], batch_size=None, num_workers=1, collate_fn=make,
                multiprocessing_context=ctx, **hook,
            )
            results = list(loader)
        elif where == "multiprocessing.Pool":
            with ctx.Pool(1, **hook) as pool:
                results = pool.map(make, [N, N])
        else:
            with ProcessPoolExecutor(1, mp_context=ctx, **hook) as pool:
                results = list(pool.map(make, [N, N]))
    print(json.dumps({
        "shared": [torchshm.is_shared(r) for r in results],
        "warned": [str(w.message)[:60] for w in caught if "by value" in str(w.message)],
    }))


if __name__ == "__main__":
    main()
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
@pytest.mark.parametrize("where", list(arrivals.REMEDIES))
def test_each_printed_remedy_makes_the_workers_share(tmp_path, where, method):
    got = run_script(tmp_path, SCRIPT, where, method, arrivals.REMEDIES[where])
    assert got == {"shared": [True, True], "warned": []}


POOLS = [where for where in arrivals.REMEDIES if where != "DataLoader"]


@pytest.mark.parametrize("where", POOLS)
def test_without_it_a_pool_sends_by_value_and_the_warning_says_so(tmp_path, where):
    # The control: the problem each remedy fixes is there without it.
    got = run_script(tmp_path, SCRIPT, where, "spawn", "")
    assert got["shared"] == [False, False]
    assert len(got["warned"]) == 1


def test_a_dataloader_gets_the_hook_without_being_given_it(tmp_path):
    # Note [Registration in workers] in torchshm/_dataloader.py: the
    # DataLoader's own remedy is for a loader torchshm's hook cannot reach.
    got = run_script(tmp_path, SCRIPT, "DataLoader", "spawn", "")
    assert got == {"shared": [True, True], "warned": []}


def _send_objects(conn):
    import numpy as np

    records = np.zeros(1 << 16, dtype=[("x", "f8", (3,)), ("tag", "O")])
    records["tag"] = "a tag"
    conn.send(records)  # over 1 MiB: the receiver looks at it


def test_arrays_with_object_fields_are_by_value_by_design_and_say_so(ctx):
    # A sender with torchshm pickles them by value (their elements are
    # Python objects): no warning that it lacked torchshm.
    import warnings

    mine, theirs = ctx.Pipe()
    p = ctx.Process(target=_send_objects, args=(theirs,))
    p.start()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert mine.poll(60)
        records = mine.recv()
    p.join(60)
    assert p.exitcode == 0
    assert records.shape == (1 << 16,) and records["tag"][-1] == "a tag"
    assert not [w for w in caught if "by value" in str(w.message)]
