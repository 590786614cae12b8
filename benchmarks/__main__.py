"""python -m benchmarks [--quick] [--only NAMES] [--json PATH] [--plot DIR]

Runs the suite, prints one markdown table per scenario, and writes JSON and
one PNG per scenario (default: benchmarks/results/).
"""

import argparse
import os
import sys
import time

# Plots go to files: pick the file-only backend before anything imports pyplot.
import matplotlib

matplotlib.use("Agg")

from benchmarks import report  # noqa: E402
from benchmarks.runner import run  # noqa: E402
from benchmarks.scenarios import ALIASES, SCENARIOS  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument(
        "--quick", action="store_true", help="small sizes and few repeats (~1 min)"
    )
    parser.add_argument(
        "--only",
        default="all",
        help="comma-separated scenarios: 1-7, "
        + ", ".join(list(SCENARIOS) + list(ALIASES))
        + " (core = big_array,per_item)",
    )
    parser.add_argument(
        "--json",
        default=os.path.join(RESULTS, "results.json"),
        metavar="PATH",
        help="where to write the results (default: %(default)s; '' to skip)",
    )
    parser.add_argument(
        "--plot",
        default=RESULTS,
        metavar="DIR",
        help="where to write one PNG per scenario (default: %(default)s;"
        " '' to skip)",
    )
    parser.add_argument(
        "--no-progress", action="store_true", help="no tqdm progress bar"
    )
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        names = args.only.split(",")
        from benchmarks.scenarios import select

        select(names)
    except ValueError as exc:
        sys.exit(f"python -m benchmarks: {exc}")
    info = report.machine()
    print(f"Machine: {report.machine_line(info)}", flush=True)
    start = time.monotonic()
    results = run(names, quick=args.quick, progress=not args.no_progress)
    for result in results:
        print()
        print(report.markdown(result), flush=True)
    print(
        f"Total: {time.monotonic() - start:.0f} s{' (--quick)' if args.quick else ''}"
    )
    if args.json:
        report.write_json(results, args.json, info, vars(args))
        print(f"JSON: {args.json}")
    if args.plot:
        for path in report.write_plots(results, args.plot):
            print(f"Plot: {path}")


if __name__ == "__main__":
    main()
