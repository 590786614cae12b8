"""Segments pinned for the GPU in place, and the slots their copies keep
held (Note [Pinned in place])."""

import collections
import threading

from torchshm import _config, _fallback
from torchshm._cuda import runtime as _runtime
from torchshm._native import _C

# Note [Pinned in place]
# ~~~~~~~~~~~~~~~~~~~~~~
# A batch that a DataLoader worker sends lies in a segment's shared mapping.
# Copied to the GPU from there it goes at pageable speed, and torch's
# pin_memory copies it once more before (5.8-7.5 GB/s to the device with 14
# workers, against 43-48 GB/s to the main process: facts section 13).
# Registered with CUDA, that same mapping is pinned: tensor.is_pinned() is
# true, pin_memory() returns the tensor itself, and a copy runs at pinned
# speed (52 GB/s there). So:
# - What is registered: the whole shared mapping of a segment another
#   process created (a batch received), when a process with a CUDA context
#   pins it: DataLoader's pin thread through torchshm's hook
#   (_device.pin_memory), or torchshm.to_device. Not private or read-only
#   mappings (a snapshot's: a page this process writes there becomes its
#   own copy, which a pinned page would not follow; a frozen born segment's,
#   Note [A registered mapping stays as it is] in csrc/lifetime/segment.h);
#   to_device copies a snapshot's unwritten bytes from the shared mapping
#   instead (Note [Born batches pinned in place] in _device.py). Not segments this
#   process created (its pool reuses one the moment its last local view
#   dies: no slot to hold back), and nothing past TORCHSHM_PIN_BYTES: those
#   are copied as pageable memory.
# - For how long: once per segment, for as long as it is mapped here. The
#   registry holds the segment, so nothing unmaps it while it is registered,
#   and a message naming it again is loaded from that mapping (attach takes
#   it when its mapping cache no longer has it: one mapping, one register);
#   it lets go (unregisters, then drops its reference: the unmap comes
#   after) when the segment is dead and idle here (its creator let go, no
#   view left), to make room under the bound (idle ones, least recently
#   used first), and at exit once every copy is done. A forked child forgets
#   every registration without a CUDA call.
# - Copies before reuse: a registered segment defers its views' slot
#   releases (Note [Copies before reuse] in csrc/lifetime/views.h). poll()
#   records events on the streams in use for the releases deferred since its
#   last run, and releases the slots whose events completed. It runs at each
#   pin, each to_device, each receive (attach), trim(), exit and fork.
#   Which copies that covers is Note [Which copies are safe] in _device.py.
# - Failure: a registration CUDA refuses (the locked-memory limit, a device
#   that cannot) leaves the segment unpinned, with one warning; the bound,
#   with one warning too.

# Tests switch Note [Copies before reuse] off, to see what it prevents.
hold_until_copied = True

_lock = threading.RLock()
_pinned = collections.OrderedDict()  # name -> Segment, least recent first
_pinned_bytes = 0
# [events, [(segment, slot, holder)]]: slots released once the events are.
_deferred = collections.deque()


def pin(segment):
    """Registers `segment`'s shared mapping with the GPU runtime, once;
    whether it is pinned now."""
    global _pinned_bytes
    runtime = _runtime.active()
    if segment.created_here or segment.unlinked or not runtime.in_use():
        return False
    with _lock:
        name = segment.name
        if _pinned.get(name) is segment:
            _pinned.move_to_end(name)
            return True
        if name in _pinned:
            return False  # another mapping of it is pinned: attach() missed it
        limit = _config.pin_bytes()
        if not _make_room(segment.capacity, limit):
            _fallback.warn_once(
                ("pins", "bound"),
                f"torchshm: {_pinned_bytes} bytes of shared memory are pinned"
                f" for the GPU, and TORCHSHM_PIN_BYTES is {limit}: further"
                " batches are copied from pageable memory (raise it to pin"
                " them too)",
            )
            return False
        # A frozen mapping is private: never registered, and a registered
        # one is never frozen (Note [A registered mapping stays as it is] in
        # csrc/lifetime/segment.h).
        if not segment.hold_for_device():
            return False
        try:
            runtime.register(segment.address, segment.capacity)
        except _runtime.CudaError as exc:
            segment.release_for_device()
            _fallback.warn_once(
                ("pins", "refused"),
                f"torchshm: pinning shared memory for the GPU failed ({exc});"
                " batches are copied from pageable memory",
            )
            return False
        _pinned[name] = segment
        _pinned_bytes += segment.capacity
        segment.defers_releases = hold_until_copied
        return True


