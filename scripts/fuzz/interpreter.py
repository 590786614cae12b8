"""Runs one program (grammar.py) in the processes of one run: the conductor in
the run's first process (the main process, actor "m"), and an actor loop in
every child it starts.

Note [One step at a time]
The conductor runs the steps in order, each to its end before the next: it
sends each actor of the step its command over the actor's control pipe (its
own part, if it is an actor of the step, it runs itself after the others'
commands are out), and waits for every actor's reply. A receiver replies once
the message is in and recorded, so nothing written in a later step can race
with a Queue's feeder still pickling what was sent: in the reference run
(TORCHSHM_DISABLE=1) what every step observes is exactly defined, and the
run with torchshm must observe the same. After each step every live actor
reports the received arrays whose record changed (ops.record).

The log (one line each, written as they come, unbuffered, so that a run cut
short by a hang or a crash keeps what it did) is what the runner compares.
Its first line names the run's torchshm session, the only line that differs
between runs by design.
"""

import atexit
import ctypes
import gc
import json
import multiprocessing as mp
import os
import shutil
import signal
import sys
import threading
import time
import traceback

import numpy as np
import torch
import torch.utils.data

import torchshm
from scripts.fuzz import ops

DISABLED = os.environ.get("TORCHSHM_DISABLE") == "1"
# torch's intra-op pool is GNU OpenMP's, which hangs in a fork child once the
# parent has run a parallel region (the reference run's share_memory_()
# copies in parallel): the actors fork at any time, so one thread.
torch.set_num_threads(1)
STEP_SECONDS = 10.0  # a step that takes longer is a hang
GRACE = 5.0  # the conductor waits longer than the actors' own waits
START_SECONDS = {"fork": 20.0, "spawn": 60.0, "forkserver": 60.0}  # imports torch
RAW_SECONDS = 10.0
# An atexit handler's arrays (a few MiB) arrive well within this; once they
# did not, its process gets little more time to end (a hang there is a bug
# to find within CI's minute).
ATEXIT_SECONDS, AFTER_FAILURE_SECONDS = 6.0, 2.0
# Exit statuses the program plans: an ending step's, and the run's own.
PLANNED = {"return": 0, "sys.exit": 3, "os._exit": 5, "kill": -signal.SIGKILL}


class Space:
    """One process's state: its names, and what it needs to talk and start."""

    def __init__(self):
        self.name = "m"
        self.objs = {}  # name -> ndarray or tensor
        self.shared = set()  # names holding share() results: sent as such
        self.tensors = {}  # reference run: name -> the shared tensor behind it
        self.seen = {}  # name -> last record, for the received ones
        self.children = {}  # actor -> multiprocessing.Process
        self.setup = None  # (control ends of every actor, channels, tmpdir)

    def become(self, name, setup):
        """A new actor: a fork child keeps the arrays it inherited."""
        self.name, self.setup, self.children = name, setup, {}


SPACE = Space()


def channel(name):
    return SPACE.setup[1][name]


# ------------------------------------------------------------------ ops


def op_new(cmd):
    path = os.path.join(SPACE.setup[2], f"{SPACE.name}-{cmd['var']}")
    SPACE.objs[cmd["var"]] = ops.make(
        cmd["make"], cmd["dtype"], cmd["shape"], cmd["order"], cmd["fill"], path
    )


def op_view(cmd):
    SPACE.objs[cmd["var"]] = ops.view(SPACE.objs[cmd["src"]], cmd["how"])


def op_tensor(cmd):
    SPACE.objs[cmd["var"]] = torch.from_numpy(SPACE.objs[cmd["src"]])


def op_write(cmd):
    ops.write(SPACE.objs[cmd["var"]], cmd["fill"], cmd["part"])


def op_resize(cmd):
    SPACE.objs[cmd["var"]].resize(cmd["n"], refcheck=False)
    return {"resize": "ok"}


def op_del(cmd):
    for table in (SPACE.objs, SPACE.tensors, SPACE.seen):
        table.pop(cmd["var"], None)
    SPACE.shared.discard(cmd["var"])
    gc.collect()


