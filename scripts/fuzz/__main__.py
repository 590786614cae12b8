"""The command line: python -m scripts.fuzz --minutes N [--seed S]
[--replay SEED | --program FILE] [--keep-going] (scripts/fuzz/__init__.py).
Prints each finding (its seed, kind, the difference, a shrunk program) as it
comes and a summary line at the end; exits 1 if anything was found."""

import argparse
import json
import os
import random
import shlex
import shutil
import sys
import tempfile
import time

from scripts.fuzz import draw, grammar, runner, shrink

KINDS = ("difference", "crash", "hang", "leftover")
# `make build` may be replacing the extension while a run imports it.
UNAVAILABLE_TRIES, UNAVAILABLE_WAIT = 3, 30


def parse(argv=None):
    parser = argparse.ArgumentParser(
        prog="python -m scripts.fuzz", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--minutes", type=float, default=1.0, help="time to draw programs")
    add("--seed", type=int, help="the first program's seed (then +1 each)")
    add("--replay", type=int, metavar="SEED", help="run that seed's program")
    add("--program", metavar="FILE", help="run a program from a JSON file")
    add("--keep-going", action="store_true", help="go on after a finding")
    add("--shrink-seconds", type=float, default=60.0, help="per finding")
    add(
        "--without",
        action="append",
        default=[],
        choices=sorted(draw.EPISODES),
        help="leave an episode out of drawn programs (to look past a known bug)",
    )
    add("-v", "--verbose", action="store_true", help="a line for each program")
    return parser.parse_args(argv)


def say(*lines, indent=""):
    for line in lines:
        print(f"{indent}{line}", flush=True)


def detail(outcome):
    if outcome.kind == "difference":
        head = "first differences (the reference run's log -> torchshm's):"
        return [head] + outcome.diff()
    return outcome.detail


class Fuzz:
    def __init__(self, args):
        self.args = args
        self.workdir = tempfile.mkdtemp(prefix="torchshm-fuzz-")
        self.runner = runner.Runner(self.workdir)
        self.began = time.monotonic()
        self.counts = dict.fromkeys(KINDS + ("invalid",), 0)
        self.programs = 0
        # (run, program, report): runs whose leftovers are still to be looked
        # for; a shrinking try's are only cleaned up.
        self.pending = []
        self.stopped = False

    def elapsed(self):
        return time.monotonic() - self.began

    def run(self, program, report=True):
        for _ in range(UNAVAILABLE_TRIES):
            outcome = self.runner.run(program)
            if outcome.kind != "unavailable":
                self.pending += [(r, program, report) for r in outcome.runs.values()]
                return outcome
            say(f"fuzz: a run did not import torchshm; again in {UNAVAILABLE_WAIT} s:")
            say(*outcome.detail[-3:], indent="    ")
            time.sleep(UNAVAILABLE_WAIT)
        raise SystemExit("fuzz: torchshm does not import (the run's output is above)")

    def one(self, program):
        """Runs a drawn program; reports what it shows."""
        outcome = self.run(program)
        self.programs += 1
        if self.args.verbose:
            seconds = max(r.seconds for r in outcome.runs.values())
            say(
                f"fuzz: seed {program['seed']}, {len(program['steps'])} steps,"
                f" {seconds:.1f} s: {outcome.kind or 'same'}"
            )
        if outcome.kind == "invalid":
            self.counts["invalid"] += 1
            seed = program["seed"]
            say(f"fuzz: seed {seed}: the reference run failed (a fuzzer bug):")
            say(*outcome.detail, *grammar.describe_program(program), indent="    ")
        elif outcome.kind:
            self.finding(outcome.kind, program, detail(outcome))
        else:
            self.runner.forget(outcome)
        self.look_for_leftovers(wait=False)

    def look_for_leftovers(self, wait):
        now = time.monotonic()
        for item in list(self.pending):
            run, program, report = item
            if wait or run.ended_at + runner.LEFTOVER_SECONDS < now:
                self.pending.remove(item)
                found = runner.left_behind(run)
                if found and report and not self.stopped:
                    head = (
                        f"the {run.mode} run left, {runner.LEFTOVER_SECONDS:g} s after:"
                    )
                    self.finding("leftover", program, [head] + found, run.mode)

    def finding(self, kind, program, lines, mode=None):
        self.counts[kind] += 1
        say(
            f"fuzz: FOUND a {kind} after {self.elapsed():.1f} s: seed"
            f" {program['seed']} ({len(program['steps'])} steps)"
        )
        say(*lines[:40], indent="    ")
        began, shown = time.monotonic(), {}

        def reproduces(candidate):
            if kind == "leftover":
                outcome = self.runner.run(candidate)
                other = "reference" if mode == "torchshm" else "torchshm"
                runner.left_behind(outcome.runs[other])  # cleaned up
                found = runner.left_behind(outcome.runs[mode])
                ok, lines = outcome.kind is None and bool(found), found
            else:
                outcome = self.run(candidate, report=False)
                ok, lines = outcome.kind == kind, detail(outcome)
            self.runner.forget(outcome)
            if ok:
                shown["lines"] = lines
            return ok

        small, tries = shrink.shrink(program, reproduces, self.args.shrink_seconds)
        path = os.path.join(self.workdir, f"seed-{program['seed']}-shrunk.json")
        with open(path, "w") as f:
            json.dump(small, f)
        seconds = time.monotonic() - began
        again = [sys.executable, "-m", "scripts.fuzz"]
        replay = again + ["--replay", str(program["seed"])]
        replay += [f"--without={w}" for w in self.args.without]
        say(
            f"shrunk to {len(small['steps'])} steps ({tries} tries, {seconds:.0f} s):",
            indent="    ",
        )
        say(*grammar.describe_program(small), indent="      ")
        if small != program and shown:
            say("which shows:", indent="    ")
            say(*shown["lines"][:40], indent="      ")
        say(
            f"shrunk program: {json.dumps(small)}",
            f"again: {shlex.join(replay)}",
            f"   or: {shlex.join(again + ['--program', path])}",
            indent="    ",
        )
        if not self.args.keep_going:
            self.stopped = True

    def summary(self):
        c = self.counts
        invalid = f", {c['invalid']} invalid" if c["invalid"] else ""
        say(
            f"fuzz: {self.programs} programs, {c['difference']} differences,"
            f" {c['crash']} crashes, {c['hang']} hangs, {c['leftover']} leftovers"
            f"{invalid} in {self.elapsed():.0f} s"
        )
        return 1 if any(c[k] for k in KINDS) else 0


def main(argv=None):
    args = parse(argv)
    fuzz = Fuzz(args)
    try:
        if args.program or args.replay is not None:
            if args.program:
                with open(args.program) as f:
                    program = json.load(f)
            else:
                program = draw.generate(args.replay, args.without)
            say(*grammar.describe_program(program), indent="  ")
            fuzz.one(program)
        else:
            seed = args.seed if args.seed is not None else random.randrange(1 << 31)
            say(f"fuzz: {args.minutes:g} min from seed {seed}; runs in {fuzz.workdir}")
            while fuzz.elapsed() < args.minutes * 60 and not fuzz.stopped:
                fuzz.one(draw.generate(seed, args.without))
                seed += 1
        fuzz.look_for_leftovers(wait=True)
    finally:
        fuzz.runner.close()
    status = fuzz.summary()
    if not status and not fuzz.counts["invalid"]:  # nothing to look at
        shutil.rmtree(fuzz.workdir, ignore_errors=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