def _make_room(nbytes, limit):
    """Unpins idle segments, least recently used first, until `nbytes` more
    fit under `limit`; whether they do."""
    for name, segment in list(_pinned.items()):
        if _pinned_bytes + nbytes <= limit:
            break
        if segment.local_views == 0:
            _unpin(name)
    return _pinned_bytes + nbytes <= limit


def _unpin(name):
    """Waits for the copies that may read the segment, unregisters, then
    lets go of it (its unmap comes after). A failed unregister leaves it
    registered, and held."""
    global _pinned_bytes
    segment = _pinned[name]
    runtime = _runtime.active()
    # CUDA's unregister synchronizes the device, but a copy issued on a
    # stream torchshm saw is waited for here whatever the driver does: its
    # source must stay registered until it is read. Unpinning is rare (the
    # bound, a dead segment, exit), never per batch.
    for event in runtime.record_in_use():
        runtime.wait(event)
    try:
        runtime.unregister(segment.address)
    except _runtime.CudaError:
        return
    del _pinned[name]
    _pinned_bytes -= segment.capacity
    segment.defers_releases = False
    segment.release_for_device()


def pinned_bytes():
    """The bytes pinned now (the doctor's figure)."""
    return _pinned_bytes


def is_pinned(segment):
    return _pinned.get(segment.name) is segment


def mapped(name):
    """The pinned mapping of segment `name`, or None. A receiver whose last
    view of it died keeps it mapped here even when its mapping cache does
    not (full, or its lock was busy at that moment): attach() takes this
    one, or it would map and register the same memory a second time."""
    return _pinned.get(name)


def poll():
    """Records events for the slot releases deferred since the last call,
    releases those whose events completed, and unpins dead idle segments."""
    taken = _C.take_deferred_releases()
    if not taken and not _deferred and not _pinned:
        return
    runtime = _runtime.active()
    ready = []
    with _lock:
        if taken:
            _deferred.append((runtime.record_in_use(), taken))
        while _deferred and all(runtime.done(e) for e in _deferred[0][0]):
            ready.extend(_deferred.popleft()[1])
        for name, segment in list(_pinned.items()):
            if segment.unlinked and segment.local_views == 0:
                _unpin(name)
    for segment, slot, holder in ready:
        segment.release_slot(slot, holder)


def release_all():
    """At exit: waits for every copy that may read a pinned segment,
    releases the deferred slots, and unregisters every segment (before
    CUDA's own teardown, and before the mappings go)."""
    runtime = _runtime.active()
    with _lock:
        taken = _C.take_deferred_releases()
        if taken:
            _deferred.append((runtime.record_in_use(), taken))
        ready = []
        while _deferred:
            events, slots = _deferred.popleft()
            for event in events:
                runtime.wait(event)
            ready.extend(slots)
        for name in list(_pinned):
            _unpin(name)
    for segment, slot, holder in ready:
        segment.release_slot(slot, holder)


def after_fork_in_child():
    """The registrations and deferred slots are the parent's: forgotten
    without a CUDA call."""
    global _lock, _pinned_bytes
    _lock = threading.RLock()
    for segment in _pinned.values():
        segment.defers_releases = False
        segment.release_for_device()
    _pinned.clear()
    _pinned_bytes = 0
    _deferred.clear()
    _C.forget_deferred_releases()
    _runtime.active().after_fork_in_child()
