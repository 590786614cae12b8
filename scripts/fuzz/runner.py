"""Runs a program twice, with torchshm and with TORCHSHM_DISABLE=1 (the
reference: torchshm imported, its reducers not registered, so arrays are
pickled byte by byte), at the same time, each a fresh process forked from the
zygote; compares their logs and judges.

Judgements, in this order: "unavailable" (a run could not import torchshm:
the extension being rebuilt), "invalid" (the reference run itself hung or
ended a process the program did not plan to: the fuzzer's fault, reported
apart), "hang", "crash" (a process of the torchshm run ended in a way the
program did not plan: a signal, a status, a raw fork child that did not exit
0), "difference" (the logs differ), or None. Leftovers are judged later,
LEFTOVER_SECONDS after a run ended (leftovers.py).
"""

import difflib
import json
import os
import shutil
import subprocess
import sys
import time

from scripts.fuzz import leftovers

ROOT = leftovers.ROOT
MODES = {"torchshm": {}, "reference": {"TORCHSHM_DISABLE": "1"}}
PROGRAM_SECONDS = 60.0
START_SECONDS = 40.0  # more for each spawn or forkserver child (imports torch)
LEFTOVER_SECONDS = 5.0  # a keeper exits about 1 s after its last member
PLANNED_EXIT = {"return": 0, "sys.exit": 3, "os._exit": 5}  # interpreter.PLANNED


