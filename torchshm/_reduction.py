"""The wire format: what a pickled array names, and how it is rebuilt.

The rebuild functions' module and names, and their arguments, are in every
pickle torchshm ever wrote: never rename or move them. The policy that
decides what to send is in _sender.py; a message's state, and the segment
references it writes, are native (csrc/message.h, Note [One message, one
snapshot]), and are handed these functions by configure_wire below.
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


def attach_segment(locator, ticket=0, generation=0):
    """Unpickles a SegmentRef (csrc/message.h): maps the segment and claims
    the message's ticket (once per message; see Note [Segment lifetime])."""
    return _segments.attach(locator, ticket, generation)


class _MessageToken:
    """Keeps a message's state alive through arrays pickled inline (the
    pickler's memo holds it, as it holds SegmentRefs)."""

    __slots__ = ("message", "__weakref__")

    def __init__(self, message):
        self.message = message

    def __reduce__(self):
        return message_token, ()


def reference_without_ticket(obj: Any) -> Optional[Tuple[Any, Any]]:
    """For picklers whose bytes are loaded many times (torchshm.dumps): if
    `obj` is a segment reference, (a tensor over its segment, what to write
    instead: the same reference without a ticket, valid while the segment
    keeps its generation); else None."""
    if type(obj) is not _C.SegmentRef:
        return None
    segment = _C.segment_of(obj.owner)
    return obj.owner, (attach_segment, (segment.locator, 0, segment.generation))


_C.configure_wire(
    rebuild_ndarray=rebuild_ndarray,
    attach_segment=attach_segment,
    message_token=_MessageToken,
)
_channel.configure()
