"""PyTorch DataLoader workers under fork, spawn and forkserver: NumPy, pandas
and xarray samples arrive equal and in shared memory, unbatched and batched
with torchshm.collate (one segment per batch)."""

import re
import textwrap

import numpy as np
import torch
import pandas as pd
import pytest
import xarray as xr
from torch.utils.data import DataLoader

import torchshm
from tests import integration_children as ic
from tests.conftest import run_script, TIMEOUT
from tests.test_pandas_xarray import assert_all_shared

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
pytestmark = pytest.mark.multiprocess


def load(ctx, dataset, **kwargs):
    loader = DataLoader(
        dataset,
        num_workers=2,
        multiprocessing_context=ctx,
        timeout=TIMEOUT,
        worker_init_fn=torchshm.worker_init_fn,
        **kwargs,
    )
    return list(loader)


def assert_equal(got, sent):
    """Equal, of the same types, all the way down."""
    assert type(got) is type(sent)
    if isinstance(sent, np.ndarray):
        np.testing.assert_array_equal(got, sent)
        assert got.dtype == sent.dtype
    elif isinstance(sent, pd.DataFrame):
        pd.testing.assert_frame_equal(got, sent)
    elif isinstance(sent, (xr.Dataset, xr.DataArray)):
        xr.testing.assert_identical(got, sent)
    elif isinstance(sent, dict):
        assert got.keys() == sent.keys()
        for k in sent:
            assert_equal(got[k], sent[k])
    elif isinstance(sent, (tuple, list)):
        assert len(got) == len(sent)
        for g, s in zip(got, sent):
            assert_equal(g, s)
    else:
        assert got == sent


def test_unbatched_samples_arrive_equal_and_shared(ctx, no_leaks):
    dataset = ic.SampleDataset("mixed", n=len(ic.KINDS))
    received = load(ctx, dataset, batch_size=None, collate_fn=torchshm.convert)
    assert len(received) == len(ic.KINDS)
    for i, got in enumerate(received):
        assert_all_shared(got)
        assert_equal(got, dataset[i])


def test_batches_are_stacked_into_one_segment(ctx, no_leaks):
    dataset = ic.SampleDataset("all", n=5)
    batches = load(ctx, dataset, batch_size=2, collate_fn=torchshm.collate)
    assert [len(b["frame"]) for b in batches] == [2, 2, 1]
    for start, batch in zip((0, 2, 4), batches):
        samples = [dataset[i] for i in range(start, min(start + 2, 5))]
        assert_all_shared(batch)
        assert_equal(batch, torchshm.collate(samples))
        nested = batch["nested"]
        np.testing.assert_array_equal(
            nested["pair"].image, np.stack([s["nested"]["pair"].image for s in samples])
        )
        assert nested["pair"].label.tolist() == list(range(start, start + len(samples)))
        # Frames have no batch form: a list of them.
        assert_equal(batch["frame"], [s["frame"] for s in samples])
        # xarray: what xarray.concat makes, with the batch dimension first.
        for kind in ("dataset", "dataarray"):
            # Today's defaults, named: xarray 2025.08+ warns that they change.
            expected = xr.concat(
                [s[kind] for s in samples],
                "batch",
                coords="different",
                compat="equals",
                join="outer",
            )
            xr.testing.assert_identical(batch[kind], expected.transpose("batch", ...))
        # One segment holds the batch's stacked arrays: they have one owner.
        stacked = [
            batch["array"],
            nested["pair"].image,
            nested["boxes"][0],
            batch["dataset"]["t2m"].values,
            batch["dataarray"].values,
        ]
        assert len({id(a.base) for a in stacked}) == 1


def test_collate_stacks_into_shared_memory_in_process():
    samples = [ic.make_sample("nested", i) for i in range(3)]
    batch = torchshm.collate(samples)
    assert isinstance(batch["pair"], ic.Pair)
    assert batch["pair"].image.shape == (3, 3, 8, 8)
    assert batch["boxes"][0].dtype == np.dtype(">f8")
    assert batch["name"] == ["sample0", "sample1", "sample2"]
    assert torchshm.is_shared(batch["pair"].image)
    assert batch["pair"].image.base is batch["boxes"][1].base
    with pytest.raises(ValueError, match="one shape"):
        torchshm.collate([np.zeros(3), np.zeros(4)])
    with pytest.raises(TypeError, match="torchshm.convert"):
        torchshm.collate(np.zeros(3))
    shifted = [ic.make_dataset(0), ic.make_dataset(0).shift(time=1)]
    with pytest.raises(ValueError, match="equal dimension coordinates"):
        torchshm.collate(
            [s.assign_coords(time=s.time + i) for i, s in enumerate(shifted)]
        )


