"""Child targets and driver scenarios for the fault, limit and bad-input tests.

Targets live at module top level so that spawn and forkserver can import them.
`python -m tests.fault_children SCENARIO ARGS...` runs a driver: it founds a
torchshm session of its own (see tests/isolated.py), prints `session <id>`,
then one JSON object per line.
"""

import gc
import json
import os
import queue
import resource
import signal
import sys
import threading
import time
import warnings
import multiprocessing as mp
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch

import torchshm
from torchshm import _C
from torchshm._lifetime import session as _session
from tests import isolated

TIMEOUT = 60


class Tagged(np.ndarray):
    """An ndarray subclass torchshm knows nothing about."""


# ---------------------------------------------------------------- senders that exit


def put_and_return(q, n):
    """The seed experiment's worker: put one array and return at once."""
    q.put(np.arange(n))


def put_tensor_view_and_return(q, n):
    """Puts an array over a share_memory_()d tensor and returns at once."""
    # A forked child of a process that ran torch's OpenMP threads hangs in
    # its first parallel op (libgomp's team is the parent's): one thread.
    torch.set_num_threads(1)
    q.put(torch.arange(n).share_memory_().numpy()[1:])


def pool_array(seed):
    return np.arange(seed, seed + 200_000)


def take_one_and_die(q):
    """A consumer that crashes while holding an array, with more left unread."""
    held = q.get(timeout=TIMEOUT)
    assert torchshm.is_shared(held)
    os.kill(os.getpid(), signal.SIGKILL)


# ---------------------------------------------------------------- fd limit


