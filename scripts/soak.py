"""The standing fault test: senders, receivers and the session keeper under
random SIGKILL and SIGSTOP, for N minutes.

    .venv/bin/python scripts/soak.py --minutes 1            # CI
    make soak SOAK_MINUTES=10                               # the closing note

The run is a series of rounds. Each round draws a configuration from the seed
(printed; `--seed` repeats the same configurations, `--rounds` stops after as
many): start method fork or spawn, TORCHSHM_POOL_BYTES=0 or the default pool,
a low soft fd limit in senders or receivers (hard limit untouched), message
sizes from 1 KiB to a few MiB, 1-4 senders each with its own channel (Pipe,
duplex Pipe, SimpleQueue or Queue) and 1-3 receivers each reading one or
more channels in a thread per channel, and a schedule of faults: senders
SIGKILLed after they sent something, senders and receivers stopped for up to
two seconds, the keeper SIGKILLed or stopped, sometimes one receiver
SIGKILLed. In some rounds a receiver also forks an inspector now and then,
at times with every fd number taken (so that the fork's hook cannot give it
its holds), while holding messages, and hands it the message it just read
as the int8 tensors under its arrays (or the received tensors themselves),
after writing a mark into half of them: the inspector checks every byte of
what it was handed (the receiver's bytes, mark included) and, once the
receiver has moved on and its memory may be reused, of what it inherited.
In a quarter of the rounds (`--set late_threads=true`: all) senders send
and receivers read, hold and check in a non-daemon thread that their
process's target leaves running, so that multiprocessing's exit
finalizers, torchshm's among them, run while they work. In a quarter
(`--set one_copy=true`: all) senders send arrays of 4-40 MiB, whose pages
become their snapshot's, and write over them after each send that returns
once the message is written: no receiver may see those writes.
Each round runs in a driver process (`--driver`) that imports
torchshm and so founds a session of its own; this top-level process never
imports torchshm, so that once the drivers are gone nothing of the soak
should remain.

Why each sender has a channel to itself: a process killed while writing
leaves half a message in its pipe (and, for a Queue, its lock taken). That is
multiprocessing's behaviour, not torchshm's; with one writer per channel it
only ever cuts the tail of that channel, which nobody is expected to read.

What is counted, per message (a message is identified by sender and sequence
number; its arrays are a pattern derived from both, so any byte is checked):
- sent: its send returned (for a Pipe or SimpleQueue the bytes are then in the
  pipe; a Queue's feeder thread writes later, so a Queue sender counts its
  messages as sent only after close() and join_thread()), as recorded in
  shared memory by the sender right after; or it was received anyway.
- corrupted: received with other contents, or changed while the receiver
  still held it (receivers keep a few messages and check them again before
  dropping them, so a segment reused under a holder shows here).
- duplicated: received more than once.
- lost while a holder lived (must be 0): sent, its receiver lived, and it
  never arrived or did not load, although its sender or a keeper that had its
  segment lived until the load was tried.
- lost after every holder died: its receiver was killed (nobody else reads
  its channel); or its sender exited (a slow receiver often still has
  messages to read then; torchshm's exit hook hands them to a keeper it
  sees alive, last thing before its fds close: Note [Handing over at exit])
  and a keeper that was still there at that look was killed before the
  receiver tried to load it (gone: its fds closed, as the driver saw after
  the SIGKILL; until then no member can tell); or
  its sender died without that hook (SIGKILL, os._exit) and a keeper was
  killed too, both before the receiver tried, the sender before it was
  seen joined to a new keeper (a creator joins one at once and registers
  every segment it made there; a sender records when it sees it after each
  send, so one that died less than REJOIN_GRACE seconds after the kill
  without that record is taken not to have).
- forwards gone after a keeper kill: a message an inspector was handed
  that it could not open (ENOENT) in a round where a keeper was killed: only
  receivers mapped its segment, and no process has an fd of it for a new
  one (the lifetime page's row). Without a keeper kill that is an error.
- not counted as sent: messages whose sender was killed before it could
  count them (cut mid-write, or a Queue's not flushed), unless received; one
  that arrived whole but did not load counts here too (killed after its last
  byte, before its send returned: the keeper judges the ticket of a write
  that never returned dead, Note [Segment lifetime] in csrc/lifetime/segment.h).
- hangs: a receiver that waited HANG seconds for a sent message, a sender that
  did not finish in time although its receiver lived, or a driver that had to
  be killed.
- leftovers, 5 s after the last driver ended: files under /dev/shm whose names
  begin with "torchshm" and belong to a session of the soak (by name, or by
  the session a lock file names), keeper processes of those sessions, and
  other processes of the drivers' process sessions; /proc/meminfo's Shmem
  against the start (the machine-wide figure: other work moves it too, so it
  is reported, not judged).

Each round prints one line; a round with a problem also prints the messages
concerned, its timeline (faults, and each keeper that came up and who started
it, in seconds after the senders started) and its log (the stderr of all its
processes, torchshm's warnings summarised). A leftover is printed with its
session's timeline; `--keep-leftovers` leaves leftover processes running, to
look at them (they are killed otherwise, once reported).

Exits 1 if anything was corrupted, duplicated, lost while a holder lived, hung
or left over, or a process raised.
"""

import argparse
import errno
import faulthandler
import json
import os
import random
import re
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import numpy as np

SCRIPT = os.path.abspath(__file__)
SHM_DIR = "/dev/shm"
KINDS = ("pipe", "socket", "simplequeue", "queue")
MAX_MESSAGES = 4000  # per sender and round: sizes the shared bookkeeping
# A one-copy round's array sizes (Note [One copy of a sent array]).
ONE_COPY_BYTES = (4 << 20, 40 << 20)
ONE_COPY_DEPTH = 8  # ...and at most this many of a sender's unread
QUEUE_DEPTH = 16  # bounds what a Queue sender pins while its receiver stalls
REJOIN_GRACE = 3.0
STARTUP_SECONDS = 120.0  # spawn children import torch on a busy 2-core machine
LEFTOVER_DELAY = 5.0
SHMEM_TOLERANCE_MIB = 64

# Per-message status, written by the receiver that read it.
UNSEEN, OK, CORRUPT, FAILED, CORRUPT_LATER = 0, 1, 2, 3, 4
# An inspector's exit status: the message handed to it was "gone".
FORWARD_GONE = 3
# Found by a forked inspector: in what it was handed, or what it inherited.
CORRUPT_HANDED, CORRUPT_INHERITED = 5, 6
RECEIVED = (OK, CORRUPT, CORRUPT_LATER, CORRUPT_HANDED, CORRUPT_INHERITED)
WHEN_CORRUPTED = {
    CORRUPT: "on arrival",
    CORRUPT_LATER: "held, later",
    CORRUPT_HANDED: "handed to an inspector",
    CORRUPT_INHERITED: "inherited by an inspector",
}


# ------------------------------------------------------------- messages


def pattern(sender, seq, part, n):
    """n uint32 values that differ, element by element, from those of any
    other (sender, seq, part): data from another message or another array of
    the same message never passes for this one."""
    base = (sender * 1_000_003 + seq * 7_919 + part * 104_729 + 1) & 0xFFFFFFFF
    return np.arange(n, dtype=np.uint32) * np.uint32(2_654_435_761) + np.uint32(base)


