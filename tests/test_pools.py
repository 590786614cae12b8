"""Pools sharing one large read-only model (the LensKit pattern), and results
from workers that exit right after returning them."""

import concurrent.futures
import multiprocessing as mp
import sys

import numpy as np
import pandas as pd
import pytest

import torchshm
from tests import integration_children as ic
from tests.conftest import TIMEOUT, bounded, stats_delta

# Every test here starts processes or checks memory they share: each gets
# the leak check (tests/conftest.py).
pytestmark = pytest.mark.multiprocess

WORKERS = 2


def executor(ctx, **kwargs):
    return concurrent.futures.ProcessPoolExecutor(WORKERS, mp_context=ctx, **kwargs)


def check_scores(results, model):
    for user, scores, shared in results:
        np.testing.assert_array_equal(scores, model.score(user))
        assert shared


@pytest.mark.parametrize("pool", ["executor", "mp.Pool"])
def test_initializer_model_is_shared_memory_in_workers(ctx, no_leaks, pool):
    model = ic.Model(items=500, users=50)
    if ctx.get_start_method() == "fork":
        # A forked worker inherits the model without pickling: share it first.
        model = torchshm.share(model)
    users = range(6)
    if pool == "executor":
        with executor(ctx, initializer=ic.init_model, initargs=(model,)) as ex:
            results = list(ex.map(ic.score_user, users, timeout=TIMEOUT))
    else:
        with ctx.Pool(WORKERS, ic.init_model, (model,)) as p:
            results = p.map_async(ic.score_user, users).get(TIMEOUT)
            p.close()
            bounded(p.join)
    check_scores(results, model)


def test_a_shared_model_is_sent_with_every_task_without_a_copy(ctx, no_leaks):
    model = torchshm.share(ic.Model(items=500, users=50))
    before = torchshm.stats()
    with executor(ctx) as ex:
        futures = [ex.submit(ic.score_with, model, user) for user in range(4)]
        results = [f.result(TIMEOUT) for f in futures]
    assert stats_delta(before)["bytes_copied"] == 0
    for user, (scores, item_features, shared) in enumerate(results):
        np.testing.assert_array_equal(scores, model.score(user))
        assert shared
        # The worker returned the very memory the parent shared.
        assert np.shares_memory(item_features, model.item_features)


def model_pss(ctx, model):
    """Bytes of PSS that the model's item_features take in a pool's workers,
    and in this process. (Semaphores: a Barrier keeps a heap fd open for good.)
    Only that mapping: a process's total PSS also splits shared libraries with
    every other process on the machine, which comes and goes."""
    arrived, go = ctx.Semaphore(0), ctx.Semaphore(0)
    with executor(ctx, initializer=ic.init_model, initargs=(model, arrived, go)) as ex:
        futures = [ex.submit(ic.pss_kib) for _ in range(WORKERS)]
        for _ in range(WORKERS):  # every worker is alive, in a task, with the model
            assert arrived.acquire(timeout=TIMEOUT)
        _, parent = ic.smaps_pss_kib(model.item_features)
        for _ in range(WORKERS):
            go.release()
        workers = {pid: kib for pid, _, kib in (f.result(TIMEOUT) for f in futures)}
    assert len(workers) == WORKERS  # each worker measured itself once
    return sum(workers.values()) * 1024, parent * 1024


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_a_shared_model_exists_once_however_many_workers(method, no_leaks):
    # Under fork, copy-on-write shares the pages with or without torchshm.
    ctx = mp.get_context(method)
    model = ic.Model(items=60_000, users=100, features=128)
    size = model.item_features.nbytes  # 30 MiB
    with torchshm.disabled():
        plain, _ = model_pss(ctx, model)
    # Each worker's start is its own message, so an array not yet in shared
    # memory would be snapshotted once per worker: share() it once first.
    shared, parent = model_pss(ctx, torchshm.share(model))
    assert plain >= 0.9 * WORKERS * size, "pickled: a private copy per worker"
    # Shared: one copy, split between the workers and this process (its
    # segment is resident up to its size class, at most 25% above the data).
    assert 0.9 * size <= shared + parent <= 1.3 * size, (shared, parent)


def check_results(results):
    for i, (index, array, frame) in enumerate(results):
        assert index == i
        np.testing.assert_array_equal(array, np.full((100, 50), i, dtype=np.float64))
        pd.testing.assert_frame_equal(frame, ic.make_frame(i))
        assert torchshm.is_shared(array)
        assert torchshm.is_shared(frame["f64"].values)


def test_results_from_workers_that_exit_after_each_task(ctx, no_leaks):
    with ctx.Pool(WORKERS, maxtasksperchild=1) as p:
        results = p.map_async(ic.make_result, range(3), chunksize=1).get(TIMEOUT)
        p.close()
        bounded(p.join)
    check_results(results)


@pytest.mark.skipif(
    sys.version_info < (3, 11), reason="max_tasks_per_child is Python 3.11+"
)
# Not fork: ProcessPoolExecutor refuses max_tasks_per_child with it (the Pool
# test above covers fork).
@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_executor_results_from_workers_that_exit(method, no_leaks):
    ctx = mp.get_context(method)
    with executor(ctx, max_tasks_per_child=1) as ex:
        results = list(ex.map(ic.make_result, range(3), timeout=TIMEOUT))
    check_results(results)
