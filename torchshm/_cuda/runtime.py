"""The runtime that every CUDA call of torchshm goes through (Note [The
CUDA seam]): the real one, through torch, and the switch to the fake one
(fake.py) that tests use."""

import collections
import contextlib
import threading

import torch

# Note [The CUDA seam]
# ~~~~~~~~~~~~~~~~~~~~
# torchshm pins the shared memory of batches for the GPU in place: it
# registers a segment's shared mapping with CUDA once, for as long as it is
# mapped (_lifetime/pins.py), copies batches to a device on a stream of its
# own (_device.py), and records events to learn when the copies that may read
# a segment are done (Note [Copies before reuse] in csrc/lifetime/views.h).
# Each of those calls is a method of the runtime in force here: CudaRuntime,
# through torch (torch.cuda.cudart() for registration, torch.cuda.Event and
# Stream), or FakeRuntime (fake.py), which keeps CUDA's rules on a CPU so
# that the CPU suite sees a broken one. The rules callers keep (what other
# projects learned: ../shared/notes/facts.md section 15):
# - Register only in a process that has a CUDA context already (in_use()):
#   a DataLoader worker never makes one.
# - Page-aligned ranges, portable (valid in every context of the process),
#   never twice (CUDA refuses a range registered already), a whole segment
#   for its mapping's whole life (registering costs 2-3 ms per 32 MiB, and
#   unregistering synchronizes the device: never per batch). A failed
#   unregister leaves the range registered.
# - Unregister before the range is unmapped, and at exit before CUDA's own
#   teardown (torchshm's exit hook runs in atexit, before C++'s exit).
# - No CUDA call in a forked child of a process with a context.
# Where there is no device (the pip stack's CUDA build without a driver, a
# CPU build of torch) in_use() is False: nothing is registered or recorded,
# and nothing warns.

# cudaHostRegisterPortable: the range is pinned for every context.
HOST_REGISTER_PORTABLE = 1
# Streams made current through torch.cuda.set_stream (or torch.cuda.stream()),
# the most recent first: a copy may have run on any of them.
STREAMS_REMEMBERED = 16


class CudaError(RuntimeError):
    """A CUDA call of the seam failed; `code` is CUDA's error number."""

    def __init__(self, call, code, text):
        super().__init__(f"{call} failed: {text} (CUDA error {code})")
        self.code = code


class CudaRuntime:
    """CUDA through torch."""

    name = "cuda"

    def __init__(self):
        self._lock = threading.Lock()
        self._copy_streams = {}  # device index -> torchshm's stream there
        self._seen = collections.OrderedDict()  # (device, stream id) -> stream
        self._wrapped = None  # (module, its set_stream) while tracking

    # --- whether to pin at all

    def in_use(self):
        """Whether this process has a CUDA context (asking makes none)."""
        return torch.cuda.is_initialized()

    # --- registration

    def register(self, address, nbytes):
        cudart = torch.cuda.cudart()
        code = cudart.cudaHostRegister(address, nbytes, HOST_REGISTER_PORTABLE)
        self._check(cudart, "cudaHostRegister", code)

    def unregister(self, address):
        cudart = torch.cuda.cudart()
        self._check(cudart, "cudaHostUnregister", cudart.cudaHostUnregister(address))

    @staticmethod
    def _check(cudart, call, code):
        if int(code) != 0:
            raise CudaError(call, int(code), cudart.cudaGetErrorString(code))

    # --- copies

    def device(self, device):
        """`device` as a torch.device with its index."""
        device = torch.device(device)
        if device.index is None:
            device = torch.device(device.type, torch.cuda.current_device())
        return device

    def copy_stream(self, device):
        """torchshm's stream on `device`, made once."""
        with self._lock:
            stream = self._copy_streams.get(device.index)
            if stream is None:
                stream = self._copy_streams[device.index] = torch.cuda.Stream(device)
            return stream

    def empty(self, nbytes, device, stream):
        """Device bytes, allocated for use on `stream`."""
        with torch.cuda.stream(stream):
            return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def copy(self, dst, src, stream):
        """Copies host tensor `src` to device tensor `dst` on `stream`,
        asynchronously where `src` is pinned."""
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)

    def record(self, stream):
        event = torch.cuda.Event(blocking=True)  # a wait sleeps, never spins
        event.record(stream)
        return event

    def hand_over(self, event, buffer):
        """The stream that uses `buffer` next (the caller's current one)
        waits for `event`, and the allocator keeps `buffer` for it."""
        current = torch.cuda.current_stream(buffer.device)
        current.wait_event(event)
        buffer.record_stream(current)

    def record_in_use(self):
        """An event on each stream a copy issued so far may have used: the
        caller's current one, torchshm's, and those made current lately."""
        streams = {}
        for stream in [torch.cuda.current_stream()] + self._streams_seen():
            streams.setdefault((stream.device_index, stream.stream_id), stream)
        return [self.record(stream) for stream in streams.values()]

    def done(self, event):
        return event.query()

    def wait(self, event):
        event.synchronize()

    def _streams_seen(self):
        with self._lock:
            return list(self._copy_streams.values()) + list(self._seen.values())

    # --- which streams are in use

    def _saw(self, stream):
        if stream is None:
            return
        key = (stream.device_index, stream.stream_id)
        with self._lock:
            self._seen[key] = stream
            self._seen.move_to_end(key, last=False)
            while len(self._seen) > STREAMS_REMEMBERED:
                self._seen.popitem()

    def track_streams(self):
        """Remembers the streams made current through torch.cuda.set_stream
        (which torch.cuda.stream() calls), from now on."""
        with self._lock:
            if self._wrapped is not None:
                return
            original = torch.cuda.set_stream

            def set_stream(stream):
                self._saw(stream)
                return original(stream)

            set_stream.__wrapped__ = original
            self._wrapped = original
            torch.cuda.set_stream = set_stream

    def untrack_streams(self):
        with self._lock:
            if self._wrapped is not None:
                torch.cuda.set_stream, self._wrapped = self._wrapped, None

    def after_fork_in_child(self):
        """The parent's streams are not this process's to use."""
        self._lock = threading.Lock()
        self._copy_streams.clear()
        self._seen.clear()


_real = CudaRuntime()
_active = _real


def track_streams():
    """From now on, remember the streams made current through
    torch.cuda.set_stream (Note [Which copies are safe] in _device.py)."""
    _real.track_streams()


def untrack_streams():
    _real.untrack_streams()


def active():
    """The runtime in force."""
    return _active


def install(runtime):
    """Puts `runtime` in force for the rest of the process, its exit
    included (a test's or the device script's FakeRuntime)."""
    global _active
    _active = runtime


@contextlib.contextmanager
def use(runtime):
    """Puts `runtime` in force for the block (tests: a FakeRuntime)."""
    global _active
    previous, _active = _active, runtime
    try:
        yield runtime
    finally:
        _active = previous
