"""What building torchshm costs: wall time and the largest process's peak
resident memory (a compiler's) of a build from a clean tree, as a user's
`pip wheel --no-build-isolation` does it, against the running interpreter's
torch and numpy.

    python -m benchmarks.build_cost                  # this checkout's files, 3 builds
    python -m benchmarks.build_cost --rev c002813    # a commit's, to compare

Each build copies the tree (the checkout's tracked and untracked files, or a
commit's, via git) into a fresh temporary folder, so nothing is reused from an
earlier build; builds alternate when several revisions are given. Prints one
line per build and the medians.
"""

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_tree(rev, dest):
    """The sources of `rev` ('' for the working tree) into `dest`."""
    if rev:
        archive = subprocess.run(
            ["git", "-C", ROOT, "archive", rev], check=True, capture_output=True
        ).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=archive, check=True)
        return
    listed = subprocess.run(
        [
            "git",
            "-C",
            ROOT,
            "ls-files",
            "-z",
            "--cached",
            "--others",
            "--exclude-standard",
        ],
        check=True,
        capture_output=True,
    ).stdout
    for name in filter(None, listed.decode().split("\0")):
        source = os.path.join(ROOT, name)
        if os.path.isfile(source):
            target = os.path.join(dest, name)
            os.makedirs(os.path.dirname(target), exist_ok=True)
            shutil.copy2(source, target)


def build_once(rev, jobs):
    """(wall seconds, peak resident MiB of the largest process) of one build,
    in a child process so that its peak is its own."""
    code = (
        "import resource, subprocess, sys, time\n"
        "start = time.perf_counter()\n"
        "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
        "wall = time.perf_counter() - start\n"
        "peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024\n"
        "print(wall, peak)\n"
    )
    with tempfile.TemporaryDirectory(prefix="torchshm-build-") as tmp:
        src = os.path.join(tmp, "src")
        os.makedirs(src)
        copy_tree(rev, src)
        command = [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation"]
        command += ["--no-deps", "--no-index", "-w", os.path.join(tmp, "wheel"), src]
        env = dict(os.environ, MAX_JOBS=str(jobs))
        out = subprocess.run(
            [sys.executable, "-c", code, *command],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.split()
        return float(out[0]), float(out[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rev",
        action="append",
        default=[],
        help="a commit to build (repeatable); default: the working tree",
    )
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=os.cpu_count())
    args = parser.parse_args()
    revs = args.rev or [""]
    results = {rev: [] for rev in revs}
    for run in range(args.runs):
        for rev in revs:
            wall, peak = build_once(rev, args.jobs)
            results[rev].append((wall, peak))
            name = rev or "working tree"
            print(
                f"{name}: build {run + 1}: {wall:.1f} s, peak {peak:.0f} MiB",
                flush=True,
            )
    for rev, runs in results.items():
        name = rev or "working tree"
        wall = statistics.median(w for w, _ in runs)
        peak = max(p for _, p in runs)
        print(f"{name}: median {wall:.1f} s wall, largest peak {peak:.0f} MiB")


if __name__ == "__main__":
    main()
