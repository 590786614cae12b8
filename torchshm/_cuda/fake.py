"""A CUDA runtime on a CPU that keeps CUDA's rules and makes a broken one
visible (Note [The CUDA seam] in runtime.py): for the tests and the device
script's CPU half, never for users.

- Registration is kept per address range: a range that is not page-aligned,
  empty, not mapped, or overlaps one registered already is refused with
  CUDA's error; unregistering a range that is not registered is refused. A
  registered range that is no longer mapped as it was registered (unmapped,
  mapped anew, remapped from shared to private or back: real CUDA goes on
  reading the pages it locked, stale bytes with no error) is a violation,
  found at every call and by check(). So is registering a private mapping
  of a file, which CUDA accepts but which breaks its copy-on-write on every
  page (Note [A registered mapping stays as it is] in
  csrc/lifetime/segment.h).
- A read-only range (PROT_READ) is refused, as CUDA refuses one without
  cudaHostRegisterReadOnly on a device that does not use the host's page
  tables; past `lockable` bytes registered, a registration fails with
  cudaErrorMemoryAllocation (a machine's limit on locked memory).
- Unregistering a range that a pending copy still reads is a violation:
  the caller waits for its copies first, whether or not the driver's
  unregister would (torchshm/_lifetime/pins.py).
- A copy is asynchronous, as CUDA's from pinned memory is: it reads its
  source only when it completes, a random time (up to twice `delay`) after
  it was issued, in any order, and only when the runtime is asked about it
  (done, wait). A copy from memory that is not registered reads its source
  before it returns, as CUDA's from pageable memory does. So memory reused
  before its copy completed gives the device other bytes: a checksum there
  finds it.
- Any call from a forked child of the process that made it is a violation
  (CUDA forbids it).
- hand_over(event, buffer) makes the current stream wait for `event`;
  consume(tensor), a kernel on the current stream reading a device tensor,
  is a violation if a copy into it is not done and that stream never
  waited for it (the consumer would read bytes not yet copied).
"""

import collections
import contextlib
import ctypes
import os
import random
import threading
import time

import torch

from torchshm._cuda.runtime import CudaError

PAGE = os.sysconf("SC_PAGE_SIZE")
# CUDA's error numbers for what the fake refuses.
INVALID_VALUE = 1
MEMORY_ALLOCATION = 2
ALREADY_REGISTERED = 712
NOT_REGISTERED = 713


class FakeStream:
    def __init__(self, name):
        self.name = name
        self.ops = []  # the copies issued on it, in order

    def __repr__(self):
        return f"FakeStream({self.name})"


class FakeEvent:
    def __init__(self, ops):
        self.ops = ops  # what it waits for


class _Copy:
    """A copy's destination tensor is kept until it is done (as torch's
    caching allocator keeps device memory for a stream's pending work); its
    source is only an address: nothing of the fake keeps it alive."""

    __slots__ = ("dst", "src", "nbytes", "due", "done", "to", "stream")

    def __init__(self, dst, src, nbytes, due, stream):
        self.dst, self.src, self.nbytes, self.due = dst, src, nbytes, due
        self.to = dst.data_ptr()  # where on the device, once dst is let go
        self.stream = stream
        self.done = False

    def run(self):
        ctypes.memmove(self.dst.data_ptr(), self.src, self.nbytes)
        self.dst = None
        self.done = True


