"""torchshm's benchmark suite (GitHub issue 4): `python -m benchmarks --help`.

`run(names, quick)` is the programmatic entry point (the notebook uses it);
`report` turns its results into tables, JSON and plots.
"""

import warnings

from benchmarks.runner import run

# The baselines (pipe + pickle, shared_memory + pickle 5) send arrays by
# value on purpose: torchshm's warning for such arrivals (torchshm/_send/
# arrivals.py) would only be noise in the tables' output.
warnings.filterwarnings("ignore", message=r"torchshm: a \d+ MiB message arrived")

__all__ = ["run"]