def fd_limited_consumer(inbox, outbox, limit, keep_every):
    """Receives (i, arrays) until None under `ulimit -n limit`, keeping the
    arrays of every keep_every-th message alive to the end."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (limit, limit))
    received, bad, kept = 0, 0, []
    for i, arrays in iter(inbox.get, None):
        received += 1
        bad += not all(_fd_array_ok(i, k, a) for k, a in enumerate(arrays))
        if i % keep_every == 0:
            kept.extend((i, k, a) for k, a in enumerate(arrays))
    outbox.put(
        {
            "received": received,
            "bad": bad,
            "kept": len(kept),
            "kept_ok": all(_fd_array_ok(i, k, a) for i, k, a in kept),
            "kept_shared": all(torchshm.is_shared(a) for _, _, a in kept),
            "open_fds": len(os.listdir("/proc/self/fd")),
        }
    )


def fd_array(i, k):
    """128-144 KiB: above the default threshold too."""
    n = 16384 + (i * 5 + k) % 2048
    return np.arange(n, dtype=np.int64) + (i * 5 + k) * 1000


def _fd_array_ok(i, k, a):
    return np.array_equal(a, fd_array(i, k))


# ---------------------------------------------------------------- threads


def thread_bases():
    """The arrays the sending threads slice; the receiver rebuilds them."""
    return [
        np.arange(60_000, dtype=np.float64).reshape(300, 200),
        np.arange(90_000, dtype=">i4"),
        np.arange(40_000, dtype=np.int16).reshape(200, 200).T,
    ]


def thread_views(bases, shared, thread, j):
    """Overlapping views of the bases for message j of a thread. The first view
    of each base covers over half of it, so the message holds one copy of it."""
    a, b, c = bases
    s = (thread * 7 + j) % 50
    return [
        a[s:],
        a[s + 10 : s + 60, ::-1],
        b[s * 100 :],
        b[s * 100 + 1 :: 2],
        c,
        c[::2, s:],
        shared[s : s + 500],
        shared[::-7],
    ]


def prefetch_receiver(inbox, outbox, shared, prefetchers):
    """Unpickles in `prefetchers` threads, as a DataLoader prefetch thread does,
    and checks every message (values, and aliasing of overlapping views)."""
    bases = thread_bases()
    pending = queue.Queue()

    def prefetch():
        for item in iter(inbox.get, None):
            pending.put(item)
        pending.put(None)

    threads = [threading.Thread(target=prefetch) for _ in range(prefetchers)]
    for t in threads:
        t.start()
    received, bad, unshared, done = 0, 0, 0, 0
    while done < prefetchers:
        item = pending.get(timeout=TIMEOUT)
        if item is None:
            done += 1
            continue
        (thread, j), views = item
        expected = thread_views(bases, shared, thread, j)
        received += 1
        unshared += sum(not torchshm.is_shared(v) for v in views)
        ok = all(np.array_equal(v, e) for v, e in zip(views, expected))
        # Writes go to this message's snapshot: the overlapping view sees them.
        views[0][10, -1] = -1
        views[2][-1] = -2
        ok = ok and views[1][0, 0] == -1 and views[3][-1] == -2
        bad += not ok
    for t in threads:
        t.join(TIMEOUT)
    outbox.put({"received": received, "bad": bad, "unshared": unshared})


# ---------------------------------------------------------------- kill rounds

# Fields of a round's shared counters.
SENDER_PID, RECEIVER_PID, SENT, RECEIVED, BAD, SENDER_DONE, RECEIVER_DONE = range(7)
# torchshm's process ids (segment names carry them, not pids).
ERRORS, SENDER_ID, RECEIVER_ID, PARENT_ID, FIELDS = 7, 8, 9, 10, 11
SHARED_N = 100_000


def kill_message(i, rng):
    n = int(rng.integers(1, 64)) * 1024
    base = np.arange(i, i + n, dtype=np.int64)
    return base, base[::-2]


def kill_sender(reader, writer, stats, shared, messages, seed):
    reader.close()
    stats[SENDER_ID] = _C.process_id()
    rng = np.random.default_rng(seed)
    try:
        for i in range(messages):
            base, view = kill_message(i, rng)
            s = i * 1000
            writer.send((i, base, view, shared[s : s + 5000]))
            stats[SENT] = i + 1
            time.sleep(rng.uniform(0, 0.004))
    except BrokenPipeError:  # the receiver was killed
        return
    stats[SENDER_DONE] = 1


def kill_receiver(reader, writer, stats, seed):
    writer.close()
    stats[RECEIVER_ID] = _C.process_id()
    rng = np.random.default_rng(seed)
    kept = []
    try:
        while True:
            try:
                i, base, view, shared = reader.recv()
            except EOFError:  # the sender is gone and the pipe is drained
                break
            expected = np.arange(i, i + len(base))
            s = i * 1000
            ok = np.array_equal(base, expected) and np.array_equal(view, expected[::-2])
            ok = ok and np.array_equal(shared, np.arange(s, s + 5000) * 2)
            base[-1] = -1  # the view is over the same memory
            ok = ok and view[0] == -1 and torchshm.is_shared(base)
            stats[BAD] += not ok
            stats[RECEIVED] += 1
            if rng.random() < 0.5:
                kept = kept[-8:] + [base, view, shared]
            time.sleep(rng.uniform(0, 0.004))
    except Exception:
        stats[ERRORS] += 1
        raise
    stats[RECEIVER_DONE] = 1


def kill_round_parent(stats, messages, seed):
    """One round: a sender and a receiver joined by a pipe, both forked from
    here after this process shared an array that the sender re-sends."""
    ctx = mp.get_context("fork")
    shared = torchshm.share(np.arange(SHARED_N) * 2)
    stats[PARENT_ID] = _C.process_id()
    reader, writer = ctx.Pipe(duplex=False)
    args = (reader, writer, stats)
    sender = ctx.Process(target=kill_sender, args=args + (shared, messages, seed))
    receiver = ctx.Process(target=kill_receiver, args=args + (seed + 1,))
    sender.start()
    receiver.start()
    # Only the two ends in use stay open: a killed end is then seen as EOF or
    # EPIPE by the survivor instead of a wait for ever.
    reader.close()
    writer.close()
    stats[SENDER_PID], stats[RECEIVER_PID] = sender.pid, receiver.pid
    # The driver kills whatever outlives ROUND_TIMEOUT; never wait longer.
    sender.join(ROUND_TIMEOUT)
    receiver.join(ROUND_TIMEOUT)


VICTIMS = ("sender", "receiver", "parent", None)
VICTIM_WEIGHTS = (0.3, 0.3, 0.25, 0.15)
ROUND_TIMEOUT = 30
# A dead process's slots are freed within a second or two (the reaper scans
# every second; a ticket's pipe must stay closed for a whole scan).
LIVE_GRACE = 6


def _kill_if_alive(pid):
    if not pid or isolated._stat(pid) is None:
        return False
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


def _wait_gone(pids, timeout):
    deadline = time.monotonic() + timeout
    while any(isolated._stat(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.01)
    return [p for p in pids if isolated._stat(p)]


def kill_rounds(rounds, seed, messages=16):
    """Rounds of sender -> receiver traffic with a SIGKILL of the sender, the
    receiver or their parent at a random moment; one JSON line per round and
    the totals."""
    rounds, seed, messages = int(rounds), int(seed), int(messages)
    rng = np.random.default_rng(seed)
    ctx = mp.get_context("fork")
    totals = dict.fromkeys(
        (
            "rounds kills messages sent lost dropped bad errors hung"
            " early_leftovers live_leftovers"
        ).split(),
        0,
    )
    for r in range(rounds):
        stats = ctx.RawArray("q", FIELDS)
        parent = ctx.Process(
            target=kill_round_parent, args=(stats, messages, seed * 100_000 + r)
        )
        parent.start()
        deadline = time.monotonic() + ROUND_TIMEOUT
        while not stats[RECEIVER_PID] and parent.exitcode is None:
            if time.monotonic() > deadline:
                break
            time.sleep(0.001)
        pids = {
            "parent": parent.pid,
            "sender": stats[SENDER_PID],
            "receiver": stats[RECEIVER_PID],
        }
        victim = VICTIMS[rng.choice(len(VICTIMS), p=VICTIM_WEIGHTS)]
        time.sleep(rng.uniform(0, 0.08))
        killed = victim is not None and _kill_if_alive(pids[victim])
        parent.join(ROUND_TIMEOUT)
        hung = _wait_gone([p for p in pids.values() if p], ROUND_TIMEOUT)
        for pid in hung:
            _kill_if_alive(pid)
        parent.join(ROUND_TIMEOUT)

        row = {"round": r, "victim": victim if killed else None, "hung": len(hung)}
        row.update(sent=stats[SENT], received=stats[RECEIVED], bad=stats[BAD])
        row["errors"] = stats[ERRORS]
        receiver_killed = killed and victim == "receiver"
        sender_killed = killed and victim == "sender"
        lost = 0
        if not receiver_killed:
            # Everything the sender wrote reaches a living receiver.
            if not stats[RECEIVER_DONE]:
                row["errors"] += 1
            expected = messages if stats[SENDER_DONE] else stats[SENT]
            lost = max(0, expected - stats[RECEIVED])
        row["lost"] = lost
        row["dropped"] = max(0, stats[SENT] - stats[RECEIVED]) - lost
        # Without a killed sender or receiver, references all came back: their
        # segments are gone now, long before the reaper's sweep.
        early = []
        if not (receiver_killed or sender_killed):
            owners = [stats[SENDER_ID], stats[RECEIVER_ID]]
            if not killed:
                owners.append(stats[PARENT_ID])
            # Released by their last holder, not swept after a death: the
            # keeper closes them as soon as it looks (asked to look now).
            _session.close_released()
            report = isolated.session_report(_session.session_id())
            early = [
                n for n, seg in report.items() if int(seg["creator"], 16) in owners
            ]
        row["early_leftovers"] = len(early)
        print(json.dumps(row), flush=True)

        totals["rounds"] += 1
        totals["kills"] += killed
        totals["messages"] += stats[RECEIVED]
        for key in ("sent", "lost", "dropped", "bad", "errors", "hung"):
            totals[key] += row[key]
        totals["early_leftovers"] += len(early)
        parent.close()
    # This process, the session's root, is still alive: whatever the rounds'
    # processes held, killed or not, must be freed within seconds anyway.
    deadline = time.monotonic() + LIVE_GRACE
    while time.monotonic() < deadline:
        left = isolated.session_segments(_session.session_id())
        if not left:
            break
        time.sleep(0.1)
    totals["live_leftovers"] = len(left)
    # What is left for the keeper to close once this process exits.
    totals["pending_sweep"] = len(left)
    yield totals


# ---------------------------------------------------------------- unread messages


def unread():
    """Messages whose receiver never unpickles them: a queue discarded after
    its sender exited (fork and spawn), and a consumer killed while holding one
    array with more unread. Reports the segments they keep until the session
    ends."""
    exitcodes = []
    for method in ("fork", "spawn"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        p = ctx.Process(target=put_and_return, args=(q, 300_000))
        p.start()
        p.join(TIMEOUT)
        exitcodes.append(p.exitcode)
        q.close()  # discarded unread
        q.join_thread()
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    for k in range(3):
        q.put(np.arange(k, k + 300_000))
    p = ctx.Process(target=take_one_and_die, args=(q,))
    p.start()
    p.join(TIMEOUT)
    exitcodes.append(p.exitcode)
    q.close()
    q.join_thread()
    gc.collect()
    segments = isolated.session_segments(_session.session_id())
    yield {"exitcodes": exitcodes, "segments": len(segments)}


# ---------------------------------------------------------------- a memory limit

LIMIT_ITEMS = 20  # of 8 MiB, kept by the consumer: more than the room (128 MiB)


def space_array(i, nbytes):
    return np.arange(i, i + nbytes // 8, dtype=np.int64)


def limit_producer(items, control, report):
    # Warm, then wait for the driver to set the limit (tests/test_limits.py).
    report.put({})
    control.get(timeout=TIMEOUT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for i in range(LIMIT_ITEMS):
            items.put((i, space_array(i, 8 << 20)))
        # Once the consumer has dropped everything, there is room again.
        control.get(timeout=TIMEOUT)
        items.put((LIMIT_ITEMS, space_array(99, 8 << 20)))
        items.put(None)
    report.put(
        {
            "warnings": [
                str(w.message)
                for w in caught
                if issubclass(w.category, RuntimeWarning) and "torchshm" in str(w)
            ],
            "fallbacks": torchshm.stats()["fallbacks"],
        }
    )


def limit_consumer(items, control, report):
    """Keeps every array that arrived shared (a pickled one would only fill
    the room the test needs: it is checked and dropped)."""
    report.put({})
    kept, shared, equal, order = [], [], [], []
    for _ in range(LIMIT_ITEMS):
        i, a = items.get()
        order.append(i)
        equal.append(bool(np.array_equal(a, space_array(i, 8 << 20))))
        shared.append(torchshm.is_shared(a))
        if shared[-1]:
            kept.append(a)
        del a
    del kept
    gc.collect()
    control.put("dropped")
    i, last = items.get()
    equal.append(np.array_equal(last, space_array(99, 8 << 20)))
    shared.append(torchshm.is_shared(last))
    order.append(i)
    del last
    assert items.get() is None
    report.put({"order": order, "equal": equal, "shared": shared})


def collate_and_born():
    """collate and the NumPy allocator, where no shared memory is left: each
    falls back once, with a warning, and the data is right."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # Small (the room left is under 1 MiB above the margin): what falls
        # back costs little private memory.
        samples = [np.full(1 << 17, float(k)) for k in range(4)]  # 1 MiB each
        batch = torchshm.collate(samples)
        with torchshm.allocating(min_bytes=1 << 20):
            born = np.ones(1 << 18)
    return {
        "collate_shared": torchshm.is_shared(batch),
        "collate_equal": bool(np.array_equal(batch, np.stack(samples))),
        "born_shared": torchshm.is_shared(born),
        "born_sum": float(born.sum()),
        "collate_warnings": [
            str(w.message)
            for w in caught
            if issubclass(w.category, RuntimeWarning) and "torchshm" in str(w)
        ],
    }


