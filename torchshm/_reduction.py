"""The wire format: what a pickled array names, and how it is rebuilt.

The rebuild functions' module and names, and their arguments, are in every
pickle torchshm ever wrote: never rename or move them (tests/test_wire_format.py
loads messages that earlier versions wrote). The hot ones are native (Note
[One message, one snapshot] in csrc/send/message.h), made under exactly these
names, so that pickle names them here. The policy that decides what to send is
in _send/sender.py; a message's state, and the segment references it writes, are
native too.
"""

import weakref
from typing import Any, Optional, Tuple

import torch

from torchshm._lifetime import attach as _attach
from torchshm._compat import int8_tensor_over, untyped_storage
from torchshm._native import _C

# rebuild_ndarray(owner, offset, dtype, shape, strides, writeable, subtype):
# an array over `owner`, the int8 tensor of its segment; `dtype` is a dtype
# or its .str, `subtype` None for a plain ndarray.
rebuild_ndarray = _C.rebuild_ndarray
# rebuild_inline(token, reconstruct, args, state): an array pickled by value
# (numpy's own reduce) after its message's token.
rebuild_inline = _C.rebuild_inline
# message_token(): what a message's token unpickles as (None).
message_token = _C.message_token


def rebuild_ndarray_from_storage(storage, *view):
    """Rebuilds an array over a torch storage that torch itself shared."""
    return rebuild_ndarray(int8_tensor_over(storage), *view)


def rebuild_ndarray_from_reduced_storage(rebuild_storage, storage_args, *view):
    """Rebuilds an array over a storage that torch's own reducer sent."""
    return rebuild_ndarray_from_storage(rebuild_storage(*storage_args), *view)


def rebuild_storage(owner, nbytes):
    """Rebuilds a torch storage sent by reference: this process's one
    storage over the first `nbytes` of `owner`'s segment (Note [Tensor
    storages] in csrc/send/tensors.h). torch's own rebuilds make the tensor."""
    return untyped_storage(_C.segment_storage(owner, nbytes))


def rebuild_storage_block(owner, offset, nbytes):
    """Rebuilds a small torch storage sent by reference: this process's one
    storage over the `nbytes` at `offset` of `owner`'s segment, a slab
    (Note [Small storages] in csrc/send/tensors.h)."""
    return untyped_storage(_C.block_storage(owner, offset, nbytes))


def rebuild_by_value(reconstruct, args, state):
    """Rebuilds an array torchshm pickles by value by design (an object
    dtype, a structured one with an object field: its elements are Python
    objects): numpy's own reduce, under a name of torchshm's, so that its
    receiver does not take it for a sender without torchshm (Note [Arrays
    that arrive by value] in _send/arrivals.py)."""
    array = reconstruct(*args)
    array.__setstate__(state)
    return array


def rebuild_empty(*view):
    """Rebuilds a zero-size array (numpy's own pickle drops its byte order)."""
    return rebuild_ndarray(torch.empty(0, dtype=torch.int8), *view)


# The arrays under the pyarrow Buffers that rebuild_arrow_buffer made, by the
# Buffer's address, while they live (Note [Arrow buffers] in _send/arrow.py).
ARROW_BUFFERS: "weakref.WeakValueDictionary[int, Any]" = weakref.WeakValueDictionary()


def rebuild_arrow_buffer(array):
    """A pyarrow Buffer over `array` (a uint8 ndarray), without a copy; the
    Buffer keeps the array, and so its segment, alive."""
    import pyarrow

    buffer = pyarrow.py_buffer(array)
    if array.size:
        ARROW_BUFFERS[buffer.address] = array
    return buffer


def attach_segment(locator, ticket=0, generation=0):
    """Unpickles a SegmentRef (csrc/send/message.h): maps the segment and claims
    the message's ticket (once per message; see Note [Segment lifetime])."""
    return _attach.attach(locator, ticket, generation)


def reference_without_ticket(obj: Any) -> Optional[Tuple[Any, Any]]:
    """For picklers whose bytes are loaded many times (torchshm.dumps): if
    `obj` is a segment reference, (a tensor over its segment, what to write
    instead: the same reference without a ticket, valid while the segment
    keeps its generation); else None."""
    if type(obj) is not _C.SegmentRef:
        return None
    segment = _C.segment_of(obj.owner)
    return obj.owner, (attach_segment, (segment.locator, 0, segment.generation))