def message_spec(rng, max_bytes, min_bytes=1 << 10):
    """Sizes (in uint32 items) of the two arrays and the layout of the second:
    log-uniform from 1 KiB, so that both sides of the inline threshold
    (256 KiB) are exercised."""

    def items():
        low, high = np.log2(min_bytes), np.log2(max_bytes)
        return max(256, int(2 ** rng.uniform(low, high)) // 4)

    return (items(), items() // 2 * 2, rng.random() < 0.3)


def make_arrays(sender, seq, spec):
    n0, n1, fortran = spec
    a = pattern(sender, seq, 0, n0)
    b = pattern(sender, seq, 1, n1).view(np.int16).reshape(-1, 4)
    if fortran:
        b = np.asfortranarray(b)
    # A strided view of `a` in the same message: it shares a's base.
    return a, b, a[1::3]


def as_tensors(arrays):
    """The message's arrays as torch tensors, the strided view a view of the
    first tensor (so that one storage is sent with two of its views)."""
    import torch

    a, b, _ = arrays
    first = torch.from_numpy(a)
    return first, torch.from_numpy(b), first[1::3]


def verify(sender, seq, spec, arrays):
    try:
        expected = make_arrays(sender, seq, spec)
        # Tensors (the tensor switch) are checked through NumPy views.
        arrays = [x.numpy() if hasattr(x, "numpy") else x for x in arrays]
        good = len(arrays) == len(expected) and all(
            got.dtype == want.dtype
            and got.shape == want.shape
            and np.array_equal(got, want)
            for got, want in zip(arrays, expected)
        )
        if not good:
            print(
                f"pid {os.getpid()}: s{sender}#{seq} differs:"
                f" {difference(arrays, expected)}",
                file=sys.stderr,
                flush=True,
            )
        return good
    except Exception:  # a malformed message is a corrupted one
        return False


def difference(arrays, expected):
    """How a message's arrays differ from what was sent (for the log)."""
    parts = []
    for i, (got, want) in enumerate(zip(arrays, expected)):
        if got.shape != want.shape or got.dtype != want.dtype:
            parts.append(f"[{i}] {got.dtype}{got.shape} for {want.dtype}{want.shape}")
            continue
        wrong = np.flatnonzero(got.reshape(-1) != want.reshape(-1))
        if len(wrong):
            first = got.reshape(-1)[wrong[0]]
            parts.append(
                f"[{i}] {len(wrong)} of {want.size} wrong, first at {wrong[0]}:"
                f" {first!r} for {want.reshape(-1)[wrong[0]]!r}"
                f" (base {type(got.base).__name__})"
            )
    return "; ".join(parts) or f"{len(arrays)} arrays for {len(expected)}"


# ------------------------------------------------------------- channels


class Channel:
    """One sender's line to its receiver, of one of the KINDS."""

    def __init__(self, ctx, kind):
        self.kind = kind
        if kind == "pipe":
            self.reader, self.writer = ctx.Pipe(duplex=False)
        elif kind == "socket":
            self.reader, self.writer = ctx.Pipe(duplex=True)
        elif kind == "simplequeue":
            self.reader = self.writer = ctx.SimpleQueue()
        else:
            self.reader = self.writer = ctx.Queue(QUEUE_DEPTH)

    def send(self, obj, give_up):
        """Returns once the message is written (put, for a Queue); False if
        give_up() said to stop while a Queue was full."""
        if self.kind in ("pipe", "socket"):
            self.writer.send(obj)
        elif self.kind == "simplequeue":
            self.writer.put(obj)
        else:
            import queue

            while True:
                try:
                    self.writer.put(obj, timeout=0.5)
                    break
                except queue.Full:
                    if give_up():
                        return False
        return True

    def recv(self):
        if self.kind in ("pipe", "socket"):
            return self.reader.recv()
        return self.reader.get()

    def close_in_parent(self):
        """The driver's copies of a pipe's ends: without them a reader sees EOF
        once its (spawned) writer is gone."""
        if self.kind in ("pipe", "socket"):
            self.reader.close()
            self.writer.close()


class Shared:
    """Bookkeeping in shared memory, lock-free: every cell has one writer, and
    a process killed at any instruction leaves nothing locked."""

    def __init__(self, ctx, senders, receivers):
        cells = senders * MAX_MESSAGES
        self.confirmed = ctx.RawArray("q", senders)  # messages surely sent
        self.handed = ctx.RawArray("q", senders)  # sends (puts) that returned
        self.final = ctx.RawArray("q", [-1] * senders)  # set once a sender ended
        self.begun = ctx.RawArray("d", cells)  # when its send began
        self.status = ctx.RawArray("b", cells)
        self.tried = ctx.RawArray("d", cells)  # when its receiver loaded it
        self.duplicates = ctx.RawArray("q", receivers)
        self.receiver_dead = ctx.RawArray("b", receivers)
        self.go = ctx.RawArray("d", 1)  # when faults may start (the timeline's 0)
        # When a sender's exit finalizers had run (torchshm's hands what it
        # sent to a live keeper); 0: it died without them (SIGKILL, os._exit).
        self.exited = ctx.RawArray("d", senders)
        # When a sender that ends with os._exit (no finalizers) was last
        # alive: the driver sees its end later, by as much as a loaded
        # machine delays it, and a message its receiver tried in between
        # was tried after its sender's death, not before.
        self.vanishing = ctx.RawArray("d", senders)
        # When a sender last saw itself joined to a keeper other than the
        # one it saw before (after a send): that keeper has all it made.
        self.rejoined = ctx.RawArray("d", senders)


def _limit_fds(soft):
    if soft:
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


# ------------------------------------------------------------- children


def sender(cfg, s, channel, shared):
    _limit_fds(cfg["sender_nofile"])
    import torchshm  # noqa: F401  registers the reducers (spawn starts bare)

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a stuck one's stacks

    if cfg["tensors"]:
        import torch

        torch.set_num_threads(1)  # a forked sender: no OpenMP pool
        torchshm.register(tensors=True)
    if cfg["born"]:
        torchshm.set_threshold(0)
        torchshm.set_allocator(True, min_bytes=1)

    in_this_or_a_late_thread(cfg, send_messages, cfg, s, channel, shared)


def in_this_or_a_late_thread(cfg, work, *args):
    """Runs work(*args) here, or, in a late-threads round, in a non-daemon
    thread that the process's target leaves working: multiprocessing then
    runs the exit finalizers, torchshm's among them, before the thread is
    done (Note [Exit after the threads] in torchshm/_lifetime/lifecycle.py).

    The thread starts its work once the exit has begun, as
    tests/thread_exit_children.py's do: up to Python 3.12 a child's exit
    runs a Queue's close finalizer (priority 10) as its target returns, so a
    Queue whose feeder a thread had started before then is closed under it,
    and its later puts are never written (the soak saw a sender hang after
    one message). That is multiprocessing's, with or without torchshm; a
    Queue the thread starts using after that point is flushed and joined
    once the thread ends."""
    if not cfg["late_threads"]:
        work(*args)
        return
    from multiprocessing import util

    exiting = threading.Event()
    util.Finalize(None, exiting.set, exitpriority=-50)  # above torchshm's -100
    threading._register_atexit(exiting.set)  # 3.13: threads are joined first

    def later():
        if exiting.wait(STARTUP_SECONDS):
            work(*args)

    threading.Thread(target=later, daemon=False).start()


def send_messages(cfg, s, channel, shared):
    from multiprocessing import util

    def exited():
        # When torchshm's exit hook last saw its keeper, if it looked.
        from torchshm._lifetime import lifecycle

        shared.exited[s] = lifecycle.handed_over_at or time.monotonic()

    try:
        send_each(cfg, s, channel, shared)
    finally:
        # After torchshm's exit hook (-100). Registered once the messages
        # are sent: in a late-threads round multiprocessing has run the
        # finalizers registered before then, and runs this one with the
        # hook, once the thread is done.
        util.Finalize(None, exited, exitpriority=-1000)


def send_each(cfg, s, channel, shared):
    from torchshm._lifetime import session

    keeper = session.keeper_with_everything()  # the one that has all it made
    rng = random.Random(f"{cfg['seed']}/sender/{s}")
    owner = cfg["owners"][s]
    started = time.monotonic()
    deadline = started + cfg["send_seconds"]
    # Spread over the whole round, so that faults meet senders at work.
    interval = cfg["send_seconds"] / MAX_MESSAGES
    sent = 0
    for seq in range(MAX_MESSAGES):
        now = time.monotonic()
        if now > deadline or shared.receiver_dead[owner]:
            break
        if now < started + seq * interval:
            time.sleep(started + seq * interval - now)
        if cfg["one_copy"]:
            if not backlog_read(shared, s, seq, owner, deadline):
                break
            spec = message_spec(rng, ONE_COPY_BYTES[1], ONE_COPY_BYTES[0])
        else:
            spec = message_spec(rng, cfg["max_bytes"])
        arrays = make_arrays(s, seq, spec)
        message = (s, seq, spec, as_tensors(arrays) if cfg["tensors"] else arrays)
        # Written over once sent, where the send returns after the write.
        scribble = arrays if overwrites(cfg, channel) else ()
        del arrays
        shared.begun[s * MAX_MESSAGES + seq] = time.monotonic()
        try:
            if not channel.send(message, lambda: shared.receiver_dead[owner]):
                break
        except BrokenPipeError:
            break  # its receiver was killed
        sent = shared.handed[s] = seq + 1
        seen = session.keeper_with_everything()
        if seen not in (0, keeper):  # a new one has all it made (tally())
            keeper = seen
            shared.rejoined[s] = time.monotonic()
        if channel.kind != "queue":
            shared.confirmed[s] = sent
        for a in scribble[:2]:  # the third is a view of the first
            np.invert(a, out=a)
        del message, scribble
        if cfg["pause"]:
            time.sleep(rng.uniform(0, cfg["pause"]))
    if channel.kind == "queue":
        if shared.receiver_dead[owner]:
            vanish(shared, s)  # its feeder may block on a pipe nobody reads
        channel.writer.close()
        channel.writer.join_thread()
        shared.confirmed[s] = sent
    if cfg["abrupt_exit"][s] and channel.kind != "queue":
        # "A sender may exit right after sending": no finalizers at all.
        vanish(shared, s)


def backlog_read(shared, s, seq, owner, deadline):
    """Waits until at most ONE_COPY_DEPTH of this sender's messages are
    unread (a one-copy round's are up to 40 MiB each); False if the round
    ends or the receiver died first."""
    if seq < ONE_COPY_DEPTH:
        return True
    cell = s * MAX_MESSAGES + seq - ONE_COPY_DEPTH
    while shared.status[cell] == UNSEEN:
        if time.monotonic() > deadline or shared.receiver_dead[owner]:
            return False
        time.sleep(0.002)
    return True


def overwrites(cfg, channel):
    """Whether a sender writes over its arrays after each send: in a
    one-copy round, where the send returns once the message is written (a
    Queue's feeder thread pickles later) and the arrays are NumPy's (torch's
    tensors are moved into shared memory, so a write is the receiver's too)."""
    return cfg["one_copy"] and channel.kind != "queue" and not cfg["tensors"]


def vanish(shared, s):
    shared.vanishing[s] = time.monotonic()
    os._exit(0)


def mark(arrays):
    """What a forwarding receiver writes into a message it hands on: its first
    element inverted (a tensor's through its NumPy view)."""
    first = arrays[0].numpy() if hasattr(arrays[0], "numpy") else arrays[0]
    first[0] = ~first[0]


def forwarded(message, written):
    """A received message as a receiver hands it to its inspector: tensors as
    they are, arrays as the int8 tensor under each (its .base) with where the
    array lies in it."""
    s, seq, spec, arrays = message
    if hasattr(arrays[0], "numpy"):
        return s, seq, spec, written, arrays
    views = []
    for a in arrays:
        at = a.__array_interface__["data"][0] - a.base.data_ptr()
        views.append((a.base, at, a.dtype.str, a.shape, a.strides))
    return s, seq, spec, written, views


def inspect(conn, held, shared):
    """The forked inspector: checks what it is handed, then (after its
    receiver moved on) what it inherited; marks what is wrong."""
    try:
        s, seq, spec, written, parts = conn.recv()
    except OSError as exc:
        if exc.errno != errno.ENOENT:
            raise
        # What only receivers still map, forwarded after its keeper died,
        # cannot be opened (the lifetime page's row): the driver decides
        # whether a keeper was killed before.
        os._exit(FORWARD_GONE)
    if not hasattr(parts[0], "numpy"):
        parts = [
            np.ndarray(shape, dtype, buffer=base.numpy(), offset=at, strides=strides)
            for base, at, dtype, shape, strides in parts
        ]
    expected = list(make_arrays(s, seq, spec))
    if written:
        expected[0] = expected[0].copy()
        mark(expected)
    got = [x.numpy() if hasattr(x, "numpy") else x for x in parts]
    if not all(np.array_equal(g, e) for g, e in zip(got, expected)):
        shared.status[s * MAX_MESSAGES + seq] = CORRUPT_HANDED
    time.sleep(0.2)
    for s, seq, spec, arrays in held:
        if not verify(s, seq, spec, arrays):
            shared.status[s * MAX_MESSAGES + seq] = CORRUPT_INHERITED


def fork_inspector(cfg, message, held, shared, rng):
    """Forks an inspector holding `held`, at times with no fd number left
    (its holds pinned, not given), and hands it `message`, written into
    first or not (then it is no longer held here: its check would fail).
    Returns (its pid, whether `message` was written), or (None, False) if
    the message cannot be handed on."""
    import multiprocessing as mp

    s, seq, spec, arrays = message
    if not hasattr(arrays[0], "numpy") and not all(
        hasattr(a.base, "data_ptr") for a in arrays
    ):
        return None, False  # pickled by value: no tensor under it
    written = rng.random() < 0.5
    if written:
        held = [m for m in held if m is not message]
        mark(arrays)
    reader, writer = mp.Pipe(duplex=False)
    # Only under a low soft limit: filling a default one could take millions.
    ballast = fill_fds() if cfg["receiver_nofile"] and rng.random() < 0.5 else []
    try:
        pid = os.fork()
    finally:
        for fd in ballast:
            os.close(fd)
    if pid == 0:
        status = 1
        try:
            writer.close()
            inspect(reader, held, shared)
            status = 0
        except BaseException:
            traceback.print_exc()  # into the round's log
        finally:
            os._exit(status)
    reader.close()
    writer.send(forwarded(message, written))
    writer.close()
    return pid, written


def fill_fds():
    """Fds of /dev/null until every fd number below the soft limit is taken."""
    made = []
    while True:
        try:
            made.append(os.open(os.devnull, os.O_RDONLY))
        except OSError:
            return made


def receiver(cfg, r, channels, shared, result_path):
    _limit_fds(cfg["receiver_nofile"])
    import torchshm  # noqa: F401

    faulthandler.register(signal.SIGUSR1, all_threads=True)  # forks inherit it
    in_this_or_a_late_thread(
        cfg, receive_messages, cfg, r, channels, shared, result_path
    )


def receive_messages(cfg, r, channels, shared, result_path):
    rng = random.Random(f"{cfg['seed']}/receiver/{r}")
    window = rng.choice([0, 2, 8, 32])
    lock = threading.Lock()
    held = []
    inspectors = []  # forked inspectors' pids (reaped at the end)
    errors = []  # anything a soak message should never meet
    failures = []  # messages that arrived but did not load
    last_seen = {s: time.monotonic() for s, _ in channels}

    def check_again(item):
        s, seq, spec, arrays = item
        if not verify(s, seq, spec, arrays):
            shared.status[s * MAX_MESSAGES + seq] = CORRUPT_LATER

    def read(s, channel):
        # Blocking reads in a thread of their own: the tail of a channel whose
        # sender was killed mid-write never completes, and is never needed.
        expect = 0
        while True:
            try:
                message = channel.recv()
            except EOFError:
                return
            except OSError as e:
                if e.errno in (errno.EBADF, errno.EPIPE, errno.ECONNRESET):
                    return
                message, failure = None, e
            except Exception as e:  # the bytes arrived; loading them failed
                message, failure = None, e
            now = time.monotonic()
            if message is None:
                # A message is consumed whole before it is loaded, and a
                # channel keeps order: the failed one is the one expected.
                shared.tried[s * MAX_MESSAGES + expect] = now
                shared.status[s * MAX_MESSAGES + expect] = FAILED
                failures.append(
                    f"s{s}#{expect} at {now - shared.go[0]:.2f} s:"
                    f" {type(failure).__name__}: {failure}"
                )
                expect += 1
                last_seen[s] = now
                continue
            try:
                got_s, seq, spec, arrays = message
                index = got_s * MAX_MESSAGES + seq
            except (TypeError, ValueError):
                errors.append(f"s{s}#{expect}: not a soak message: {message!r:.80}")
                expect += 1
                continue
            if got_s != s or seq != expect:
                errors.append(f"s{s}: got s{got_s}#{seq}, expected #{expect}")
            if shared.status[index] != UNSEEN:
                shared.duplicates[r] += 1
            else:
                shared.tried[index] = now
                good = verify(got_s, seq, spec, arrays)
                shared.status[index] = OK if good else CORRUPT
            expect = seq + 1
            last_seen[s] = now
            # One lock for both: another channel's thread must not fork an
            # inspector that inherits this message before it is written into
            # (born memory and tensors are shared: the inspector would see
            # the write).
            with lock:
                if window:
                    held.append(message)
                    if len(held) > window:
                        check_again(held.pop(rng.randrange(len(held))))
                if cfg["inspect_every"] and seq % cfg["inspect_every"] == 0:
                    pid, written = fork_inspector(cfg, message, list(held), shared, rng)
                    if written:  # its check here would fail
                        held[:] = [m for m in held if m is not message]
                    if pid is not None:
                        inspectors.append(pid)
            del message, arrays

    for s, channel in channels:
        threading.Thread(target=read, args=(s, channel), daemon=True).start()

    # Done once every message its senders sent has been seen; a hang if one
    # stays outstanding for HANG seconds without the channel moving.
    hang = []
    waiting_since = {}
    low = {s: 0 for s, _ in channels}  # every message below it was seen
    while True:
        now = time.monotonic()
        done = True
        for s, _ in channels:
            final = shared.final[s]
            target = final if final >= 0 else shared.confirmed[s]
            base = s * MAX_MESSAGES
            while low[s] < target and shared.status[base + low[s]] != UNSEEN:
                low[s] += 1
            if final < 0 or low[s] < target:
                done = False
            if low[s] >= target:
                waiting_since.pop(s, None)
                continue
            since = max(waiting_since.setdefault(s, now), last_seen[s])
            if now - since > cfg["hang_seconds"]:
                outstanding = [
                    q
                    for q in range(low[s], target)
                    if shared.status[base + q] == UNSEEN
                ]
                hang.append({"sender": s, "outstanding": outstanding[:10]})
        if done or hang:
            break
        time.sleep(0.05)
    if hang:  # where this receiver and its inspectors are, into the log
        for pid in inspectors:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        faulthandler.dump_traceback(all_threads=True)
        time.sleep(1)
    with lock:
        for item in held:
            check_again(item)
        held.clear()
    forwards_gone = 0
    for pid in inspectors:
        _, status = os.waitpid(pid, 0)
        if os.WIFEXITED(status) and os.WEXITSTATUS(status) == FORWARD_GONE:
            forwards_gone += 1
        elif status != 0:
            errors.append(f"an inspector ended with status {status:#x}")
    with open(result_path, "w") as f:
        json.dump(
            {
                "hang": hang,
                "errors": errors[:20],
                "failures": failures[:2000],
                "forwards_gone": forwards_gone,
            },
            f,
        )


# ------------------------------------------------------------- the driver


def _keeper_protocol():
    """torchshm/_keeper/protocol.py, loaded from its file: importing it
    through the package would import torchshm into this top-level process."""
    import importlib.util

    path = os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
        "torchshm",
        "_keeper",
        "protocol.py",
    )
    spec = importlib.util.spec_from_file_location("_keeper_protocol", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_protocol = _keeper_protocol()


def keeper_pids(sessions):
    """Keeper processes of these sessions, whoever started them: a keeper
    killed is replaced by whichever member needs one first, so the pid that
    torchshm._lifetime.session.keeper_pid() gave at the start goes stale."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        argv = [a.decode(errors="replace") for a in argv if a]
        session = _protocol.session_of_command(argv)
        if session in sessions:
            found[int(entry)] = session
    return found


def stat_field(pid, index):
    """Field `index` of /proc/<pid>/stat after the command name, as an int
    (1: the parent's pid, 4: the process session), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[index])
    except (OSError, ValueError, IndexError):
        return None


def parent_pid(pid):
    return stat_field(pid, 1)


def _signal(pid, sig):
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False


def _fds_closed_after_kill(pid, limit=5.0):
    """When a process just sent SIGKILL had closed its fds (a zombie, or
    reaped), as this process saw it: from then on its peers read EOF."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            break
        if state in ("Z", "X"):
            break
        time.sleep(0.001)
    return time.monotonic()


def fault_schedule(rng, cfg):
    """(seconds after the senders started, fault) pairs."""
    window = cfg["send_seconds"]
    events = []
    for fault, count in cfg["faults"].items():
        events += [(rng.uniform(0.2, window), fault) for _ in range(count)]
    return sorted(events)


def driver(cfg):
    if cfg["pool_bytes"] is not None:
        os.environ["TORCHSHM_POOL_BYTES"] = cfg["pool_bytes"]
    if cfg["pool_idle"] is not None:
        os.environ["TORCHSHM_POOL_IDLE_SECONDS"] = cfg["pool_idle"]
    import multiprocessing as mp

    import torchshm  # noqa: F401
    from torchshm._lifetime import session as _session

    _session.join()
    session = _session.session_id()
    print("SESSION", session, _session.keeper_pid(), flush=True)

    rng = random.Random(f"{cfg['seed']}/driver")
    ctx = mp.get_context(cfg["method"])
    n_send, n_recv = len(cfg["kinds"]), cfg["receivers"]
    shared = Shared(ctx, n_send, n_recv)
    channels = [Channel(ctx, kind) for kind in cfg["kinds"]]
    workdir = tempfile.mkdtemp(prefix="soak-round-")
    results = [os.path.join(workdir, f"receiver-{r}.json") for r in range(n_recv)]
    receivers = [
        ctx.Process(
            target=receiver,
            args=(
                cfg,
                r,
                [(s, c) for s, c in enumerate(channels) if cfg["owners"][s] == r],
                shared,
                results[r],
            ),
            name=f"soak-receiver-{r}",
            daemon=True,
        )
        for r in range(n_recv)
    ]
    senders = [
        ctx.Process(
            target=sender,
            args=(cfg, s, channels[s], shared),
            name=f"soak-sender-{s}",
            daemon=True,
        )
        for s in range(n_send)
    ]
    for p in receivers + senders:
        p.start()
    for channel in channels:
        channel.close_in_parent()

    killed_senders = {}  # sender -> monotonic time of its SIGKILL
    # sender -> when the driver saw it gone (after its exit: a bound no death
    # can come after), however it ended
    gone_senders = {}
    killed_receivers = {}  # receiver -> monotonic time of its SIGKILL
    keeper_kills = []
    stopped = []  # (resume at, pid)
    hangs = []
    forwards_gone = 0  # handed to an inspector after a keeper kill: gone
    cut_short = set()  # receivers the driver killed for hanging
    faults_done = {}
    timeline = []  # seconds after the senders started: what was done

    def sender_ended(s):
        return shared.final[s] >= 0

    def settle():
        for s, p in enumerate(senders):
            if not sender_ended(s) and p.exitcode is not None:
                shared.final[s] = shared.confirmed[s]
            if s not in gone_senders and p.exitcode is not None:
                gone_senders[s] = time.monotonic()
                if s not in killed_senders:
                    timeline.append(
                        f"{gone_senders[s] - shared.go[0]:.2f} s: sender {s} exited"
                    )

    keepers_seen = set(keeper_pids({session}))
    watched_at = [0.0]

    def watch_keepers(now):
        """Notes each new keeper and which process started it (its parent,
        while that lives), on the timeline."""
        if now - watched_at[0] < 0.25:
            return
        watched_at[0] = now
        roles = {os.getpid(): "the driver"}
        roles.update((p.pid, f"sender {s}") for s, p in enumerate(senders))
        roles.update((p.pid, f"receiver {r}") for r, p in enumerate(receivers))
        for pid in set(keeper_pids({session})) - keepers_seen:
            keepers_seen.add(pid)
            parent = parent_pid(pid)
            timeline.append(
                f"{now - shared.go[0]:.2f} s: keeper {pid} running, started by"
                f" {roles.get(parent, f'pid {parent}')}"
            )

    def resume_due(now):
        for item in [x for x in stopped if x[0] <= now]:
            stopped.remove(item)
            _signal(item[1], signal.SIGCONT)

    def fire(fault):
        """Inflicts `fault` on a target drawn among those it applies to; what
        it did, for the timeline, or None if nothing qualified."""
        live_senders = [
            s for s, p in enumerate(senders) if p.is_alive() and not sender_ended(s)
        ]
        live_receivers = [
            r for r, p in enumerate(receivers) if r not in killed_receivers
        ]
        if fault == "sender_kill":
            targets = [s for s in live_senders if shared.handed[s] > 0]
            if not targets:
                return None
            s = rng.choice(targets)
            killed_senders[s] = time.monotonic()
            _signal(senders[s].pid, signal.SIGKILL)
            return f"SIGKILL sender {s} after {shared.handed[s]} sends"
        if fault == "receiver_kill":
            if len(live_receivers) < 2:
                return None
            r = rng.choice(live_receivers)
            killed_receivers[r] = time.monotonic()
            shared.receiver_dead[r] = 1
            _signal(receivers[r].pid, signal.SIGKILL)
            return f"SIGKILL receiver {r}"
        if fault in ("keeper_kill", "keeper_stop"):
            pids = list(keeper_pids({session}))
            if not pids:
                return None
            pid = rng.choice(pids)
            what = f"keeper {pid}"
            if fault == "keeper_kill":
                killed = time.monotonic()
                _signal(pid, signal.SIGKILL)
                keeper_kills.append((killed, _fds_closed_after_kill(pid)))
                return f"SIGKILL {what}"
        else:  # "stop": a sender or a receiver
            targets = [(f"sender {s}", senders[s].pid) for s in live_senders] + [
                (f"receiver {r}", receivers[r].pid) for r in live_receivers
            ]
            if not targets:
                return None
            what, pid = rng.choice(targets)
        if not _signal(pid, signal.SIGSTOP):
            return None
        seconds = rng.uniform(0.3, 2.0)
        stopped.append((time.monotonic() + seconds, pid))
        return f"SIGSTOP {what} for {seconds:.1f} s"

    try:
        # Faults start once every sender sent something (spawn children take
        # seconds to import torch), so that "killed after sending" holds.
        started = time.monotonic()
        while time.monotonic() - started < STARTUP_SECONDS:
            settle()
            if all(shared.handed[s] > 0 or sender_ended(s) for s in range(n_send)):
                break
            time.sleep(0.05)
        go = shared.go[0] = time.monotonic()
        events = fault_schedule(rng, cfg)
        # Every sender stops sending by go + send_seconds; one still at it
        # HANG seconds later is stuck.
        give_up = go + cfg["send_seconds"] + cfg["hang_seconds"]
        while True:
            now = time.monotonic()
            resume_due(now)
            watch_keepers(now)
            while events and go + events[0][0] <= now:
                at, fault = events.pop(0)
                done = fire(fault)
                if done:
                    faults_done[fault] = faults_done.get(fault, 0) + 1
                    timeline.append(f"{time.monotonic() - go:.2f} s: {done}")
                elif at + 0.5 < cfg["send_seconds"]:
                    # No target yet (a keeper not restarted yet): try again.
                    events.append((at + 0.5, fault))
                    events.sort()
            settle()
            for s, p in enumerate(senders):
                # Blocked on a pipe that no one will read again: not a hang.
                dead = killed_receivers.get(cfg["owners"][s])
                if not sender_ended(s) and dead and now > dead + 2:
                    p.kill()
                    p.join(5)
                    shared.final[s] = shared.confirmed[s]
            if all(sender_ended(s) for s in range(n_send)):
                break
            if now > give_up:
                for s, p in enumerate(senders):
                    if not sender_ended(s):
                        if cfg["owners"][s] not in killed_receivers:
                            hangs.append(f"sender {s} still sending")
                            _signal(p.pid, signal.SIGUSR1)  # its stacks, to the log
                            time.sleep(1)
                        p.kill()
                        p.join(5)
                        shared.final[s] = shared.confirmed[s]
                break
            time.sleep(0.05)
        for _, pid in stopped:
            _signal(pid, signal.SIGCONT)
        stopped.clear()
        # Receivers end by themselves: done, or a hang they report.
        deadline = time.monotonic() + cfg["hang_seconds"] + 60
        for r, p in enumerate(receivers):
            while p.exitcode is None and time.monotonic() < deadline:
                p.join(0.25)
                watch_keepers(time.monotonic())
            if p.is_alive():
                if r not in killed_receivers:
                    hangs.append(f"receiver {r} did not finish")
                    cut_short.add(r)
                p.kill()
                p.join(5)
    finally:
        for _, pid in stopped:
            _signal(pid, signal.SIGCONT)
        for p in senders + receivers:
            if p.is_alive():
                p.kill()
                p.join(5)

    watched_at[0] = 0.0
    watch_keepers(time.monotonic())
    settle()
    counts = tally(
        cfg,
        shared,
        killed_senders,
        {**gone_senders, **killed_senders},
        killed_receivers,
        keeper_kills,
    )
    errors, failures = [], []
    for r, path in enumerate(results):
        if r in killed_receivers:
            continue
        try:
            with open(path) as f:
                report = json.load(f)
        except (OSError, ValueError):
            if not any(h.startswith(f"receiver {r} ") for h in hangs):
                errors.append(f"receiver {r} wrote no report")
            continue
        for h in report["hang"]:
            hangs.append(f"receiver {r} waited for s{h['sender']} {h['outstanding']}")
        errors += [f"receiver {r}: {e}" for e in report["errors"]]
        if report["forwards_gone"]:
            if keeper_kills:  # expected: nobody held an fd of it any more
                forwards_gone += report["forwards_gone"]
            else:
                errors.append(
                    f"receiver {r}: {report['forwards_gone']} forwards gone"
                    " though no keeper was killed"
                )
        failures += [f"receiver {r}: {e}" for e in report["failures"]]
        os.unlink(path)
    # A killed receiver's report (or one it was still writing) may be there.
    shutil.rmtree(workdir, ignore_errors=True)
    # A sender the driver killed (its receiver dead, or stuck) exits -SIGKILL.
    for s, p in enumerate(senders):
        if s not in killed_senders and p.exitcode not in (0, -signal.SIGKILL):
            errors.append(f"sender {s} exited with {p.exitcode}")
    for r, p in enumerate(receivers):
        if r not in killed_receivers and r not in cut_short and p.exitcode != 0:
            errors.append(f"receiver {r} exited with {p.exitcode}")
    counts.update(
        forwards_gone=forwards_gone,
        hangs=len(hangs),
        hang_details=hangs,
        errors=errors,
        load_failures=failures,
        timeline=timeline,
        pids=dict(
            [(os.getpid(), "driver")]
            + [(p.pid, f"sender {s}") for s, p in enumerate(senders)]
            + [(p.pid, f"receiver {r}") for r, p in enumerate(receivers)]
        ),
        faults=faults_done,
        session=session,
    )
    print("RESULT", json.dumps(counts), flush=True)


def tally(cfg, shared, killed_senders, gone_senders, killed_receivers, keeper_kills):
    c = dict(
        sent=0,
        received=0,
        corrupted=0,
        duplicated=sum(shared.duplicates),
        lost_live=0,
        lost_dead=0,
        lost_with_receiver=0,
        unconfirmed=0,
        lost_live_samples=[],
        corrupted_samples=[],
    )

    def every_holder_died(s, seq):
        # Its sender exited (its exit handed what it sent to a keeper), then
        # a keeper that had its segment died; or its sender died without
        # its exit hook (SIGKILL, os._exit), and a keeper died after that (or
        # before, the sender not yet seen joined to the next one).
        if s not in gone_senders:
            return False
        index = s * MAX_MESSAGES + seq
        exited = shared.exited[s]
        tried = shared.tried[index] or float("inf")  # never arrived: not tried
        if exited:  # its exit hook's last look at its keeper
            return any(exited < gone and k < tried for k, gone in keeper_kills)
        death = shared.vanishing[s] or gone_senders[s]
        return death < tried and any(
            k < tried and death <= k + REJOIN_GRACE and shared.rejoined[s] <= k
            for k, _gone in keeper_kills
        )

    for s in range(len(cfg["kinds"])):
        final = shared.final[s]
        receiver_killed = cfg["owners"][s] in killed_receivers
        for seq in range(MAX_MESSAGES):
            status = shared.status[s * MAX_MESSAGES + seq]
            cut = seq >= final and s in killed_senders and status == FAILED
            if cut or (seq >= final and status == UNSEEN):
                if s in killed_senders and shared.begun[s * MAX_MESSAGES + seq]:
                    c["unconfirmed"] += 1  # its sender killed before it counted
                continue
            c["sent"] += 1
            if status in RECEIVED:
                c["received"] += 1
                c["corrupted"] += status != OK
                if status != OK and len(c["corrupted_samples"]) < 10:
                    c["corrupted_samples"].append(
                        f"corrupted: s{s}#{seq} ({cfg['kinds'][s]}, "
                        f"{WHEN_CORRUPTED[status]}"
                        f"{', sender killed' if s in killed_senders else ''})"
                    )
            elif status == UNSEEN and receiver_killed:
                c["lost_dead"] += 1
                c["lost_with_receiver"] += 1
            elif every_holder_died(s, seq):
                c["lost_dead"] += 1
            else:
                c["lost_live"] += 1
                if len(c["lost_live_samples"]) < 10:
                    c["lost_live_samples"].append(
                        f"s{s}#{seq} ({cfg['kinds'][s]}, "
                        f"{'never arrived' if status == UNSEEN else 'failed to load'}"
                        f"{', sender killed' if s in killed_senders else ''})"
                    )
    return c


# ------------------------------------------------------------- the soak


def round_config(rng, index, send_seconds, hang_seconds):
    n_send = rng.randint(1, 4)
    n_recv = rng.randint(1, min(3, n_send))
    owners = [s % n_recv for s in range(n_send)]
    rng.shuffle(owners)
    return {
        "index": index,
        "seed": rng.getrandbits(32),
        "method": rng.choice(("fork", "spawn")),
        "pool_bytes": rng.choice(("0", None)),
        "pool_idle": rng.choice((None, None, "0.5")),
        "sender_nofile": rng.choice((None, 256)),
        "receiver_nofile": rng.choice((None, None, 128)),
        "max_bytes": rng.choice((64 << 10, 1 << 20, 4 << 20)),
        "kinds": [rng.choice(KINDS) for _ in range(n_send)],
        "receivers": n_recv,
        "owners": owners,
        "pause": rng.choice((0.0, 0.002, 0.02)),
        "abrupt_exit": [rng.random() < 0.5 for _ in range(n_send)],
        # torch tensors through torchshm's memory (the tensor switch)
        "tensors": rng.random() < 0.5,
        "send_seconds": send_seconds,
        "hang_seconds": hang_seconds,
        "faults": {
            "sender_kill": rng.randint(0, n_send),
            "stop": rng.randint(0, 3),
            "keeper_kill": rng.randint(0, 2),
            "keeper_stop": rng.randint(0, 2),
            "receiver_kill": int(n_recv > 1 and rng.random() < 0.3),
        },
        # Senders make their arrays with the allocator on (min_bytes 1,
        # threshold 0): small ones are slab blocks, sent by reference.
        "born": rng.random() < 0.5,
        # Receivers fork an inspector every so many messages (0: never).
        "inspect_every": rng.choice((0, 8, 32)),
        # Senders send and receivers read, hold and check in a non-daemon
        # thread that outlives the process's target.
        "late_threads": rng.random() < 0.25,
        # Senders send arrays of 4-40 MiB (their pages become the snapshot's:
        # Note [One copy of a sent array] in csrc/send/one_copy.h) and write
        # over them after each send that returns once written.
        "one_copy": rng.random() < 0.25,
    }


def describe(cfg):
    def size(n):
        return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"

    nofile = f"{cfg['sender_nofile'] or '-'}/{cfg['receiver_nofile'] or '-'}"
    faults = ", ".join(f"{k} {v}" for k, v in cfg["faults"].items() if v)
    pool = "off" if cfg["pool_bytes"] == "0" else "on"
    idle = f" idle {cfg['pool_idle']} s" if cfg["pool_idle"] else ""
    what = "tensors" if cfg["tensors"] else "arrays"
    if cfg["born"]:
        what += " born shared"
    if cfg["inspect_every"]:
        what += f", an inspector forked every {cfg['inspect_every']}"
    if cfg["late_threads"]:
        what += ", in threads that outlive their targets"
    if cfg["one_copy"]:
        what += ", 4-40 MiB one-copy arrays written over after the send"
    return (
        f"{cfg['method']}, {what}, pool {pool}{idle}, nofile {nofile}, "
        f"{len(cfg['kinds'])} senders ({','.join(cfg['kinds'])}) -> "
        f"{cfg['receivers']} receivers {cfg['owners']}, up to {size(cfg['max_bytes'])},"
        f" pause {cfg['pause']} s, faults: {faults or 'none'}"
    )


def run_round(cfg, log_path):
    """Runs one driver in a process session of its own (so that killpg ends
    all of it but the keeper, which torchshm starts in a session of its own).
    Returns (session or None, result or None, driver pid)."""
    env = dict(os.environ)
    for name in ("SESSION", "POOL_BYTES", "POOL_IDLE_SECONDS", "DISABLE"):
        env.pop(f"TORCHSHM_{name}", None)
    timeout = STARTUP_SECONDS * 2 + cfg["send_seconds"] + cfg["hang_seconds"] * 2 + 60
    with open(log_path, "w") as log, tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(
            [sys.executable, SCRIPT, "--driver", json.dumps(cfg)],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=log,
            env=env,
            start_new_session=True,
        )
        timed_out = False
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            timed_out = True
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        out.seek(0)
        session = result = None
        for line in out:
            word, _, rest = line.partition(" ")
            if word == "SESSION":
                session = rest.split()[0]
            elif word == "RESULT":
                result = json.loads(rest)
    if result is None:
        why = "timed out" if timed_out else f"exited with {proc.returncode}"
        result = {"hangs": int(timed_out), "hang_details": [], "errors": []}
        result["errors"].append(f"driver {why} without a result")
    return session, result, proc.pid


def log_summary(path):
    """What the round's processes wrote to stderr, in brief: torchshm's
    warnings (a fallback to pickling by value is no loss, but worth seeing)
    and tracebacks."""
    warnings, tracebacks = {}, 0
    with open(path, errors="replace") as f:
        for line in f:
            if "Warning: torchshm" in line:
                text = line.split("Warning: ", 1)[1].strip()[:160]
                warnings[text] = warnings.get(text, 0) + 1
            tracebacks += line.startswith("Traceback")
    lines = [f"{n} x warning: {text}" for text, n in warnings.items()][:3]
    if tracebacks:
        lines.append(f"{tracebacks} tracebacks in the log")
    return lines


def shm_files():
    """Paths under /dev/shm whose names begin with torchshm, one level into any
    such directory (a per-user directory, should the layout move to one)."""
    found = set()
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return found
    for name in names:
        if not name.startswith("torchshm"):
            continue
        path = os.path.join(SHM_DIR, name)
        if os.path.isdir(path) and not os.path.islink(path):
            for root, _, files in os.walk(path):
                found.update(os.path.join(root, f) for f in files)
        else:
            found.add(path)
    return found


def file_session(path, sessions):
    """The soak session a file belongs to: by its name, or by the session a
    lock file names ("<pid> <session>")."""
    words = set(re.split(r"[-.]", os.path.basename(path)))
    for session in sessions:
        if session in words:
            return session
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        words = os.pread(fd, 256, 0).decode("ascii", "replace").split()
    except OSError:
        return None
    finally:
        os.close(fd)
    return words[-1] if words and words[-1] in sessions else None


def describe_file(path, roles):
    """For a lock file, the process it names ("<pid> <session>") as the soak
    knew it, and how old the file is."""
    try:
        age = time.time() - os.lstat(path).st_mtime
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return ""
    try:
        words = os.pread(fd, 256, 0).decode("ascii", "replace").split()
    except OSError:
        words = []
    finally:
        os.close(fd)
    pid = int(words[0]) if words and words[0].isdigit() else None
    who = f", pid {pid}: {roles.get(pid, 'not a driver, sender or receiver')}"
    return f" (written {age:.1f} s ago{who if pid else ''})"


def process_session(pid):
    return stat_field(pid, 4)


def shmem_kib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("Shmem:"):
                return int(line.split()[1])
    return 0


def override(cfg, setting):
    """--set KEY=VALUE: KEY a round's setting (faults.NAME for a fault),
    VALUE JSON (a round repeated with one thing changed)."""
    key, _, value = setting.partition("=")
    *path, last = key.split(".")
    target = cfg
    for part in path:
        target = target[part]
    if last not in target:
        raise SystemExit(f"soak: --set {key}: no such setting")
    target[last] = json.loads(value)


def soak(args):
    seed = args.seed if args.seed is not None else random.randrange(1 << 31)
    rng = random.Random(seed)
    log_dir = tempfile.mkdtemp(prefix="soak-logs-")
    # All of it in the log directory too: a CI log keeps only its tail.
    sys.stdout = _Tee(sys.stdout, os.path.join(log_dir, "soak.txt"))
    print(f"soak: seed {seed}, {args.minutes} min, logs in {log_dir}", flush=True)
    recap = []  # the problems of each round that failed, repeated at the end
    files_before = shm_files()
    shmem_before = shmem_kib()
    end = time.monotonic() + args.minutes * 60
    sessions, drivers = set(), set()
    roles = {}  # pid -> what it was in which round
    timelines = {}  # session -> (round, its timeline)
    totals = dict.fromkeys(
        (
            "sent",
            "received",
            "corrupted",
            "duplicated",
            "lost_live",
            "lost_dead",
            "lost_with_receiver",
            "unconfirmed",
            "forwards_gone",
            "hangs",
        ),
        0,
    )
    errors = 0
    index = 0
    while time.monotonic() < end - 8 and (args.rounds is None or index < args.rounds):
        left = end - time.monotonic()
        send_seconds = round(min(rng.uniform(6, 15), max(3.0, left - 5)), 1)
        cfg = round_config(rng, index, send_seconds, args.hang_seconds)
        for setting in args.set:
            override(cfg, setting)
        if args.only_round is not None and index != args.only_round:
            index += 1  # drawn, to keep the seed's sequence, but not run
            if index > args.only_round:
                break
            continue
        print(
            f"round {index} (seed {seed}, round seed {cfg['seed']}): {describe(cfg)}",
            flush=True,
        )
        log_path = os.path.join(log_dir, f"round-{index}.log")
        began = time.monotonic()
        session, result, pid = run_round(cfg, log_path)
        drivers.add(pid)
        timelines[session] = (index, result.get("timeline", []))
        for child, role in result.get("pids", {}).items():
            roles[int(child)] = f"{role} of round {index}"
        if session:
            sessions.add(session)
        for key in totals:
            totals[key] += result.get(key, 0)
        errors += len(result["errors"])
        print(
            f"  {time.monotonic() - began:.1f} s, session {session}: "
            f"sent {result.get('sent', '?')}, received {result.get('received', '?')},"
            f" corrupted {result.get('corrupted', '?')}, duplicated"
            f" {result.get('duplicated', '?')}, lost while a holder lived"
            f" {result.get('lost_live', '?')}, lost after every holder died"
            f" {result.get('lost_dead', '?')}, hangs {result['hangs']},"
            f" unconfirmed {result.get('unconfirmed', '?')}, forwards gone after a"
            f" keeper kill {result.get('forwards_gone', 0)}; faults"
            f" {result.get('faults', {})}",
            flush=True,
        )
        # The failures of messages lost while a holder lived come first.
        lost = {x.split(" ")[0] for x in result.get("lost_live_samples", [])}
        failures = sorted(
            result.get("load_failures", []),
            key=lambda f: f.split(": ", 1)[1].split(" ")[0] not in lost,
        )
        problems = (
            result.get("corrupted_samples", [])
            + result.get("lost_live_samples", [])
            + result["hang_details"]
            + result["errors"]
            + failures
        )
        for line in problems[:16] + log_summary(log_path):
            print(f"    {line}", flush=True)
        failed_round = (
            result["hangs"]
            or result["errors"]
            or any(result.get(key) for key in ("corrupted", "duplicated", "lost_live"))
        )
        if failed_round:
            recap.append(f"round {index} (round seed {cfg['seed']}):")
            recap.extend(f"    {line}" for line in problems[:16])
        if problems:
            for line in result.get("timeline", []):
                print(f"    at {line}", flush=True)
        if problems or result.get("corrupted") or result.get("duplicated"):
            print(f"    log: {log_path}", flush=True)
        index += 1

    time.sleep(LEFTOVER_DELAY)
    ours = {p for p in shm_files() if file_session(p, sessions)}
    new = shm_files() - files_before - ours
    keepers = keeper_pids(sessions)
    others = {
        int(p)
        for p in os.listdir("/proc")
        if p.isdigit() and process_session(int(p)) in drivers
    }
    shmem = (shmem_kib() - shmem_before) / 1024
    shmem_note = "machine-wide"
    if abs(shmem) > SHMEM_TOLERANCE_MIB:
        shmem_note += f"; beyond {SHMEM_TOLERANCE_MIB} MiB"

    failed = (
        totals["corrupted"]
        + totals["duplicated"]
        + totals["lost_live"]
        + totals["hangs"]
        + len(ours)
        + len(keepers)
        + len(others)
        + errors
    )
    print(
        f"\n{len(sessions)} rounds, seed {seed}\n"
        f"sent {totals['sent']} / received {totals['received']} / corrupted"
        f" {totals['corrupted']} / duplicated {totals['duplicated']} / lost while a"
        f" holder lived {totals['lost_live']} / lost after every holder died"
        f" {totals['lost_dead']} (with their receiver {totals['lost_with_receiver']})"
        f" / hangs {totals['hangs']} / leftovers: files {len(ours)}, keepers"
        f" {len(keepers)}, processes {len(others)}, shmem {shmem:+.1f} MiB"
        f" ({shmem_note})\n"
        f"not counted as sent: {totals['unconfirmed']} cut by a sender's SIGKILL,"
        f" {totals['forwards_gone']} forwards to an inspector after a keeper kill"
        " (a new process cannot open what only receivers map);"
        f" errors {errors}; other new torchshm files {len(new)}",
        flush=True,
    )
    if recap:
        print(f"the problems again (whole report: {log_dir}/soak.txt):", flush=True)
        for line in recap:
            print(f"  {line}", flush=True)
    for path in sorted(ours)[:10]:
        print(f"  leftover file {path}{describe_file(path, roles)}", flush=True)
    for pid, session in sorted(keepers.items()):
        print(f"  leftover keeper {pid} of session {session}", flush=True)
    for pid in sorted(others):
        print(f"  leftover process {pid}", flush=True)
    for session in sorted(
        {file_session(p, sessions) for p in ours} | set(keepers.values())
    ):
        round_index, timeline = timelines.get(session, (None, []))
        print(f"  session {session} (round {round_index}):", flush=True)
        for line in timeline:
            print(f"    at {line}", flush=True)
    # Reported; now leave the machine as it was (unless asked to keep them
    # for a look).
    for pid in [] if args.keep_leftovers else list(keepers) + list(others):
        _signal(pid, signal.SIGCONT)
        _signal(pid, signal.SIGKILL)
    print("FAILED" if failed else "OK", flush=True)
    return 1 if failed else 0


class _Tee:
    """Writes to a stream and to a file."""

    def __init__(self, stream, path):
        self._stream = stream
        self._file = open(path, "w")

    def write(self, text):
        self._file.write(text)
        return self._stream.write(text)

    def flush(self):
        self._file.flush()
        self._stream.flush()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None, help="stop after these")
    parser.add_argument(
        "--only-round",
        type=int,
        default=None,
        help="run only this round of the seed's sequence (to repeat one)",
    )
    parser.add_argument(
        "--hang-seconds",
        type=float,
        default=60.0,
        help="a receiver waiting this long for a sent message is a hang",
    )
    parser.add_argument(
        "--keep-leftovers",
        action="store_true",
        help="leave leftover keepers and processes running, to look at them",
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="change a setting of every round run, e.g. faults.keeper_kill=0"
        " or receiver_nofile=null (VALUE is JSON)",
    )
    parser.add_argument("--driver", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.driver:
        driver(json.loads(args.driver))
        return 0
    return soak(args)


if __name__ == "__main__":
    sys.exit(main())
