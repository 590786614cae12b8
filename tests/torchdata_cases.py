"""torchdata with torchshm. tests/test_torchdata.py runs this module in a
fresh process per torchdata version: an installed torchdata, or an unmodified
one from ../shared/vendor put on PYTHONPATH (so that spawned workers find it
too). Each test's name starts with the API group it needs, and a group this
torchdata lacks skips; the driver checks that the groups the version has ran:

- reading_service: DataLoader2 + MultiProcessingReadingService (0.5-0.9)
- prototype: PrototypeMultiProcessingReadingService (0.5)
- stateful: torchdata.stateful_dataloader.StatefulDataLoader (0.8+)
- nodes: torchdata.nodes.ParallelMapper (0.10+)
"""

import functools
import importlib
import inspect
import multiprocessing
import pickle
import textwrap

import numpy as np
import pytest
import torch

import torchshm
from tests import allocator_children as ac
from tests import integration_children as ic
from tests.conftest import run_script
from tests.test_dataloader import assert_equal
from tests.test_pandas_xarray import assert_all_shared

torchdata = pytest.importorskip(
    "torchdata", reason="torchdata is not importable (see tests/test_torchdata.py)"
)
# torchdata 0.9 warns on import that DataLoader2 and datapipes are deprecated.
pytestmark = pytest.mark.filterwarnings("ignore:.*deprecated.*:UserWarning")


def optional(module):
    try:
        return importlib.import_module(module)
    except ImportError:
        return None


dataloader2 = optional("torchdata.dataloader2")
stateful_dataloader = optional("torchdata.stateful_dataloader")
nodes = optional("torchdata.nodes")
needs_dataloader2 = pytest.mark.skipif(
    dataloader2 is None, reason="this torchdata has no dataloader2 (removed in 0.10)"
)
needs_stateful = pytest.mark.skipif(
    stateful_dataloader is None,
    reason="this torchdata has no stateful_dataloader (added in 0.8)",
)
needs_nodes = pytest.mark.skipif(
    nodes is None, reason="this torchdata has no torchdata.nodes (added in 0.10)"
)

N = 4
# 0.6-0.9 call worker_init_fn(datapipe, worker_info); 0.5 hands it to a DataLoader.
NEW_SIGNATURE = dataloader2 is not None and (
    "worker_prefetch_cnt"
    in inspect.signature(dataloader2.MultiProcessingReadingService).parameters
)


def pipeline():
    from torchdata.datapipes.iter import IterableWrapper

    # functools.partial of a module function: picklable under spawn.
    sample = functools.partial(ic.make_sample, "mixed")
    return IterableWrapper(range(N)).sharding_filter().map(sample)


def run(datapipe, service):
    loader = dataloader2.DataLoader2(datapipe, reading_service=service)
    try:
        return list(loader)
    finally:
        loader.shutdown()  # 0.5 hangs at exit without it


def check(received):
    assert len(received) == N
    for got in received:  # before any lookup makes pandas build caches
        assert_all_shared(got)
    # Workers interleave their items: put them back in order.
    for i, got in enumerate(sorted(received, key=ic.sample_index)):
        assert_equal(got, ic.make_sample("mixed", i))


def worker_hook():
    """torchshm's worker hook for this torchdata's signature."""
    return (
        torchshm.torchdata.register_in_worker
        if NEW_SIGNATURE
        else torchshm.worker_init_fn
    )


def service(ctx, init=None, **kwargs):
    return dataloader2.MultiProcessingReadingService(
        num_workers=2,
        multiprocessing_context=ctx.get_start_method(),
        worker_init_fn=init or worker_hook(),
        **kwargs,
    )


@needs_dataloader2
def test_reading_service_workers_register(ctx, no_leaks):
    check(run(pipeline(), service(ctx)))


@needs_dataloader2
def test_reading_service_share_memory_map_moves_items_in_the_worker(ctx, no_leaks):
    check(run(pipeline().map(torchshm.torchdata.to_shared), service(ctx)))


@needs_dataloader2
def test_reading_service_workers_allocate_in_shared_memory(ctx, no_leaks):
    from torchdata.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(N)).sharding_filter().map(ac.born_sample)
    got = run(pipe, service(ctx, torchshm.chain(worker_hook(), allocate=True)))
    assert sorted(i for i, _, _ in got) == list(range(N))
    assert all(born and (a == i).all() for i, a, born in got)


@needs_dataloader2
def test_reading_service_allocating_datapipe(ctx, no_leaks):
    from torchdata.datapipes.iter import IterableWrapper

    pipe = IterableWrapper(range(N)).sharding_filter().map(ac.born_sample)
    got = run(torchshm.torchdata.with_allocator(pipe), service(ctx))
    assert sorted(i for i, _, _ in got) == list(range(N))
    assert all(born and (a == i).all() for i, a, born in got)


needs_prototype = pytest.mark.skipif(
    not hasattr(dataloader2, "PrototypeMultiProcessingReadingService"),
    reason="torchdata 0.5's PrototypeMultiProcessingReadingService is gone",
)