def test_collate_stacks_tensors_as_the_default_collate_does_into_shared_memory():
    samples = [torch.full((64, 64), float(i)) for i in range(4)]
    batch = torchshm.collate(samples)
    expected = torch.utils.data.default_collate(samples)
    assert isinstance(batch, torch.Tensor) and batch.dtype == expected.dtype
    assert torch.equal(batch, expected)
    assert batch.is_shared() and torchshm.is_shared(batch.numpy())
    nested = torchshm.collate([{"x": t, "y": np.arange(3)} for t in samples])
    assert torch.equal(nested["x"], expected) and nested["y"].shape == (4, 3)
    mixed = torchshm.collate([torch.ones(3, dtype=torch.int32), torch.ones(3)])
    assert mixed.dtype == torch.float32  # promoted, as torch.stack does
    with pytest.raises(ValueError, match="tensors of one shape"):
        torchshm.collate([torch.zeros(3), torch.zeros(4)])


def test_collate_below_the_threshold_uses_ordinary_memory():
    old = torchshm.get_threshold()
    torchshm.set_threshold(1 << 20)
    try:
        batch = torchshm.collate([np.ones(10), np.zeros(10)])
    finally:
        torchshm.set_threshold(old)
    assert not torchshm.is_shared(batch)
    np.testing.assert_array_equal(batch, [np.ones(10), np.zeros(10)])


def test_chain_registers_then_calls_the_users_function():
    calls = []
    init = torchshm.chain(calls.append)
    torchshm.unregister()
    try:
        init(3)
        assert torchshm.is_registered()
    finally:
        torchshm.register()
    assert calls == [3]
    assert torchshm.worker_init_fn(0) is None


def test_hooks_run_inside_disabled_leave_torchshm_off_in_this_process():
    """A hook or map function run in the main process (num_workers=0) inside
    the caller's `with torchshm.disabled()` does not turn torchshm back on."""
    calls = []
    item = {"x": np.ones(100_000)}
    with torchshm.disabled():
        torchshm.worker_init_fn(0)
        torchshm.chain(calls.append)(1)
        assert torchshm.torchdata.to_shared(item) is item
        torchshm.torchdata.register_in_worker(None)
        assert not torchshm.is_registered()
    assert calls == [1] and torchshm.is_registered()


def test_a_worker_forked_inside_disabled_registers_through_its_hook():
    """The block is this process's: a forked worker is a process of its own,
    and its worker_init_fn registers as it does outside the block."""
    loader = DataLoader(
        ic.WorkerReportDataset("frame", n=2),
        batch_size=None,
        num_workers=1,
        multiprocessing_context="fork",
        worker_init_fn=torchshm.chain(ic.record_pid),
        collate_fn=torchshm.convert,
        timeout=TIMEOUT,
    )
    with torchshm.disabled():
        reports = list(loader)
    assert [r["registered"] for r in reports] == [True, True]


def test_worker_init_fn_of_a_function_still_chains_but_is_deprecated():
    calls = []
    with pytest.warns(DeprecationWarning, match=r"torchshm\.chain\(fn\)"):
        init = torchshm.worker_init_fn(calls.append)
    init(5)
    assert calls == [5]


@pytest.mark.parametrize(
    "old,new",
    [
        ("datapipe_worker_init_fn", "torchshm.torchdata.register_in_worker"),
        ("in_workers", "torchshm.torchdata.in_workers"),
        ("share_memory", "torchshm.torchdata.to_shared"),
        ("map_fn", "torchshm.chain"),
    ],
)
def test_moved_names_still_work_for_one_release(old, new):
    with pytest.warns(DeprecationWarning, match=re.escape(new)):
        fn = getattr(torchshm, old)
    assert callable(fn)
    assert old not in torchshm.__all__


