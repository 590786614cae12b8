"""The wire format: what a pickled array names, and how it is rebuilt.

The rebuild functions' module and names, and their arguments, are in every
pickle torchshm ever wrote: never rename or move them. The policy that
decides what to send is in _sender.py; a message's state in _message.py.
"""

from typing import Any, Optional, Tuple

import torch

from torchshm import _channel, _segments
from torchshm._compat import int8_tensor_over, load_native

_C = load_native()


def rebuild_ndarray(owner, offset, dtype, shape, strides, writeable, subtype):
    """Rebuilds an array over `owner`, the int8 tensor of its segment.

    `dtype` is a dtype or its .str; `subtype` None means a plain ndarray."""
    array = _C.receive_ndarray(owner, offset, dtype, shape, strides, writeable)
    return array if subtype is None else array.view(subtype)


def rebuild_ndarray_from_storage(storage, *view):
    """Rebuilds an array over a torch storage that torch itself shared."""
    return rebuild_ndarray(int8_tensor_over(storage), *view)


def rebuild_ndarray_from_reduced_storage(rebuild_storage, storage_args, *view):
    """Rebuilds an array over a storage that torch's own reducer sent."""
    return rebuild_ndarray_from_storage(rebuild_storage(*storage_args), *view)


def rebuild_empty(*view):
    """Rebuilds a zero-size array (numpy's own pickle drops its byte order)."""
    return rebuild_ndarray(torch.empty(0, dtype=torch.int8), *view)


def rebuild_inline(token, reconstruct, args, state):
    """Rebuilds an array pickled by value (numpy's own reduce, plus a token)."""
    array = reconstruct(*args)
    array.__setstate__(state)
    return array


def message_token():
    """Unpickles a _MessageToken: it carries nothing."""
    return None


def attach_segment(name, ticket=0, generation=0):
    """Unpickles a _SegmentRef: maps the segment and claims the message's
    ticket (once per message; see Note [Segment lifetime])."""
    return _segments.attach(name, ticket, generation)


class _MessageToken:
    """Keeps a message's state alive through arrays pickled inline (the
    pickler's memo holds it, as it holds _SegmentRefs)."""

    __slots__ = ("message", "__weakref__")

    def __init__(self, message):
        self.message = message

    def __reduce__(self):
        return message_token, ()


class _SegmentRef:
    """A segment named by one message. The message's ticket is issued when
    the pickler writes it, so every byte string that names the segment has a
    ticket of its own, even when a nested dumps on this thread shares this
    object with an outer message."""

    __slots__ = ("owner", "name", "message", "__weakref__")

    def __init__(self, owner, name, message):
        self.owner, self.name, self.message = owner, name, message

    def __reduce__(self):
        try:
            held = _C.ticket_for(self.owner, _channel.current())
        except Exception:  # noqa: BLE001 - raising here loses the message
            held = None
        # No ticket (every slot taken): the receiver holds the segment for as
        # long as its generation is unchanged; our view keeps it so until the
        # message is written.
        ticket, generation = held or (0, _C.segment_of(self.owner).generation)
        return attach_segment, (self.name, ticket, generation)


def reference_without_ticket(obj: Any) -> Optional[Tuple[Any, Any]]:
    """For picklers whose bytes are loaded many times (torchshm.dumps): if
    `obj` is a segment reference, (a tensor over its segment, what to write
    instead: the same reference without a ticket, valid while the segment
    keeps its generation); else None."""
    if type(obj) is not _SegmentRef:
        return None
    generation = _C.segment_of(obj.owner).generation
    return obj.owner, (attach_segment, (obj.name, 0, generation))
