"""One message's state on the sender.

Note [One message, one snapshot]
multiprocessing pickles each message with a fresh ForkingPickler, whose memo
holds every object it pickled until the message is done. A reducer sees only
the array, so the per-message state lives in a Message that only the
_SegmentRef objects (and the _MessageToken) in that memo keep alive; the
thread remembers it weakly. Its native Plan (csrc/plan.h, Note [Sender plan])
remembers which buffers this message copied and where, so within a message
views of one buffer share one copy and one segment (aliasing survives), and
the next message starts afresh (a later send snapshots the array again).
"""

import threading
import weakref

from torchshm._compat import load_native
from torchshm._reduction import _MessageToken, _SegmentRef

_C = load_native()


def _dead():
    return None


class Message:
    __slots__ = ("plan", "refs", "small_bytes", "_token", "__weakref__")

    def __init__(self):
        # Plan.place(array, copy=False) -> (owner, segment name, view args)
        # for an array this message sends through shared memory, copying it
        # if needed; (torch tensor, None, offset) for memory a torch tensor
        # owns that torchshm did not make (csrc/plan.h).
        self.plan = _C.Plan()
        self.small_bytes = 0  # below-threshold bytes pickled inline so far
        self._token = _dead  # weak ref to this message's _MessageToken
        # segment name -> weak ref to its _SegmentRef: a strong one would
        # make a cycle that keeps the message alive past its pickler, and a
        # later message would reuse a stale snapshot.
        self.refs = {}

    def ref(self, owner, name):
        """This message's reference to segment `name` (owner: a tensor over it)."""
        weak = self.refs.get(name)
        ref = None if weak is None else weak()
        if ref is None:
            ref = _SegmentRef(owner, name, self)
            self.refs[name] = weakref.ref(ref)
        return ref

    def token(self):
        """The object that keeps this message alive through inline arrays."""
        token = self._token()
        if token is None:
            token = _MessageToken(self)
            self._token = weakref.ref(token)
        return token


_thread = threading.local()


def current():
    """The message this thread is pickling (a new one if none is alive)."""
    message = getattr(_thread, "message", _dead)()
    if message is None:
        message = Message()
        _thread.message = weakref.ref(message)
    return message
