"""Datasets, models and worker functions for the integration tests, at module
top level so that spawn and forkserver workers can import them. Builders are
deterministic: a worker and the test build equal objects from one seed."""

import collections
import gc
import os

import numpy as np
import pandas as pd
import xarray as xr

import torchshm

Pair = collections.namedtuple("Pair", "image label")
TIMEOUT = 120  # every wait in a child is bounded (see tests/children.py)


def echo(inbox, outbox):
    """Sends back whatever arrives, until None. (iter(inbox.get, None) would
    stop at an xarray object: its `== None` is elementwise and truthy.)"""
    while True:
        obj = inbox.get(timeout=TIMEOUT)
        if obj is None:
            return
        outbox.put(obj)


def make_frame(seed=0, n=64):
    """A DataFrame with every kind of column pandas pickles differently."""
    rng = np.random.default_rng(seed)
    index = pd.MultiIndex.from_product(
        [["a", "b"], range(n // 2)], names=["group", "step"]
    )
    return pd.DataFrame(
        {
            "f64": rng.random(n),
            "i32": rng.integers(0, 100, n).astype(np.int32),
            "f32": rng.random(n).astype(np.float32),
            "when": pd.date_range("2024-03-30", periods=n, freq="h", tz="Europe/Paris")
            + pd.Timedelta(seed, "D"),
            "naive": pd.date_range("2000-01-01", periods=n, freq="D"),
            "cat": pd.Categorical(rng.choice(["x", "y", "z"], n)),
            "nullable": pd.array(
                [None if i % 7 == 0 else i + seed for i in range(n)], dtype="Int64"
            ),
            "flag": pd.array(
                [None if i % 5 == 0 else bool(i % 2) for i in range(n)],
                dtype="boolean",
            ),
            "obj": [f"s{i + seed}" for i in range(n)],
            "text": pd.array([f"t{i}" for i in range(n)], dtype="string"),
        },
        index=index,
    )


def make_dataset(seed=0, times=3, lats=6, lons=8):
    """An xarray Dataset with index, string, 2-D and scalar coordinates."""
    rng = np.random.default_rng(seed)
    shape = (times, lats, lons)
    return xr.Dataset(
        {
            "t2m": (("time", "lat", "lon"), rng.random(shape, np.float32), {"u": "K"}),
            "precip": (("time", "lat", "lon"), rng.random(shape)),
            "mask": (("lat", "lon"), rng.random(shape[1:]) > 0.5),
        },
        coords={
            "time": pd.date_range("2020-01-01", periods=times),
            "lat": np.linspace(-60, 60, lats),
            "lon": np.linspace(0, 350, lons),
            "station": ("lon", np.array([f"st{i}" for i in range(lons)])),
            "height": (("lat", "lon"), rng.random(shape[1:], np.float32)),
            "level": 850,
            "sample": seed,  # differs between samples: a batch coordinate
        },
        attrs={"source": "test", "seed": seed},
    )


KINDS = ("array", "nested", "frame", "dataset", "dataarray")


def make_sample(kind, i):
    """Sample `i` of a dataset of `kind`."""
    if kind == "array":
        return np.arange(i, i + 600, dtype=np.float32).reshape(20, 30)
    if kind == "nested":
        image = np.full((3, 8, 8), i, dtype=np.uint8)
        return {
            "pair": Pair(image, np.int64(i)),
            "boxes": [(np.arange(8) + i).astype(">f8"), np.eye(2) * i],
            "name": f"sample{i}",
        }
    if kind == "frame":
        return make_frame(i)
    if kind == "dataset":
        return make_dataset(i).isel(lat=slice(None, None, -1))
    if kind == "dataarray":
        return make_dataset(i)["t2m"].isel(time=i % 3, lat=slice(None, None, -1))
    if kind == "mixed":  # one of each kind in turn
        return make_sample(KINDS[i % len(KINDS)], i)
    if kind == "all":  # every kind in one sample
        return {k: make_sample(k, i) for k in KINDS}
    raise ValueError(f"unknown sample kind {kind!r}")


def sample_index(sample):
    """The `i` that make_sample("mixed", i) was called with."""
    if isinstance(sample, np.ndarray):
        return int(sample.flat[0])
    if isinstance(sample, dict):
        return int(sample["pair"].label)
    if isinstance(sample, pd.DataFrame):
        return int(sample["obj"].iloc[0][1:])
    return int(sample.coords["sample"])


class SampleDataset:
    """A map-style dataset of `n` samples of `kind`."""

    def __init__(self, kind, n=6):
        self.kind, self.n = kind, n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return make_sample(self.kind, i)


def record_pid(worker_id):
    """A user's worker_init_fn: proves chaining by leaving a trace."""
    os.environ["INTEGRATION_WORKER_ID"] = str(worker_id)


class WorkerReportDataset(SampleDataset):
    """Samples carry what the worker saw: registration and the chained init."""

    def __getitem__(self, i):
        return {
            "frame": make_frame(i),
            "registered": torchshm.is_registered(),
            "init": os.environ.get("INTEGRATION_WORKER_ID"),
        }


def arrays_in(obj, limit=20000):
    """Every ndarray reachable from `obj` through the garbage collector's
    referents (pandas and xarray internals included), excluding arrays that
    hold Python objects."""
    found, seen, stack = {}, set(), [obj]
    while stack and len(seen) < limit:
        item = stack.pop()
        if id(item) in seen or isinstance(item, (type, type(os))):
            continue
        seen.add(id(item))
        if isinstance(item, np.ndarray):
            if not item.dtype.hasobject and item.size:
                found[id(item)] = item
            continue
        stack.extend(gc.get_referents(item))
    return list(found.values())


# Pools: one large read-only model, shared by every worker.


class Model:
    """A LensKit-style model: large factor matrices and a small vocabulary."""

    def __init__(self, items=2000, users=1000, features=64, seed=0):
        rng = np.random.default_rng(seed)
        self.item_features = rng.random((items, features), np.float32)
        self.user_features = rng.random((users, features), np.float32)
        self.item_ids = pd.Index(np.arange(items) * 10, name="item")

    @property
    def nbytes(self):
        return self.item_features.nbytes + self.user_features.nbytes

    def score(self, user):
        return self.item_features @ self.user_features[user]


_model = None
_arrived = _go = None


def init_model(model, arrived=None, go=None):
    """Pool initializer: keeps the model (and the PSS handshake) for the tasks."""
    global _model, _arrived, _go
    _model, _arrived, _go = model, arrived, go


def score_user(user):
    """A task that uses the model installed by init_model."""
    return user, _model.score(user), torchshm.is_shared(_model.item_features)


def score_with(model, user):
    """A task that receives the model with every call."""
    shared = torchshm.is_shared(model.item_features)
    return model.score(user), model.item_features, shared


def pss_kib():
    """(pid, this process's PSS, the PSS of the mapping holding the model's
    item_features) in KiB, measured once every worker holds the model (the
    parent releases `_go` when all have arrived)."""
    _model.item_features.sum(), _model.user_features.sum()  # touch every page
    _arrived.release()
    if not _go.acquire(timeout=60):
        raise TimeoutError("the parent never released the workers")
    return (os.getpid(),) + smaps_pss_kib(_model.item_features)


def smaps_pss_kib(array):
    """(total PSS, PSS of the mapping that holds `array`'s data) in KiB."""
    address = array.__array_interface__["data"][0]
    total = mapping = 0
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):  # a mapping's first line
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif head == "Pss:":
                kib = int(line.split()[1])
                total += kib
                mapping += kib if inside else 0
    return total, mapping


def make_result(i):
    """A task whose worker exits right after returning (maxtasksperchild=1)."""
    return i, np.full((100, 50), i, dtype=np.float64), make_frame(i)