def _limit_own_cgroup(room):
    """Sets this process's memory cgroup (made for it by the test) to its
    usage now plus `room` bytes; returns the limit."""
    from torchshm import _memory

    version, directory = _memory._cgroup_dirs()[0]
    assert version == 1, "tests/isolated.py makes v1 memory cgroups"
    with open(os.path.join(directory, "memory.usage_in_bytes")) as f:
        limit = int(f.read()) + room
    with open(os.path.join(directory, "memory.limit_in_bytes"), "w") as f:
        f.write(str(limit))
    return limit


def memory_limit(room):
    """A producer sends 8 MiB arrays to a consumer that keeps every one, in a
    memory cgroup with `room` bytes above this process's usage (run inside a
    fresh one, and inside a 64 MiB /dev/shm: tests/test_limits.py). What fits
    is shared, the rest is pickled, nothing is lost, nobody is killed; then,
    with the limit reached again, collate and the allocator fall back."""
    torchshm.trim()
    gc.collect()
    results = {}
    ctx = mp.get_context("fork")
    # A SimpleQueue pickles in put(): the producer holds one array at a time
    # (a Queue's buffer would hold all of them until its feeder sends them).
    items, control, report = ctx.SimpleQueue(), ctx.Queue(), ctx.Queue()
    producer = ctx.Process(target=limit_producer, args=(items, control, report))
    consumer = ctx.Process(target=limit_consumer, args=(items, control, report))
    producer.start()
    consumer.start()
    for _ in range(2):
        report.get(timeout=TIMEOUT)  # both started: what they cost is counted
    results["limit"] = _limit_own_cgroup(int(room))
    control.put("go")
    for _ in range(2):
        results.update(report.get(timeout=TIMEOUT))
    for p in (producer, consumer):
        p.join(TIMEOUT)
    results["exitcodes"] = [producer.exitcode, consumer.exitcode]
    # Once what the children held is closed (the keeper does it within a
    # second), fill the room here until a send falls back, then ask collate
    # and the allocator for more.
    torchshm.trim()
    deadline = time.monotonic() + TIMEOUT
    while isolated.session_report(_session.session_id()):
        assert time.monotonic() < deadline, "the children's segments stayed"
        time.sleep(0.05)
    ballast = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        while len(ballast) < 1024:
            ballast.append(torchshm.share(np.ones(1 << 17)))  # 1 MiB
            if not torchshm.is_shared(ballast[-1]):
                break
    results["ballast_fell_back"] = not torchshm.is_shared(ballast[-1])
    results.update(collate_and_born())
    del ballast
    st = os.statvfs(isolated.SHM_DIR)
    results["shm_used"] = (st.f_blocks - st.f_bfree) * st.f_frsize
    yield results


