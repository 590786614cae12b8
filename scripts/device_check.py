"""The device script: on a GPU machine, builds torchshm, runs the CUDA-only
checks and the GPU scenario, and writes what they found into OUT.

    python3 scripts/device_check.py OUT            # make device OUT=...
    python3 scripts/device_check.py OUT --fake     # on a CPU: the harness only

Steps, each with its log in OUT:
1. build: `pip install --no-build-isolation --no-deps -e .` with this Python
   and --cxx (default g++-12, as compiler and linker, whatever $CXX and $CC
   say: the device image sets them to its /opt/gcc wrapper, which links
   libstdc++ statically and crashes with torch: facts section 13), MAX_JOBS =
   the cores (build.log);
2. the CUDA-only checks, tests/device_checks.py (checks.log);
3. the GPU scenario, `python -m benchmarks.gpu` (gpu.json, gpu.md).
Then summary.md (the three results and the table) and device.json. The
steps' budgets keep the whole under 8 minutes on 16 cores. With --fake no
step needs a GPU: the build and the checks are skipped and the scenario
runs its harness through the fake CUDA runtime (tests/test_device_script.py
runs that).
"""

import argparse
import json
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Seconds each step may take (the whole: under 8 minutes).
BUDGETS = {"build": 150, "checks": 120, "scenario": 200}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the folder the results go to")
    parser.add_argument(
        "--fake", action="store_true", help="no GPU: the scenario's harness only"
    )
    parser.add_argument("--no-build", action="store_true", help="built already")
    parser.add_argument(
        "--cxx", default="g++-12", help="the compiler and linker (not $CXX)"
    )
    parser.add_argument(
        "--workers", default=None, help="the scenario's worker counts, e.g. 1,4,14"
    )
    parser.add_argument(
        "--samples", type=int, default=2048, help="the scenario's samples per epoch"
    )
    return parser.parse_args(argv)


def step(name, command, out, env=None):
    """Runs `command` from the checkout's root within its budget, its output
    into OUT/<name>.log; (exit status or "timed out", seconds)."""
    start = time.monotonic()
    with open(os.path.join(out, f"{name}.log"), "w") as log:
        try:
            status = subprocess.run(
                command,
                cwd=ROOT,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                timeout=BUDGETS[name],
            ).returncode
        except subprocess.TimeoutExpired:
            status = "timed out"
    return status, time.monotonic() - start


def tail(out, name, lines=15):
    path = os.path.join(out, f"{name}.log")
    try:
        with open(path) as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def summary(results, out):
    """summary.md's text from the steps' results."""
    lines = [f"# Device check, {results['date']}", ""]
    lines.append(f"Machine: {results['machine']}; Python {results['python']}.")
    lines.append("")
    lines.append("| step | status | seconds |")
    lines.append("| --- | --- | --- |")
    for name in ("build", "checks", "scenario"):
        status, seconds = results["steps"].get(name, ("skipped", 0.0))
        shown = "ok" if status == 0 else status
        lines.append(f"| {name} | {shown} | {seconds:.0f} |")
    lines.append("")
    table = os.path.join(out, "gpu.md")
    if os.path.exists(table):
        with open(table) as f:
            lines.append(f.read())
    for name in ("build", "checks", "scenario"):
        status = results["steps"].get(name, ("skipped", 0))[0]
        if status not in (0, "skipped"):
            lines += [
                f"## {name}: the end of its log",
                "",
                "```",
                tail(out, name),
                "```",
            ]
    return "\n".join(lines) + "\n"


def main(argv=None):
    args = parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    out = os.path.abspath(args.out)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    results = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.node()}, {os.cpu_count()} cores",
        "python": platform.python_version(),
        "fake": args.fake,
        "steps": {},
    }
    if not (args.fake or args.no_build):
        # The image sets CXX=/opt/gcc/bin/g++ and CC=/opt/gcc/bin/gcc (the
        # static wrapper), and setuptools links with LDCXXSHARED or LDSHARED
        # (derived from CC): all three name --cxx, whatever the environment.
        build_env = dict(
            env,
            CXX=args.cxx,
            LDSHARED=f"{args.cxx} -shared",
            LDCXXSHARED=f"{args.cxx} -shared",
            MAX_JOBS=str(os.cpu_count()),
        )
        results["steps"]["build"] = step(
            "build",
            [sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation"]
            + ["--no-deps", "-e", "."],
            out,
            build_env,
        )
    if not args.fake:
        results["steps"]["checks"] = step(
            "checks",
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
            + ["tests/device_checks.py"],
            out,
            env,
        )
    scenario = [sys.executable, "-m", "benchmarks.gpu", "--out", out]
    scenario += ["--samples", str(args.samples)]
    scenario += ["--workers", args.workers] if args.workers else []
    scenario += ["--fake"] if args.fake else []
    results["steps"]["scenario"] = step("scenario", scenario, out, env)
    with open(os.path.join(out, "device.json"), "w") as f:
        json.dump(results, f, indent=1)
    text = summary(results, out)
    with open(os.path.join(out, "summary.md"), "w") as f:
        f.write(text)
    print(text)
    return 0 if all(s == 0 for s, _ in results["steps"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