class Zygote:
    """The client of zygote.py."""

    def __init__(self):
        env = {k: v for k, v in os.environ.items() if not k.startswith("TORCHSHM_")}
        self.proc = subprocess.Popen(
            [sys.executable, "-c", "from scripts.fuzz.zygote import serve; serve()"],
            cwd=ROOT,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.done, self.next_id = {}, 0
        ready = self.read()
        if "ready" not in ready:
            raise RuntimeError(f"the zygote did not start: {ready}")

    def read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError("the zygote exited")
        return json.loads(line)

    def start(self, request):
        self.next_id += 1
        request["id"] = self.next_id
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return self.next_id

    def wait(self, ids):
        """{id: the start and end replies merged} for every id."""
        started = {}
        while not all(i in self.done for i in ids):
            reply = self.read()
            if "pid" in reply:
                started[reply["id"]] = reply
            else:
                self.done[reply["id"]] = {**started.pop(reply["id"], {}), **reply}
        return {i: self.done.pop(i) for i in ids}

    def close(self):
        self.proc.stdin.close()
        self.proc.wait(30)


class Run:
    """One run's log and ending."""

    def __init__(self, mode, program, reply, log_path, output_path):
        self.mode, self.program = mode, program
        self.status, self.timed_out = reply["status"], reply["timed_out"]
        self.pid, self.seconds = reply["pid"], reply["seconds"]
        self.log_path, self.output_path = log_path, output_path
        self.ended_at = time.monotonic()
        try:
            with open(log_path) as f:
                self.lines = f.read().splitlines()
        except FileNotFoundError:
            self.lines = []
        first = self.lines[0].split() if self.lines else []
        self.session = first[1] if first[:1] == ["session"] else None
        self.compared = [
            line for line in self.lines if not line.startswith(("session ", "#"))
        ]

    @property
    def hung(self):
        return self.timed_out or any(line.startswith("hang ") for line in self.lines)

    def crashes(self):
        """Lines that say a process ended in a way the program did not plan,
        and the run's own status if it was not the planned one."""
        found = []
        for line in self.lines:
            words = line.split()
            if words[2:3] == ["died"] or (words[2:3] == ["raw"] and words[3] != "0"):
                found.append(line)
            elif words[2:3] == ["status"] and words[3] != words[5]:
                found.append(line)
        planned = PLANNED_EXIT[self.program["exit"]]
        if not self.hung and self.status != planned:
            found.append(
                f"the run's main process ended with {self.status}, planned {planned}"
            )
        return found

    def output_tail(self, lines=12):
        try:
            with open(self.output_path, errors="replace") as f:
                return f.read().splitlines()[-lines:]
        except OSError:
            return []


class Outcome:
    def __init__(self, program, runs):
        self.program, self.runs = program, runs
        test, ref = runs["torchshm"], runs["reference"]
        self.kind, self.detail = judge(test, ref)

    def diff(self, limit=40):
        ref, test = self.runs["reference"], self.runs["torchshm"]
        lines = list(
            difflib.unified_diff(
                ref.compared, test.compared, "reference", "torchshm", lineterm="", n=2
            )
        )
        return lines[:limit] + (
            [f"... {len(lines) - limit} more"] if len(lines) > limit else []
        )


def judge(test, ref):
    """(kind, detail lines)."""
    if test.session is None or ref.session is None:
        missing = test if test.session is None else ref
        return "unavailable", missing.output_tail()
    if ref.hung or ref.crashes():
        hangs = [line for line in ref.lines if line.startswith("hang ")]
        return "invalid", hangs + ref.crashes() + ref.output_tail()
    if test.hung:
        last = [line for line in test.lines if line.startswith("hang ")]
        return "hang", last or [f"the run was killed after {test.seconds} s"]
    crashes = test.crashes()
    if crashes:
        return "crash", crashes + test.output_tail(6)
    if test.compared != ref.compared:
        return "difference", []
    return None, []


class Runner:
    def __init__(self, workdir):
        self.workdir = workdir
        self.zygote = Zygote()
        self.count = 0

    def run(self, program):
        """Both runs of `program`; an Outcome."""
        self.count += 1
        stem = os.path.join(self.workdir, f"{program['seed']}-{self.count}")
        with open(stem + ".json", "w") as f:
            json.dump(program, f)
        base = {k: v for k, v in os.environ.items() if not k.startswith("TORCHSHM_")}
        if program["threshold"] is not None:
            base["TORCHSHM_THRESHOLD"] = str(program["threshold"])
        base["PYTHONFAULTHANDLER"] = "1"  # a crash's stacks in the run's output
        slow = sum(
            s["op"] == "start" and s["method"] != "fork" for s in program["steps"]
        )
        ids = {}
        for mode, env in MODES.items():
            ids[mode] = self.zygote.start(
                {
                    "program": stem + ".json",
                    "log": f"{stem}.{mode}.log",
                    "output": f"{stem}.{mode}.out",
                    "env": {**base, **env},
                    "timeout": PROGRAM_SECONDS + START_SECONDS * slow,
                }
            )
        replies = self.zygote.wait(list(ids.values()))
        runs = {
            mode: Run(
                mode, program, replies[i], f"{stem}.{mode}.log", f"{stem}.{mode}.out"
            )
            for mode, i in ids.items()
        }
        return Outcome(program, runs)

    def forget(self, outcome):
        """Removes a program's files (kept only for findings)."""
        for run in outcome.runs.values():
            shutil.rmtree(run.log_path + ".memmaps", ignore_errors=True)
            for path in (run.log_path, run.output_path):
                if os.path.exists(path):
                    os.unlink(path)
        program_path = run.log_path.rsplit(".", 2)[0] + ".json"
        if os.path.exists(program_path):
            os.unlink(program_path)

    def close(self):
        self.zygote.close()


def left_behind(run, wait=True):
    """What `run` left, LEFTOVER_SECONDS after it ended (waits until then if
    asked); killed once seen."""
    if wait:
        time.sleep(max(0.0, run.ended_at + LEFTOVER_SECONDS - time.monotonic()))
    found = leftovers.left_behind(run.session, run.pid)
    if found:  # a busy machine: a little more time before it counts
        time.sleep(LEFTOVER_SECONDS)
        found = leftovers.left_behind(run.session, run.pid)
    leftovers.clean_up(run.session, run.pid)
    return found