# ---------------------------------------------------------------- idle senders

IDLE_SENDER_BYTES = 12 << 20
TORCH_SHARE_BYTES = 40 << 20


def idle_sender(outbox, inbox):
    outbox.put(np.ones(IDLE_SENDER_BYTES // 8))
    inbox.get(timeout=TIMEOUT)  # idle until told to exit


def torch_share(report):
    import torch

    # torch sizes its file with ftruncate: no space means SIGBUS on write.
    t = torch.ones(TORCH_SHARE_BYTES // 4).share_memory_()
    report.put(float(t.sum()))


def idle_senders():
    """Three senders of one session go idle with their pools full; torch's own
    share_memory_() must still find room: torchshm's pools take none of
    /dev/shm. Run inside a private 64 MiB tmpfs (tests/test_limits.py)."""
    ctx = mp.get_context("fork")
    outbox, report = ctx.Queue(), ctx.Queue()
    inboxes = [ctx.Queue() for _ in range(3)]
    senders = [ctx.Process(target=idle_sender, args=(outbox, q)) for q in inboxes]
    for p in senders:
        p.start()
    for _ in senders:
        received = outbox.get(timeout=TIMEOUT)
        del received
    gc.collect()
    time.sleep(0.5)
    st = os.statvfs(isolated.SHM_DIR)
    results = {"idle_used": (st.f_blocks - st.f_bfree) * st.f_frsize}
    child = ctx.Process(target=torch_share, args=(report,))
    child.start()
    child.join(TIMEOUT)
    results["torch_exitcode"] = child.exitcode
    results["torch_sum"] = report.get(timeout=1) if child.exitcode == 0 else None
    for q in inboxes:
        q.put("exit")
    for p in senders:
        p.join(TIMEOUT)
    results["exitcodes"] = [p.exitcode for p in senders]
    yield results


# ------------------------------------------------- born arrays, small /dev/shm

BORN_ITEMS = 12  # of 8 MiB: 96 MiB, more than the 64 MiB /dev/shm holds


def born_receiver(inbox, report):
    got = [inbox.recv() for _ in range(BORN_ITEMS)]
    report.send([bool(np.array_equal(a, space_array(i, 8 << 20))) for i, a in got])


def born_full():
    """Arrays made under allocating(), more of them than a 64 MiB /dev/shm
    holds: every one is born shared (segments are memfds) and arrives intact.
    Run inside a private 64 MiB tmpfs (tests/test_allocator.py)."""
    ctx = mp.get_context("fork")
    before = torchshm.stats()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torchshm.allocating(min_bytes=1 << 20):
            arrays = [space_array(i, 8 << 20) for i in range(BORN_ITEMS)]
    after = torchshm.stats()
    shared = [torchshm.is_shared(a) for a in arrays]
    (inbox, outbox), (report_in, report_out) = ctx.Pipe(False), ctx.Pipe(False)
    receiver = ctx.Process(target=born_receiver, args=(inbox, report_out))
    receiver.start()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the private ones cannot be copied in
        for i, a in enumerate(arrays):
            outbox.send((i, a))
    equal = report_in.recv() if report_in.poll(TIMEOUT) else None
    receiver.join(TIMEOUT)
    yield {
        "shared": shared,
        "equal": equal,
        "exitcode": receiver.exitcode,
        "allocations": {
            key: after[key] - before[key]
            for key in ("allocations_shared", "allocations_fallback")
        },
        "warnings": [
            str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)
        ],
    }


# ------------------------------------------- born arrays at this process's cap

CAP_NOFILE = 400  # a quarter, 100, for the segment fds this process keeps


def born_at_the_cap():
    """Born arrays of 100 KB until a real cap (the fds a creator may keep:
    a quarter of a hard limit of 400) makes one fall back; all freed, they
    sit idle in the pool. A 3 MiB array (a size class none of them fits)
    must then be born shared at once, the pool giving way, and be sent by
    reference (tests/test_allocator.py)."""
    resource.setrlimit(resource.RLIMIT_NOFILE, (CAP_NOFILE, CAP_NOFILE))
    before = torchshm.stats()
    held = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torchshm.allocating(min_bytes=64 << 10):
            while (
                torchshm.stats()["allocations_fallback"]
                == before["allocations_fallback"]
                and len(held) < 4 * CAP_NOFILE
            ):
                held.append(np.full(100_000 // 8, len(held), dtype=np.float64))
    at_cap = sum(torchshm.is_shared(a) for a in held)
    del held
    gc.collect()
    middle = torchshm.stats()
    with warnings.catch_warnings(record=True) as later:
        warnings.simplefilter("always")
        with torchshm.allocating(min_bytes=64 << 10):
            big = np.full((3 << 20) // 8, 7.0)
        sent = ForkingPickler.loads(ForkingPickler.dumps(big))
    after = torchshm.stats()
    yield {
        "shared_at_cap": at_cap,
        "fell_back": middle["allocations_fallback"] - before["allocations_fallback"],
        "warned_at_cap": [str(w.message) for w in caught],
        "big_shared": torchshm.is_shared(big),
        "big_by_reference": after["arrays_resent"] - middle["arrays_resent"],
        "big_copied": after["arrays_shared"] - middle["arrays_shared"],
        "big_equal": bool((sent == 7.0).all()) and sent.shape == big.shape,
        "gave_way": after["pool_gave_way"] - middle["pool_gave_way"],
        "later_warnings": [str(w.message) for w in later],
    }


# ---------------------------------------------------------------- a killed keeper

RESTART_MESSAGES = 120


def steady_sender(q, go_on):
    """Sends RESTART_MESSAGES fresh arrays, one every 25 ms, then waits."""
    for i in range(RESTART_MESSAGES):
        q.put((i, np.full(50_000, float(i))))
        time.sleep(0.025)
    q.close()
    q.join_thread()
    go_on.wait(TIMEOUT)


def late_joiner(report):
    """A process of the session that starts after its keeper died: it starts
    a new one, sends one array and exits."""
    report.put((os.getpid(), np.full(50_000, -1.0)))


def keeper_restart():
    """The session's keeper is SIGKILLed while a sender writes; a later
    process starts a new keeper and exits; the sender goes on. The receiver
    (this process, reading late) must get every message, and the session
    must keep a keeper while its processes live."""
    ctx = mp.get_context("fork")
    q, go_on = ctx.Queue(), ctx.Event()
    sender = ctx.Process(target=steady_sender, args=(q, go_on))
    sender.start()
    time.sleep(0.5)  # some messages sent, more to come
    first = _session.keeper_pid()
    os.kill(first, signal.SIGKILL)
    spawn = mp.get_context("spawn")
    report = spawn.Queue()
    late = spawn.Process(target=late_joiner, args=(report,))
    late.start()
    late_pid, late_array = report.get(timeout=TIMEOUT)
    late.join(TIMEOUT)
    # Long enough for a keeper that wrongly ended the session to close what
    # the live sender wrote meanwhile.
    from torchshm._keeper import daemon

    time.sleep(3 * daemon.GRACE_SECONDS)
    got, bad, errors = [], 0, []
    for _ in range(RESTART_MESSAGES):
        try:
            i, a = q.get(timeout=TIMEOUT)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            errors.append(f"{type(exc).__name__}: {exc}")
            continue
        got.append(i)
        bad += not (torchshm.is_shared(a) and (a == float(i)).all())
    go_on.set()
    sender.join(TIMEOUT)
    keepers = [
        p for p in isolated.session_processes(-1, _session.session_id()) if p != first
    ]
    yield {
        "received": got,
        "bad": bad,
        "errors": errors,
        "late_ok": bool((late_array == -1.0).all()),
        "late_exitcode": late.exitcode,
        "sender_exitcode": sender.exitcode,
        "keepers_after": len(keepers),
    }


def load_twice(conn):
    """A spawn child that has not joined its session: loads the messages
    sent as bytes, reporting each load and whether it is a member by then."""
    import pickle

    from torchshm._lifetime import session

    for _ in range(2):
        data = conn.recv_bytes()
        start = time.monotonic()
        try:
            a = pickle.loads(data)
            ok, error = bool((a == np.arange(1 << 18)).all()), None
            shared = torchshm.is_shared(a)
        except Exception as exc:  # noqa: BLE001 - reported, not raised
            ok, shared, error = False, False, f"{type(exc).__name__}: {exc}"
        conn.send(
            {
                "ok": ok,
                "shared": shared,
                "error": error,
                "seconds": time.monotonic() - start,
                "member": session.joined() is not None,
            }
        )


def load_without_keeper(how):
    """A process that is not a member of its session yet loads a message
    while the keeper cannot take it in (`how`: "stopped" by SIGSTOP, or at
    its "fd_limit"), then another once the keeper is back: the first comes
    from the creator (this process) without the keeper, the second after
    joining."""
    os.environ["TORCHSHM_KEEPER_TIMEOUT"] = "2"  # the children's deadline
    keeper = _session.keeper_pid()
    messages = [bytes(ForkingPickler.dumps(np.arange(1 << 18))) for _ in range(2)]
    ctx = mp.get_context("spawn")
    here, there = ctx.Pipe()
    child = ctx.Process(target=load_twice, args=(there,))
    limit = resource.prlimit(keeper, resource.RLIMIT_NOFILE)
    if how == "stopped":
        os.kill(keeper, signal.SIGSTOP)
    else:
        # Its lowest free fd number becomes its soft limit (it raises that
        # to the hard one only as it starts): no new fd, though it keeps fds
        # far above it.
        in_use = {int(fd) for fd in os.listdir(f"/proc/{keeper}/fd")}
        free = min(set(range(len(in_use) + 1)) - in_use)
        resource.prlimit(keeper, resource.RLIMIT_NOFILE, (free, limit[1]))
    try:
        child.start()
        here.send_bytes(messages[0])
        first = here.recv() if here.poll(TIMEOUT) else None
    finally:
        os.kill(keeper, signal.SIGCONT)
        resource.prlimit(keeper, resource.RLIMIT_NOFILE, limit)
    time.sleep(3)  # past the child's wait after a keeper that did not answer
    here.send_bytes(messages[1])
    second = here.recv() if here.poll(TIMEOUT) else None
    child.join(TIMEOUT)
    yield {"first": first, "second": second, "exitcode": child.exitcode}


SCENARIOS = {
    "born_full": born_full,
    "born_at_the_cap": born_at_the_cap,
    "kill": kill_rounds,
    "unread": unread,
    "memory_limit": memory_limit,
    "keeper_restart": keeper_restart,
    "idle_senders": idle_senders,
    "load_without_keeper": load_without_keeper,
}


def main(argv):
    # As in the test session: every array is shared, also in spawn children.
    os.environ["TORCHSHM_THRESHOLD"] = "1"
    torchshm.set_threshold(1)
    print("session", _session.session_id(), flush=True)
    for result in SCENARIOS[argv[0]](*argv[1:]):
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
