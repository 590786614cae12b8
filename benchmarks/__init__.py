"""torchshm's benchmark suite (GitHub issue 4): `python -m benchmarks --help`.

`run(names, quick)` is the programmatic entry point (the notebook uses it);
`report` turns its results into tables, JSON and plots.
"""

from benchmarks.runner import run

__all__ = ["run"]