@pytest.mark.parametrize(
    "old,new",
    [("allocating", "with_allocator"), ("worker_init_fn", "register_in_worker")],
)
def test_the_clashing_torchdata_names_still_work_for_one_release(old, new):
    # They clashed with torchshm.allocating and torchshm.worker_init_fn,
    # which take other arguments (issue 23).
    with pytest.warns(DeprecationWarning, match=f"torchshm.torchdata.{new}"):
        fn = getattr(torchshm.torchdata, old)
    assert fn is getattr(torchshm.torchdata, new)
    assert old not in torchshm.torchdata.__all__
    assert getattr(torchshm, old) is not fn


def test_the_old_datapipe_worker_init_fn_keeps_both_forms():
    with pytest.warns(DeprecationWarning):
        old = torchshm.datapipe_worker_init_fn
    pipe = object()
    assert old(pipe, "info") is pipe
    assert old(lambda datapipe, info: (datapipe, info))(pipe, "info") == (pipe, "info")


# A user's script that imports torchshm only inside main(): spawn and
# forkserver workers import the main module, not torchshm.
SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, os, sys
    import numpy as np, pandas as pd
    from torch.utils.data import DataLoader


    class Frames:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            mod = sys.modules.get("torchshm")
            return {
                "frame": pd.DataFrame({"x": np.arange(1000.0) + i}),
                "registered": bool(mod and mod.is_registered()),
                "init": os.environ.get("USER_INIT"),
            }


    def user_init(worker_id):
        os.environ["USER_INIT"] = str(worker_id)


    def main(method, mode):
        import torchshm

        kwargs = {}
        if mode == "worker_init_fn":
            kwargs["worker_init_fn"] = torchshm.chain(user_init)
        elif mode == "user_init":
            kwargs["worker_init_fn"] = user_init
        elif mode == "preload":
            multiprocessing.set_forkserver_preload(["torchshm"])
        loader = DataLoader(Frames(), batch_size=None, num_workers=2,
                            multiprocessing_context=method, timeout=60, **kwargs)
        out = []
        for i, s in enumerate(loader):
            assert (s["frame"]["x"].values == np.arange(1000.0) + i).all()
            shared = torchshm.is_shared(s["frame"]["x"].values)
            out.append([s["registered"], s["init"], shared])
        print(json.dumps(out))


    if __name__ == "__main__":
        main(*sys.argv[1:])
    """
)


@pytest.mark.parametrize(
    "method, mode, expected",
    [
        ("spawn", "worker_init_fn", True),
        ("forkserver", "worker_init_fn", True),
        ("forkserver", "preload", True),
        # Without either: torchshm gives the workers its hook itself, also
        # around the user's own (Note [Registration in workers]).
        ("spawn", "plain", True),
        ("spawn", "user_init", True),
        ("forkserver", "user_init", True),
    ],
)
def test_workers_register_when_main_imports_torchshm_late(
    tmp_path, no_leaks, method, mode, expected
):
    samples = run_script(tmp_path, SCRIPT, method, mode)
    assert len(samples) == 4
    for registered, init, shared in samples:
        assert registered is expected and shared is expected
        assert (init is not None) == (mode in ("worker_init_fn", "user_init"))


# Where torchshm cannot help (a spawn Pool whose workers never import it),
# the arrays come back by value, and the main process says so once; a
# DataLoader in the same script registers its workers and says nothing.
BY_VALUE_SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, sys, warnings
    import numpy as np
    from torch.utils.data import DataLoader


    def make(i):
        return np.full(1 << 20, float(i))  # 8 MiB


    def main():
        import torchshm

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            loader = DataLoader([make(i) for i in range(2)], batch_size=None,
                                num_workers=2, multiprocessing_context="spawn",
                                timeout=60, collate_fn=torchshm.convert)
            from_loader = [torchshm.is_shared(a) for a in loader]
            loader_warnings = [str(w.message) for w in seen]
            with multiprocessing.get_context("spawn").Pool(2) as pool:
                arrays = pool.map(make, range(4))
        print(json.dumps({
            "loader_shared": from_loader,
            "loader_warnings": loader_warnings,
            "pool_shared": [torchshm.is_shared(a) for a in arrays],
            "pool_ok": [bool((a == i).all()) for i, a in enumerate(arrays)],
            "warnings": [str(w.message) for w in seen
                         if "pickled by value" in str(w.message)],
        }))


    if __name__ == "__main__":
        main()
    """
)


