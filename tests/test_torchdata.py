"""torchdata reading services: workers register torchshm through its helpers
and items arrive equal and in shared memory. Skipped without torchdata."""

import functools
import inspect
import textwrap

import pytest

import torchshm
from tests import integration_children as ic
from tests.conftest import run_script
from tests.test_dataloader import assert_equal
from tests.test_pandas_xarray import assert_all_shared

torchdata = pytest.importorskip(
    "torchdata", reason="torchdata is not installed (pip install torchdata)"
)
dataloader2 = pytest.importorskip("torchdata.dataloader2")
from torchdata.datapipes.iter import IterableWrapper  # noqa: E402

N = 4
# 0.6-0.9 call worker_init_fn(datapipe, worker_info); 0.5 hands it to a DataLoader.
NEW_SIGNATURE = (
    "worker_prefetch_cnt"
    in inspect.signature(dataloader2.MultiProcessingReadingService).parameters
)


def pipeline():
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


def service(ctx, **kwargs):
    init = (
        torchshm.datapipe_worker_init_fn if NEW_SIGNATURE else torchshm.worker_init_fn
    )
    return dataloader2.MultiProcessingReadingService(
        num_workers=2,
        multiprocessing_context=ctx.get_start_method(),
        worker_init_fn=init,
        **kwargs,
    )


def test_multiprocessing_reading_service(ctx, no_leaks):
    check(run(pipeline(), service(ctx)))


def test_share_memory_map_moves_items_in_the_worker(ctx, no_leaks):
    check(run(pipeline().map(torchshm.share_memory), service(ctx)))


@pytest.mark.skipif(
    not hasattr(dataloader2, "PrototypeMultiProcessingReadingService"),
    reason="torchdata 0.5's PrototypeMultiProcessingReadingService is gone",
)
def test_prototype_reading_service_with_in_workers(ctx, no_leaks):
    rs = dataloader2.PrototypeMultiProcessingReadingService(
        num_workers=2, multiprocessing_context=ctx.get_start_method()
    )
    check(run(torchshm.in_workers(pipeline()), rs))


def test_datapipe_worker_init_fn_chains_and_returns_the_datapipe():
    pipe = pipeline()
    assert torchshm.datapipe_worker_init_fn(pipe, None) is pipe
    calls = []

    def user_init(datapipe, worker_info):
        calls.append(worker_info)
        return datapipe.map(str)

    init = torchshm.datapipe_worker_init_fn(user_init)
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
    import numpy as np, pandas as pd
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
                pipe = torchshm.in_workers(pipe)
            rs = dataloader2.PrototypeMultiProcessingReadingService(
                num_workers=2, multiprocessing_context="spawn")
        else:
            kwargs = {}
            if mode == "helper":
                params = inspect.signature(
                    dataloader2.MultiProcessingReadingService).parameters
                kwargs["worker_init_fn"] = (
                    torchshm.datapipe_worker_init_fn
                    if "worker_prefetch_cnt" in params
                    else torchshm.worker_init_fn)
            rs = dataloader2.MultiProcessingReadingService(
                num_workers=2, multiprocessing_context="spawn", **kwargs)
        loader = dataloader2.DataLoader2(pipe, reading_service=rs)
        try:
            out = [[s["registered"], torchshm.is_shared(s["frame"]["x"].values)]
                   for s in loader]
        finally:
            loader.shutdown()
        print(json.dumps(out))


    if __name__ == "__main__":
        main(*sys.argv[1:])
    """
)

SERVICES = ["multiprocessing"]
if hasattr(dataloader2, "PrototypeMultiProcessingReadingService"):
    SERVICES.append("prototype")


@pytest.mark.parametrize("service", SERVICES)
@pytest.mark.parametrize("mode", ["helper", "plain"])
def test_spawn_workers_register_when_main_imports_torchshm_late(
    tmp_path, no_leaks, service, mode
):
    items = run_script(tmp_path, SCRIPT, service, mode)
    # "plain" is the control: without the helper, workers send by value.
    assert items == [[mode == "helper"] * 2] * N
