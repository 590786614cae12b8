"""2. An ERA5-like xarray Dataset through a PyTorch DataLoader worker.

100 hourly steps of a 700 x 1400 float32 field (392 MB), one Dataset per
item, `batch_size=None`; each method is set up in the worker (worker_init_fn).
Peers with loaders of their own use them: Grain's DataLoader (one worker),
and a Ray actor returning the Dataset. Grain cannot carry the Dataset itself
(its tree walk takes a Dataset for a Mapping and fails), so its row sends
``Dataset.to_dict(data="array")`` and rebuilds it with ``from_dict``, timed.
"""

import numpy as np
import pandas as pd
import xarray as xr

from benchmarks import peers
from benchmarks.report import Result
from benchmarks.transports import METHODS, measure_dataloader, sender

NAME = "era5"


def make_era5(steps, lat, lon):
    data = np.empty((steps, lat, lon), dtype=np.float32)
    data.fill(273.15)
    return xr.Dataset(
        {"t2m": (("time", "latitude", "longitude"), data, {"units": "K"})},
        coords={
            "time": pd.date_range("2020-01-01", periods=steps, freq="h"),
            "latitude": np.linspace(90.0, -90.0, lat),
            "longitude": np.linspace(0.0, 360.0, lon, endpoint=False),
        },
    )


def make_era5_dict(steps, lat, lon):
    return make_era5(steps, lat, lon).to_dict(data="array")


def run(quick, bar):
    shape, items = ((10, 350, 700), 4) if quick else ((100, 700, 1400), 6)
    mb = np.prod(shape) * 4 / 1e6
    result = Result(
        NAME,
        f"2. ERA5-like xarray {shape[0]} x {shape[1]} x {shape[2]} float32"
        f" ({mb:.0f} MB) through a DataLoader worker",
        notes=[
            "Per item: from the worker's __getitem__ returning to the main"
            " process having read every page; median [min-max] of items"
            f" 2..{items}.",
        ],
    )
    methods = METHODS + peers.methods(("torch_fs", "ray", "grain"))
    bar.reset(total=len(methods))
    label = f"{shape[0]} steps"
    for method in methods:
        seconds = peers.attempt(
            result, label, method, lambda: measure(method, shape, items)
        )
        if seconds is not None:
            result.add(label, method, seconds)
        bar.update()
    peers.against_best(result)
    peers.note_versions(result, methods)
    return result


def measure(method, shape, items):
    if method == "ray":
        return sender(method).measure(make_era5, shape, items)
    if method == "grain":
        return peers.grain_items(make_era5_dict, shape, items, xr.Dataset.from_dict)
    return measure_dataloader(method, make_era5, shape, items)