def test_arrays_that_arrive_by_value_are_named_once(tmp_path, no_leaks):
    got = run_script(tmp_path, BY_VALUE_SCRIPT)
    assert got["loader_shared"] == [True, True] and got["loader_warnings"] == []
    assert got["pool_shared"] == [False] * 4 and all(got["pool_ok"])
    (warning,) = got["warnings"]
    assert "import torchshm at the top of the main module" in warning
    assert "worker_init_fn=torchshm.worker_init_fn" in warning


# Python 3.14 makes forkserver the default start method on Linux: a script
# that names no context, set to that default here, whether it imports
# torchshm at the top or only inside main().
DEFAULT_FORKSERVER_SCRIPT = textwrap.dedent(
    """
    import json, multiprocessing, sys
    import numpy as np
    from torch.utils.data import DataLoader

    if sys.argv[1] == "top":
        import torchshm


    class Arrays:
        def __len__(self):
            return 4

        def __getitem__(self, i):
            return np.arange(1000.0) + i


    def full(i):
        return np.full(1000, float(i))


    def main():
        import torchshm

        loader = DataLoader(Arrays(), batch_size=None, num_workers=2, timeout=60,
                            collate_fn=torchshm.convert)
        from_loader = [[a[0] == i, torchshm.is_shared(a)]
                       for i, a in enumerate(loader)]
        with multiprocessing.Pool(2) as pool:
            from_pool = [[a[0] == i, torchshm.is_shared(a)]
                         for i, a in enumerate(pool.map(full, range(4)))]
        print(json.dumps([[bool(x) for x in pair] for pair in from_loader + from_pool]))


    if __name__ == "__main__":
        multiprocessing.set_start_method("forkserver")
        main()
    """
)


@pytest.mark.parametrize("where", ["top", "main"])
def test_default_forkserver_workers_share_wherever_torchshm_is_imported(
    tmp_path, no_leaks, where
):
    results = run_script(tmp_path, DEFAULT_FORKSERVER_SCRIPT, where)
    assert results == [[True, True]] * 8


class _Frames(torch.utils.data.Dataset):
    """Samples as a pipeline makes them: a fresh 1 MiB array each, with
    what this worker's torchshm did so far."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        return np.full((256, 1024), float(i), dtype=np.float32), _sender_counts()


def _sender_counts():
    counts = torchshm.stats()
    return counts["allocations_shared"], counts["bytes_copied"]


def _stack_reporting(samples):
    """np.stack's batch, and the worker's counts so far."""
    return np.stack([array for array, _ in samples]), _sender_counts()


@pytest.mark.parametrize("batch_size", [2, None])
@pytest.mark.parametrize("hook", ["none", "worker_init_fn"])
def test_numpy_batches_are_born_shared_in_the_workers(ctx, batch_size, hook):
    # Note [Batches born shared] in torchshm/_dataloader.py: np.stack's
    # batch (and a sample with batch_size=None) is made in shared memory and
    # goes by reference: the worker copies nothing when it sends it.
    loader = DataLoader(
        _Frames(),
        batch_size=batch_size,
        num_workers=1,
        collate_fn=_stack_reporting if batch_size else torchshm.convert,
        multiprocessing_context=ctx,
        timeout=TIMEOUT,
        worker_init_fn=torchshm.worker_init_fn if hook == "worker_init_fn" else None,
    )
    got = list(loader)
    assert len(got) == (4 if batch_size else 8)
    for batch, _ in got:
        assert torchshm.is_shared(batch)
    values = np.concatenate([b.reshape(-1, 256 * 1024)[:, 0] for b, _ in got])
    assert sorted(values) == [float(i) for i in range(8)]
    # Counted before each later batch was made: its predecessors' sends.
    born, copied = got[-1][1]
    assert born >= len(got) - 1 and copied == 0


def test_a_hook_that_says_allocate_false_keeps_numpys_allocator(ctx):
    loader = DataLoader(
        _Frames(),
        batch_size=2,
        num_workers=1,
        collate_fn=_stack_reporting,
        multiprocessing_context=ctx,
        timeout=TIMEOUT,
        worker_init_fn=torchshm.chain(None, allocate=False),
    )
    got = list(loader)
    # A batch is sent by the worker queue's feeder thread, later than it is
    # made; but the loader asks for batch 2 (of 4) only once batch 0 has
    # arrived, so the last one's counts include batch 0's copy.
    born, copied = got[-1][1]
    assert born == 0 and copied >= got[0][0].nbytes