class FakeRuntime:
    """See the module's docstring. `delay`: the mean seconds a copy takes;
    `seed`: its random order."""

    name = "fake"

    def __init__(self, delay=0.02, seed=0, lockable=None):
        self.delay = delay
        self.lockable = lockable  # bytes that may be registered; None: any
        self.registered = {}  # address -> (nbytes, what maps it then)
        self.violations = []
        self.calls = collections.Counter()
        self.pageable_bytes = 0  # copied from memory not registered
        self._pid = os.getpid()
        self._rng = random.Random(seed)
        self._lock = threading.RLock()
        self._pending = []  # copies not done, any order
        self._streams = {}  # device index -> its copy stream
        self._default = FakeStream("default")
        self._current = threading.local()
        self._seen = []
        self._waited = {}  # stream -> the pending copies it waits for

    def _call(self, name):
        self.calls[name] += 1
        if os.getpid() != self._pid:
            self.violations.append(f"{name} in a forked child ({os.getpid()})")
        self._check_mapped()

    # --- registration

    def in_use(self):
        return True

    def register(self, address, nbytes):
        with self._lock:
            self._call("register")
            if address % PAGE or nbytes <= 0 or nbytes % PAGE:
                raise CudaError("cudaHostRegister", INVALID_VALUE, "invalid argument")
            for other, (size, _) in self.registered.items():
                if address < other + size and other < address + nbytes:
                    raise CudaError(
                        "cudaHostRegister",
                        ALREADY_REGISTERED,
                        "part or all of the requested memory range is already"
                        " mapped",
                    )
            what = _mapped(address, nbytes)
            if what is None:
                raise CudaError("cudaHostRegister", INVALID_VALUE, "invalid argument")
            if not what[1].startswith("rw"):
                raise CudaError(
                    "cudaHostRegister",
                    INVALID_VALUE,
                    "invalid argument (read-only memory without"
                    " cudaHostRegisterReadOnly)",
                )
            if (
                self.lockable is not None
                and self.registered_bytes() + nbytes > self.lockable
            ):
                raise CudaError("cudaHostRegister", MEMORY_ALLOCATION, "out of memory")
            if what[0] == "private" and what[3] != "0":  # inode 0: anonymous
                self.violations.append(
                    f"a private mapping of a file ({address:#x}, {nbytes} bytes)"
                    " was registered"
                )
            self.registered[address] = (nbytes, what)

    def unregister(self, address):
        with self._lock:
            self._call("unregister")
            if address not in self.registered:
                raise CudaError(
                    "cudaHostUnregister",
                    NOT_REGISTERED,
                    "pointer does not correspond to a registered memory region",
                )
            nbytes = self.registered[address][0]
            if any(
                address <= op.src < address + nbytes and not op.done
                for op in self._pending
            ):
                self.violations.append(
                    f"a registered range ({address:#x}, {nbytes} bytes) was"
                    " unregistered while a copy from it was pending"
                )
            del self.registered[address]

    def check(self):
        """Records a violation for each registered range no longer mapped as
        it was; the violations so far."""
        with self._lock:
            self._check_mapped()
            return list(self.violations)

    def _check_mapped(self):
        if not self.registered:
            return
        maps = _maps()
        for address, (nbytes, what) in list(self.registered.items()):
            if _mapped(address, nbytes, maps) != what:
                self.violations.append(
                    f"a registered range ({address:#x}, {nbytes} bytes) was"
                    " unmapped or remapped before it was unregistered"
                )
                del self.registered[address]

    def registered_bytes(self):
        with self._lock:
            return sum(n for n, _ in self.registered.values())

    # --- copies

    def device(self, device):
        device = torch.device(device)
        return torch.device(device.type, device.index or 0)

    def copy_stream(self, device):
        with self._lock:
            stream = self._streams.get(device.index)
            if stream is None:
                stream = self._streams[device.index] = FakeStream(f"copy:{device}")
            return stream

    def empty(self, nbytes, device, stream):
        """Fake device memory: host bytes that only copies write."""
        return torch.empty(nbytes, dtype=torch.uint8)

    def copy(self, dst, src, stream):
        with self._lock:
            self._call("copy")
            nbytes = src.numel() * src.element_size()
            assert dst.numel() * dst.element_size() == nbytes, (dst.shape, src.shape)
            op = _Copy(dst, src.data_ptr(), nbytes, 0.0, stream)
            if self._pinned(src.data_ptr(), nbytes):
                op.due = time.monotonic() + self._rng.uniform(0, 2 * self.delay)
                self._pending.append(op)
            else:
                op.run()  # pageable: staged before the call returns
                self.pageable_bytes += nbytes
            stream.ops.append(op)

    def _pinned(self, address, nbytes):
        return any(
            start <= address and address + nbytes <= start + size
            for start, (size, _) in self.registered.items()
        )

    def record(self, stream):
        with self._lock:
            self._call("record")
            return FakeEvent(list(stream.ops))

    def hand_over(self, event, buffer):
        """The consumer's (current) stream waits for `event` before it uses
        `buffer` (see consume)."""
        with self._lock:
            self._call("hand_over")
            waited = self._waited.setdefault(self.current_stream(), set())
            waited.difference_update([op for op in waited if op.done])
            waited.update(op for op in event.ops if not op.done)

    def consume(self, tensor):
        """A kernel on the current stream reads device tensor `tensor`: the
        copies into it on that stream, or that it waited for, are done
        first; one it is not ordered after, not done, is a violation."""
        with self._lock:
            stream = self.current_stream()
            lo = tensor.data_ptr()
            hi = lo + tensor.numel() * tensor.element_size()
            waited = self._waited.get(stream, ())
            for op in sorted(self._pending, key=_due):
                if not (op.to < hi and lo < op.to + op.nbytes):
                    continue
                if op.stream is stream or op in waited:
                    self._run(op)  # ordered before the kernel
                else:
                    self.violations.append(
                        f"a device tensor ({lo:#x}) was read on {stream} before"
                        " its copy was done, and that stream never waited for it"
                    )

    def record_in_use(self):
        with self._lock:
            streams = [self.current_stream()] + list(self._streams.values())
            streams += self._seen
            return [self.record(s) for s in dict.fromkeys(streams)]

    def done(self, event):
        with self._lock:
            self._call("done")
            self._progress(time.monotonic())
            return _all_done(event)

    def wait(self, event):
        with self._lock:
            self._call("wait")
            for op in sorted((op for op in event.ops if not op.done), key=_due):
                self._run(op)

    def synchronize(self):
        """Completes every copy (the test's cudaDeviceSynchronize)."""
        with self._lock:
            self._synchronize()

    def _synchronize(self):
        for op in sorted(self._pending, key=_due):
            self._run(op)

    def _progress(self, now):
        for op in sorted(self._pending, key=_due):
            if op.due <= now:
                self._run(op)

    def _run(self, op):
        if not op.done:
            op.run()
        if op in self._pending:
            self._pending.remove(op)

    # --- streams a user's copies run on

    def current_stream(self):
        return getattr(self._current, "stream", self._default)

    @contextlib.contextmanager
    def stream(self, stream):
        """torch.cuda.stream(): `stream` is current in the block, and seen
        (torchshm's tracking of torch.cuda.set_stream)."""
        previous = self.current_stream()
        self._current.stream = stream
        if stream not in self._seen:
            self._seen.append(stream)
        try:
            yield stream
        finally:
            self._current.stream = previous

    def user_copy(self, dst, src):
        """What `src.to(device, non_blocking=True)` does on the current
        stream: a copy torchshm did not issue."""
        self.copy(dst, src, self.current_stream())

    def track_streams(self):
        pass

    def untrack_streams(self):
        pass

    def after_fork_in_child(self):
        pass  # the child's calls are the violations to see


def _due(op):
    return op.due


def _all_done(event):
    return all(op.done for op in event.ops)


def _maps():
    """[(start, end, shared or private, permissions, device, inode, file
    offset)] of /proc/self/maps, sorted."""
    with open("/proc/self/maps") as f:
        lines = [line.split() for line in f]
    return [
        (
            *(int(x, 16) for x in fields[0].split("-")),
            "shared" if fields[1][3] == "s" else "private",
            fields[1][:3],
            fields[3],
            fields[4],
            int(fields[2], 16),
        )
        for fields in lines
    ]


def _mapped(address, nbytes, maps=None):
    """(shared or private, permissions, device, inode, file offset at
    `address`) of the one mapping of one file over all of [address, address
    + nbytes), or None."""
    end, at, found = address + nbytes, address, None
    for lo, hi, kind, perms, dev, inode, offset in (
        maps if maps is not None else _maps()
    ):
        if hi <= at:
            continue
        if lo > at:
            return None  # a hole
        here = (kind, perms, dev, inode, offset + (at - lo) - (at - address))
        if found is None:
            found = here
        elif here != found:
            return None
        at = hi
        if at >= end:
            return found
    return None
