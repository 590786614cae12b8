"""3. A pandas DataFrame with numeric, datetime, categorical and string columns.

String (object) columns pickle by value whatever the method, so the case
without them shows what the array transport alone gains.
"""

import numpy as np
import pandas as pd

from benchmarks import peers
from benchmarks.report import Result
from benchmarks.transports import METHODS, sender

NAME = "dataframe"


def make_frame(rows, strings):
    frame = pd.DataFrame(
        {
            "x": np.linspace(0.0, 1.0, rows),
            "y": np.full(rows, 2.5, dtype=np.float32),
            "n": np.arange(rows, dtype=np.int64),
            "when": pd.date_range("2020-01-01", periods=rows, freq="s"),
            "kind": pd.Categorical.from_codes(
                np.arange(rows) % 4, ["a", "b", "c", "d"]
            ),
        }
    )
    if strings:
        frame["name"] = (np.arange(rows) % 1000).astype(str).astype(object)
    return frame


def run(quick, bar):
    rows, sends = (100_000, 4) if quick else (2_000_000, 6)
    result = Result(
        NAME,
        f"3. pandas DataFrame, {rows:,} rows, child -> parent",
        notes=[
            "Columns: float64, float32, int64, datetime64, categorical (+ an"
            f" object string column). Median [min-max] of sends 2..{sends}.",
        ],
    )
    methods = METHODS + peers.methods()
    bar.reset(total=len(methods))
    for method in methods:
        for strings in (False, True):
            label = "mixed + strings" if strings else "numeric, datetime, category"
            seconds = peers.attempt(
                result,
                label,
                method,
                lambda: sender(method).measure(make_frame, (rows, strings), sends),
            )
            if seconds is not None:
                result.add(label, method, seconds)
        bar.update()
    peers.against_best(result)
    peers.note_versions(result, methods)
    return result