def op_share(cmd):
    """torchshm.share(), or in the reference run its meaning: a copy in
    shared memory that every holder writes (a torch shared tensor, of bytes
    for any dtype, sent as a tensor), the original itself for an array born
    shared, an ordinary copy below the threshold."""
    a, name = SPACE.objs[cmd["src"]], cmd["var"]
    shared = a.nbytes >= torchshm.get_threshold()
    if not DISABLED:
        SPACE.objs[name] = torchshm.share(a)
    elif not shared:
        SPACE.objs[name] = a.copy()
    else:
        t = torch.from_numpy(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
        SPACE.tensors[name] = (t.clone().share_memory_(), a.dtype, a.shape)
        SPACE.objs[name] = as_shared_array(SPACE.tensors[name])
        if torchshm.is_shared(a):  # born: share() returns the same memory
            SPACE.objs[cmd["src"]] = SPACE.objs[name]
    if shared:
        SPACE.shared.add(name)


def as_shared_array(emulated):
    t, dtype, shape = emulated
    return t.numpy().view(dtype).reshape(shape)


def message(names):
    items = []
    for name in names:
        if name in SPACE.shared:
            items.append(("share", SPACE.tensors.get(name, SPACE.objs[name])))
        else:
            items.append(("plain", SPACE.objs[name]))
    return items


def op_send(cmd):
    try:
        msg = message(cmd["items"])
    except Exception:
        put(cmd["chan"], BROKEN)  # the receiver need not wait for nothing
        raise
    put(cmd["chan"], msg)


BROKEN = "broken"


def put(chan, msg):
    if chan.startswith("q"):
        channel(chan).put(msg)
    else:
        channel(chan)[1].send(msg)


def get(chan, seconds=STEP_SECONDS):
    if chan.startswith("q"):
        return channel(chan).get(timeout=seconds)
    reader = channel(chan)[0]
    if not reader.poll(seconds):
        raise TimeoutError(f"nothing on {chan}")
    return reader.recv()


def keep(name, mode, obj):
    """Stores a received object; returns its arrival record."""
    if mode == "share":
        SPACE.shared.add(name)
        if isinstance(obj, tuple):  # the reference run's share()
            SPACE.tensors[name], obj = obj, as_shared_array(obj)
    SPACE.objs[name] = obj
    SPACE.seen[name] = ops.record(obj)
    return [name, SPACE.seen[name]]


def op_recv(cmd):
    names, arrivals = list(cmd["as"]), []
    while names:
        msg = get(cmd["chan"], cmd.get("seconds", STEP_SECONDS))
        if msg == BROKEN:
            raise RuntimeError("the sender failed")
        for mode, obj in msg:
            arrivals.append(keep(names.pop(0), mode, obj))
    return {"arrivals": arrivals}


def op_observe(cmd):
    changes = []
    for name in sorted(SPACE.seen):
        now = ops.record(SPACE.objs[name])
        if now != SPACE.seen[name]:
            SPACE.seen[name] = now
            changes.append([name, now])
    return {"changes": changes}


def op_start(cmd):
    ctx = mp.get_context(cmd["method"])
    child = ctx.Process(
        target=actor_entry, args=(cmd["child"], SPACE.setup), name=cmd["child"]
    )
    child.start()
    SPACE.children[cmd["child"]] = child
    return {"pid": child.pid}


def op_reap(cmd):
    child = SPACE.children[cmd["child"]]
    child.join(cmd.get("seconds", STEP_SECONDS))
    if child.exitcode is None:
        return {"alive": True}
    return {"status": child.exitcode}


def op_pool(cmd):
    init, args = (ops.set_allocator, (True,)) if cmd["init"] else (None, ())
    tasks = [
        (cmd["nbytes"], cmd["fill"] + i, cmd["reuse"]) for i in range(cmd["count"])
    ]
    pool = mp.get_context("fork").Pool(cmd["workers"], init, args)
    try:
        results = pool.map_async(ops.pool_task, tasks, chunksize=1).get(STEP_SECONDS)
    finally:
        pool.close()
        bounded(pool.join, pool.terminate)
    return {"arrivals": [keep(n, "plain", r) for n, r in zip(cmd["as"], results)]}


def bounded(wait, otherwise):
    """Calls a wait that takes no timeout; `otherwise` if it is not done in
    time (a hang shows as the step's)."""
    done = threading.Thread(target=wait, daemon=True)
    done.start()
    done.join(STEP_SECONDS)
    if done.is_alive():
        otherwise()


def op_loader(cmd):
    workers, batch = cmd["workers"], cmd["batch"]
    acked = cmd["reuse"] and batch is None  # Note in ops.RefillDataset
    ctx = mp.get_context("fork")
    acks = [ctx.Semaphore(0) for _ in range(workers)] if acked else []
    data = ops.RefillDataset(
        cmd["count"], cmd["nbytes"], cmd["fill"], cmd["reuse"], acks
    )
    collate = {"identity": ops.identity, "stack": np.stack}.get(cmd["collate"])
    loader = torch.utils.data.DataLoader(
        data,
        batch_size=batch,
        num_workers=workers,
        multiprocessing_context="fork",
        timeout=STEP_SECONDS,
        **({"collate_fn": collate} if collate else {}),  # else torch's default
    )
    arrivals = []
    for j, item in enumerate(loader):
        arrivals.append(keep(cmd["as"][j], "plain", item))
        if acks:
            acks[j % workers].release()
    del loader
    return {"arrivals": arrivals}


def op_rawfork(cmd):
    """A fork that skips Python's at-fork hooks (a C library's fork). The
    child does one simple thing and exits; this process waits for it."""
    r, w = os.pipe()
    pid = ctypes.CDLL(None).fork()
    if pid == 0:
        os.close(r)
        raw_child(cmd, w)
    os.close(w)
    deadline = time.monotonic() + RAW_SECONDS
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = None
            break
        time.sleep(0.002)
    with os.fdopen(r, "rb") as f:
        read = f.read().decode()
    code = "hung" if status is None else os.waitstatus_to_exitcode(status)
    return {"raw": code, "read": read}


def raw_child(cmd, w):
    action, name = cmd["action"], cmd["var"]
    if action == "read":
        os.write(w, ops.record(SPACE.objs[name]).encode())
    elif action == "drop":
        del SPACE.objs[name]
        SPACE.seen.pop(name, None)
        gc.collect()
    elif action == "send":
        put(cmd["chan"], message([name]))
    os.close(w)
    if cmd["exit"] == "sys.exit":
        sys.exit(0)  # unwinds through the caller's frames: a program's exit
    os._exit(0)


OPS = {
    "new": op_new,
    "view": op_view,
    "tensor": op_tensor,
    "write": op_write,
    "resize": op_resize,
    "del": op_del,
    "share": op_share,
    "send": op_send,
    "recv": op_recv,
    "observe": op_observe,
    "start": op_start,
    "reap": op_reap,
    "pool": op_pool,
    "loader": op_loader,
    "rawfork": op_rawfork,
}


def execute(cmd):
    """Runs a command (in a thread of its own if it says so); an exception
    is part of the result: the two runs must raise the same."""
    result = {}

    def run():
        try:
            result.update(OPS[cmd["op"]](cmd) or {})
        except Exception as exc:
            traceback.print_exc()
            result["error"] = type(exc).__name__

    if cmd.get("thread"):
        thread = threading.Thread(target=run)
        thread.start()
        thread.join()
    else:
        run()
    return result


# ---------------------------------------------------------------- actors


def actor_entry(name, setup):
    """A child's loop: a command, its reply, until an ending command."""
    SPACE.become(name, setup)
    conn = setup[0][name]
    conn.send({"ready": os.getpid()})
    while True:
        cmd = conn.recv()
        if cmd["op"] == "atexit":
            atexit.register(
                ops.atexit_send, channel(cmd["chan"]), cmd["sizes"], cmd["fill"]
            )
        if cmd["op"] in ("end", "atexit"):
            conn.send({"ending": True})
            how = cmd["how"]
            if how == "sys.exit":
                sys.exit(PLANNED[how])
            if how == "os._exit":
                os._exit(PLANNED[how])
            return
        conn.send(execute(cmd))


# ------------------------------------------------------------- conductor


class Conductor:
    def __init__(self, program, log_fd):
        self.program, self.log_fd = program, log_fd
        self.actors = {"m": None}  # actor -> parent
        self.methods = {}
        for step in program["steps"]:
            if step["op"] == "start":
                self.actors[step["child"]] = step["at"]
                self.methods[step["child"]] = step["method"]
        self.pids = {"m": os.getpid()}
        self.alive = {"m"}
        self.planned = {}  # actor -> exit status its ending planned
        self.statuses = {}
        self.step = None

    def log(self, *words):
        os.write(self.log_fd, (" ".join(map(str, words)) + "\n").encode())

    def setup(self, tmpdir):
        spawn = mp.get_context("spawn")  # its Queues go to children of any method
        chans = {}
        for name in sorted({s["chan"] for s in self.program["steps"] if s.get("chan")}):
            chans[name] = spawn.Queue() if name.startswith("q") else mp.Pipe(False)
        pipes = {a: mp.Pipe() for a in self.actors if a != "m"}
        self.ctrl = {a: p[0] for a, p in pipes.items()}
        SPACE.setup = ({a: p[1] for a, p in pipes.items()}, chans, tmpdir)

    # One step: every actor's command out, this process's own part, replies.
    def together(self, commands):
        for actor, cmd in commands:
            if actor != "m":
                self.ctrl[actor].send(cmd)
        replies = {}
        for actor, cmd in commands:
            if actor == "m":
                replies[actor] = execute(cmd)
        for actor, cmd in commands:
            if actor != "m":
                replies[actor] = self.reply(actor, STEP_SECONDS + GRACE)
        return replies

    def reply(self, actor, seconds):
        deadline = time.monotonic() + seconds
        conn = self.ctrl[actor]
        while not conn.poll(0.02):
            if not running(self.pids.get(actor)):
                if conn.poll(0.1):
                    break
                self.died(actor)
                return {"died": True}
            if time.monotonic() > deadline:
                self.hang(actor)
        return conn.recv()

    def hang(self, actor):
        """Ends the whole run (its process group: pool and loader workers
        too); the runner reads the hang from the log."""
        self.log("hang", self.step, actor)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    def died(self, actor):
        self.alive.discard(actor)
        self.log(self.step, actor, "died")
        self.reap(actor)

    def reap(self, actor, seconds=STEP_SECONDS):
        """The actor's exit status, from its parent (a hang if it runs on)."""
        parent = self.actors[actor]
        cmd = {"op": "reap", "child": actor, "seconds": seconds}
        if parent == "m":
            reply = execute(cmd)
        elif parent in self.alive:
            reply = self.together([(parent, cmd)])[parent]
        else:
            reply = {"status": "unknown"}
        if reply.get("alive"):
            self.hang(actor)
        status = reply.get("status", reply.get("error"))
        self.statuses[actor] = status
        planned = self.planned.get(actor, "-")
        self.log(self.step, actor, "status", status, "planned", planned)
        self.alive.discard(actor)

    def run(self, tmpdir):
        self.setup(tmpdir)
        for i, step in enumerate(self.program["steps"]):
            self.step = i
            self.log("step", i, step["op"], step["at"])
            involved = {step["at"], step.get("to") or step["at"]}
            if not involved <= self.alive:
                self.log(i, "skip")
                continue
            began = time.monotonic()
            self.run_step(step)
            self.observe()
            if time.monotonic() - began > 1:  # "#": not compared
                self.log(f"# step {i} took {time.monotonic() - began:.1f} s")
        self.step = "end"
        for actor in reversed(list(self.actors)):
            if actor in self.alive and actor != "m":
                self.end(actor, "return")
        how = self.program["exit"]
        self.log("exit", how)
        return PLANNED[how]

    def run_step(self, step):
        op, at = step["op"], step["at"]
        cmd = dict(step)
        if op == "start":
            reply = self.together([(at, cmd)])[at]
            self.report(at, reply)
            if "pid" in reply:
                self.started(step["child"], reply["pid"])
        elif op == "end":
            self.end(at, step["how"])
        elif op in ("send", "atexit") or (op == "rawfork" and step["action"] == "send"):
            recv = {"op": "recv", "chan": step["chan"], "as": step["as"]}
            if op == "atexit":
                recv["seconds"] = ATEXIT_SECONDS
            replies = self.together([(step["to"], recv), (at, cmd)])
            for actor in (step["to"], at):
                self.report(actor, replies[actor])
            if op == "atexit":
                self.planned[at] = PLANNED[step["how"]]
                failed = "error" in replies[step["to"]]
                self.reap(at, AFTER_FAILURE_SECONDS if failed else STEP_SECONDS)
        else:
            self.report(at, self.together([(at, cmd)])[at])

    def started(self, child, pid):
        self.pids[child] = pid
        reply = self.reply(child, START_SECONDS[self.methods[child]])
        if reply.get("ready"):
            self.alive.add(child)

    def end(self, actor, how):
        self.planned[actor] = PLANNED[how]
        if how == "kill":
            os.kill(self.pids[actor], signal.SIGKILL)
        else:
            self.report(
                actor, self.together([(actor, {"op": "end", "how": how})])[actor]
            )
        self.alive.discard(actor)
        self.reap(actor)

    def report(self, actor, reply):
        for name, rec in reply.get("arrivals", ()):
            self.log(self.step, actor, "arrive", name, rec)
        if "raw" in reply:
            self.log(self.step, actor, "raw", reply["raw"], reply["read"])
        for key in ("resize", "error"):
            if key in reply:
                self.log(self.step, actor, key, reply[key])

    def observe(self):
        live = sorted(self.alive)
        replies = self.together([(a, {"op": "observe"}) for a in live])
        for actor in live:
            for name, rec in replies[actor].get("changes", ()):
                self.log(self.step, actor, "change", name, rec)


def running(pid):
    """Whether a process (not necessarily a child of this one) still runs."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def main(program_path, log_path):
    """Runs the program; returns the exit status it plans for this process
    (os._exit exits here). The first log line names the torchshm session."""
    with open(program_path) as f:
        program = json.load(f)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    from torchshm._lifetime import session

    os.write(fd, f"session {session.session_id()}\n".encode())
    # Forkserver children fork from a server that has this module loaded.
    mp.set_forkserver_preload(["scripts.fuzz.interpreter"])
    # Memmaps' files beside the log (runner.Runner.forget removes what a run
    # cut short left).
    tmpdir = log_path + ".memmaps"
    os.makedirs(tmpdir)
    code = Conductor(program, fd).run(tmpdir)
    shutil.rmtree(tmpdir, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    if program["exit"] == "os._exit":
        os._exit(code)
    return code