@needs_prototype
def test_prototype_reading_service_with_in_workers(ctx, no_leaks):
    rs = dataloader2.PrototypeMultiProcessingReadingService(
        num_workers=2, multiprocessing_context=ctx.get_start_method()
    )
    check(run(torchshm.torchdata.in_workers(pipeline()), rs))


@needs_dataloader2
def test_reading_service_datapipe_worker_init_fn_chains_and_returns_the_datapipe():
    from torchdata.datapipes.iter import IterableWrapper

    pipe = pipeline()
    assert torchshm.torchdata.register_in_worker(pipe, None) is pipe
    calls = []

    def user_init(datapipe, worker_info):
        calls.append(worker_info)
        return datapipe.map(str)

    init = torchshm.chain(user_init)
    torchshm.unregister()
    try:
        out = init(IterableWrapper([1, 2]), "info")
        assert torchshm.is_registered()
    finally:
        torchshm.register()
    assert list(out) == ["1", "2"] and calls == ["info"]


# A user's script that imports torchshm only inside main(): spawn workers
# import the main module and torchdata, not torchshm.
SCRIPT = textwrap.dedent(
    """
    import inspect, json, sys
    import numpy as np, pandas as pd, torch
    from torchdata import dataloader2
    from torchdata.datapipes.iter import IterableWrapper


    def frame(i):
        mod = sys.modules.get("torchshm")
        return {"frame": pd.DataFrame({"x": np.arange(1000.0) + i}),
                "registered": bool(mod and mod.is_registered())}


    def main(service, mode):
        import torchshm

        pipe = IterableWrapper(range(4)).sharding_filter().map(frame)
        if service == "prototype":
            if mode == "helper":
                pipe = torchshm.torchdata.in_workers(pipe)
            rs = dataloader2.PrototypeMultiProcessingReadingService(
                num_workers=2, multiprocessing_context="spawn")
        else:
            kwargs = {}
            if mode == "helper":
                params = inspect.signature(
                    dataloader2.MultiProcessingReadingService).parameters
                kwargs["worker_init_fn"] = (
                    torchshm.torchdata.register_in_worker
                    if "worker_prefetch_cnt" in params
                    else torchshm.worker_init_fn)
            rs = dataloader2.MultiProcessingReadingService(
                num_workers=2, multiprocessing_context="spawn", **kwargs)
        loader = dataloader2.DataLoader2(pipe, reading_service=rs)
        try:
            out = [[s["registered"], torchshm.is_shared(s["frame"]["x"].values)]
                   for s in loader]
            # torchdata 0.5's reading service runs torch's DataLoader, whose
            # spawn workers torchshm registers by itself.
            on_dataloader = isinstance(
                getattr(rs, "dl_", None), torch.utils.data.DataLoader)
        finally:
            loader.shutdown()
        print(json.dumps({"items": out, "on_dataloader": on_dataloader}))


    if __name__ == "__main__":
        main(*sys.argv[1:])
    """
)


@needs_dataloader2
@pytest.mark.parametrize("mode", ["helper", "plain"])
def test_reading_service_spawn_workers_register_when_main_imports_torchshm_late(
    tmp_path, no_leaks, mode
):
    got = run_script(tmp_path, SCRIPT, "multiprocessing", mode)
    # "plain" is the control: without the helper, workers send by value,
    # unless the service runs torch's DataLoader (torchdata 0.5), whose
    # spawn workers torchshm registers without help.
    registered = mode == "helper" or got["on_dataloader"]
    assert got["items"] == [[registered] * 2] * N


@needs_prototype
@pytest.mark.parametrize("mode", ["helper", "plain"])
def test_prototype_spawn_workers_register_when_main_imports_torchshm_late(
    tmp_path, no_leaks, mode
):
    got = run_script(tmp_path, SCRIPT, "prototype", mode)
    # "plain" is the control: without the helper, workers send by value.
    assert not got["on_dataloader"]
    assert got["items"] == [[mode == "helper"] * 2] * N


# --- StatefulDataLoader -------------------------------------------------------

BATCH, SAMPLES = 2, 12


class Frames(torch.utils.data.Dataset):
    """Map-style: sample i is a 512 KiB array filled with i, and i."""

    def __len__(self):
        return SAMPLES

    def __getitem__(self, i):
        return {"x": np.full((64, 1024), i, dtype=np.float64), "i": i}


class Stream(torch.utils.data.IterableDataset):
    """Iterable and stateful: each worker yields its share of the samples and
    remembers where it is; its state carries an array too."""

    def __init__(self):
        self.position = 0

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        workers, worker = (info.num_workers, info.id) if info else (1, 0)
        mine = range(worker, SAMPLES, workers)
        while self.position < len(mine):
            i = mine[self.position]
            self.position += 1
            yield {"x": np.full((64, 1024), i, dtype=np.float64), "i": i}

    def state_dict(self):
        return {"position": self.position, "seen": np.arange(self.position * 1000)}

    def load_state_dict(self, state):
        assert len(state["seen"]) == state["position"] * 1000
        self.position = state["position"]


