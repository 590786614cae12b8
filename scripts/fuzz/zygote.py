"""The fork server of the runs. Importing torch takes 3-4 s here; each run is a
fresh process forked from this one, which has imported torch and NumPy but
never torchshm, so a run begins by importing torchshm with its own
environment (TORCHSHM_DISABLE, TORCHSHM_THRESHOLD, no TORCHSHM_SESSION: a
session of its own).

Requests come on stdin, one JSON object a line: id, program, log, output
(the run's stdout and stderr), env, timeout. Replies go to stdout, one JSON
object a line: {"id", "pid"} at the start, {"id", "status", "timed_out",
"seconds"} at the end. A run is the leader of a process session of its own
(its pid is the session's and the process group's id): a run past its
timeout is killed with its whole group. The runner that started this server
ends it by closing stdin.
"""

import json
import os
import select
import signal
import sys
import time


def serve():
    import multiprocessing.pool  # noqa: F401  - what every run imports, once
    import multiprocessing.queues  # noqa: F401

    import numpy  # noqa: F401
    import torch  # noqa: F401
    import torch.utils.data  # noqa: F401

    reply({"ready": os.getpid()})
    runs, pending = {}, b""
    while True:
        if select.select([0], [], [], 0.01)[0]:
            data = os.read(0, 1 << 16)
            if not data:
                for pid in runs:
                    kill_group(pid)
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    run(request)  # raises SystemExit: never comes back here
                runs[pid] = [request, time.monotonic(), False]
                reply({"id": request["id"], "pid": pid})
        now = time.monotonic()
        for pid, (request, began, killed) in runs.items():
            if not killed and now - began > request["timeout"]:
                kill_group(pid)
                runs[pid][2] = True
        while runs:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if not pid:
                break
            request, began, killed = runs.pop(pid)
            if killed:  # what else the group held
                kill_group(pid)
            reply(
                {
                    "id": request["id"],
                    "status": os.waitstatus_to_exitcode(status),
                    "timed_out": killed,
                    "seconds": round(time.monotonic() - began, 3),
                }
            )


def kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def reply(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def run(request):
    """In the forked run: its own session, output and environment; then the
    program. Ends by raising SystemExit through serve(), so that the run
    exits as a program does (atexit handlers, torchshm's exit hook)."""
    os.setsid()
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    out = os.open(request["output"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(null)
    os.close(out)
    os.environ.clear()
    os.environ.update(request["env"])
    from scripts.fuzz import interpreter

    raise SystemExit(interpreter.main(request["program"], request["log"]))
