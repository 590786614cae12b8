"""13. A pandas DataFrame of 3 string and 5 numeric columns, child -> parent.

The strings as pandas' default `str` (pandas 3: Arrow-backed when pyarrow
is installed, whose buffers torchshm sends as arrays: Note [Arrow buffers]
in torchshm/_send/arrow.py; before pandas 3, object) and as object dtype (packed
by torchshm when mostly distinct: Note [String columns]). Besides the time
per frame, the receiver's PSS while it holds the frame, over its PSS before
the first send, without file-backed pages (its shared pages are split with
the sender, which still maps them).
"""

import gc
import os
import statistics

import numpy as np
import pandas as pd

from benchmarks.report import Result, fmt
from benchmarks.scenarios.metadata import pss_bytes
from benchmarks.transports import LABELS, METHODS, sender

NAME = "string_frame"
CITIES = np.array([f"city-{i:02d}" for i in range(50)], dtype=object)


def make_frame(rows, dtype):
    """3 string columns (distinct names, distinct paths, 50 repeated city
    objects) of `dtype` ("str" or "object") and 5 numeric columns."""
    n = np.arange(rows)
    strings = {
        "name": [f"user-{i}" for i in range(rows)],
        "path": [f"/data/images/{i % 1000:03d}/{i:08d}.jpg" for i in range(rows)],
        "city": CITIES[n % len(CITIES)],
    }
    return pd.DataFrame(
        {
            **{k: pd.Series(v, dtype=dtype) for k, v in strings.items()},
            "x": np.linspace(0.0, 1.0, rows),
            "y": np.full(rows, 2.5, dtype=np.float32),
            "n": n.astype(np.int64),
            "k": (n % 97).astype(np.int32),
            "when": pd.date_range("2020-01-01", periods=rows, freq="s"),
        }
    )


def dtype_label(dtype):
    """The case's name: the column dtype pandas made, and its storage."""
    made = make_frame(2, dtype)["name"].dtype
    storage = getattr(made, "storage", None)
    return f"{dtype} -> {made}" + (f" ({storage})" if storage else "")


def pss():
    """This process's PSS without file-backed pages (Note [PSS of libraries]
    in metadata.py: other processes mapping torch move those)."""
    gc.collect()
    total, files = pss_bytes(os.getpid())
    return total - files


def run(quick, bar):
    rows, sends = (100_000, 3) if quick else (1_000_000, 5)
    result = Result(
        NAME,
        f"13. pandas DataFrame, {rows:,} rows, 3 string + 5 numeric columns,"
        " child -> parent",
        notes=[
            "Strings: distinct names, distinct paths, 50 repeated city"
            f" objects. Median [min-max] of sends 2..{sends}; PSS: the"
            " receiver's while it holds a frame (without file-backed pages),"
            " median over sends, over its PSS before the first."
            f" pandas {pd.__version__}.",
        ],
    )
    bar.reset(total=len(METHODS) * 2)
    held = {}
    for dtype in ("str", "object"):
        label = dtype_label(dtype)
        for method in METHODS:
            base, grown = pss(), []
            seconds = sender(method).measure(
                make_frame,
                (rows, dtype),
                sends,
                holding=lambda obj: grown.append(pss() - base),
            )
            result.add(label, method, seconds)
            held[f"{label} | {method}"] = statistics.median(grown)
            result.extra(
                label, f"PSS {LABELS[method]}", fmt(statistics.median(grown), "B")
            )
            bar.update()
    result.summary["receiver_pss"] = held
    return result