def stateful_loader(ctx, dataset):
    return stateful_dataloader.StatefulDataLoader(
        dataset,
        batch_size=BATCH,
        num_workers=2,
        multiprocessing_context=ctx.get_start_method(),
        worker_init_fn=torchshm.worker_init_fn,
        collate_fn=torchshm.collate,
        snapshot_every_n_steps=1,
    )


def check_batches(batches):
    for batch in batches:
        assert torchshm.is_shared(batch["x"]), "a batch arrived by value"
        assert batch["x"].shape == (len(batch["i"]), 64, 1024)
        for x, i in zip(batch["x"], batch["i"]):
            assert (x == i).all()
    return sorted(int(i) for batch in batches for i in batch["i"])


@needs_stateful
@pytest.mark.parametrize("dataset", [Frames, Stream])
def test_stateful_dataloader_delivers_shared_batches(ctx, no_leaks, dataset):
    assert check_batches(list(stateful_loader(ctx, dataset()))) == list(range(SAMPLES))


# No no_leaks: the batches the first loader's workers had prefetched when it
# was dropped are never received, and their segments wait for the session's
# end (docs/guide/lifetime.md: a message never received).
@needs_stateful
@pytest.mark.parametrize("dataset", [Frames, Stream])
def test_stateful_dataloader_resumes_mid_epoch(ctx, dataset):
    loader = stateful_loader(ctx, dataset())
    it = iter(loader)
    first = [next(it) for _ in range(2)]
    # Saved as a checkpoint would be: plain pickle, by value.
    state = pickle.loads(pickle.dumps(loader.state_dict()))
    del it, loader  # the first epoch's workers go away
    resumed = stateful_loader(ctx, dataset())
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert len(rest) == SAMPLES // BATCH - 2
    assert check_batches(first + rest) == list(range(SAMPLES))


# --- torchdata.nodes.ParallelMapper ------------------------------------------


def large_sample(i):
    """A large array, a DataFrame and an xarray Dataset, all from seed i."""
    return {
        "large": np.arange(1 << 20, dtype=np.float64) + i,  # 8 MiB
        "frame": ic.make_frame(i),
        "dataset": ic.make_dataset(i),
        "i": i,
    }


def parallel_map(ctx, fn, n=N):
    mapper = nodes.ParallelMapper(
        nodes.IterableWrapper(range(n)),
        map_fn=fn,
        num_workers=2,
        method="process",
        multiprocessing_context=ctx.get_start_method(),
        in_order=True,
    )
    loader = nodes.Loader(mapper)
    items = list(loader)  # exhausting it tells the workers to stop
    # torchdata waits 0.5 s for its workers: a spawned one still starting
    # would then find the stop event's semaphore gone. Wait while it lives.
    for process in multiprocessing.active_children():
        process.join(60)
    del loader
    return items


@needs_nodes
def test_nodes_parallel_mapper_processes_send_shared_arrays(ctx, no_leaks):
    received = parallel_map(ctx, torchshm.chain(large_sample))
    assert [got["i"] for got in received] == list(range(N))
    for got in received:  # before any lookup makes pandas build caches
        assert_all_shared(got)
    for i, got in enumerate(received):
        assert_equal(got, large_sample(i))


@needs_nodes
def test_nodes_parallel_mapper_workers_allocate_in_shared_memory(ctx, no_leaks):
    got = parallel_map(ctx, torchshm.chain(ac.born_sample, allocate=True))
    assert [i for i, _, _ in got] == list(range(N))
    assert all(born and (a == i).all() for i, a, born in got)


@needs_nodes
def test_nodes_parallel_mapper_mixed_samples(ctx, no_leaks):
    fn = functools.partial(ic.make_sample, "mixed")
    received = parallel_map(ctx, torchshm.chain(fn))
    check(received)


# A user's script that imports torchshm only inside main(): spawned
# ParallelMapper workers unpickle the map function and nothing else.
NODES_SCRIPT = textwrap.dedent(
    """
    import json, sys
    import numpy as np
    from torchdata import nodes


    def frame(i):
        mod = sys.modules.get("torchshm")
        return {"x": np.arange(100_000.0) + i,
                "registered": bool(mod and mod.is_registered())}


    def main(mode):
        import torchshm

        fn = torchshm.chain(frame) if mode == "helper" else frame
        mapper = nodes.ParallelMapper(
            nodes.IterableWrapper(range(4)), map_fn=fn, num_workers=2,
            method="process", multiprocessing_context="spawn")
        out = [[s["registered"], torchshm.is_shared(s["x"])]
               for s in nodes.Loader(mapper)]
        print(json.dumps(out))


    if __name__ == "__main__":
        main(*sys.argv[1:])
    """
)


# No no_leaks: the script exits without waiting for its daemonic workers.
@needs_nodes
@pytest.mark.parametrize("mode", ["helper", "plain"])
def test_nodes_spawn_workers_register_with_map_fn(tmp_path, mode):
    items = run_script(tmp_path, NODES_SCRIPT, mode)
    assert items == [[mode == "helper"] * 2] * N
