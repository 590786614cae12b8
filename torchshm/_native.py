"""The seam between Python and C++: the one module that imports torchshm._C.

Note [The seam]
~~~~~~~~~~~~~~~
C++ does mechanism (csrc/), Python owns every decision (style.md). They meet
here, in two ways and no others:
- Python calls the native module: every other module takes `_C` from here.
- C++ calls torchshm's Python only through the hooks that configure() hands
  over, once, with every policy number, in one native call (`_C.configure`).
  The native side keeps no default of its own: a field configure() leaves
  out is an error at import, not a silent second copy of a number.
C++ also calls Python that is not torchshm's: the protocols of the objects
it moves, which decide nothing of torchshm's: nine, each where pickle or
numpy itself would make it (two of them, an item's loader and `_slice`, are
torchshm's own code when the container is torchshm's, called as the
protocol, not through a hook, and not counted in hook_calls):
- csrc/send/message.cpp: an object's `__reduce__` (reduce_with_token and the
  sender's two fallbacks: numpy's own reduce of a small or odd array);
  numpy's `dtype.metadata` and `dtype.str` (view_args: the dtype that
  travels).
- csrc/send/rebuild.cpp: `reconstruct(*args)` and `__setstate__`
  (rebuild_inline, pickle's own REDUCE and BUILD); `view(subtype)` (a
  subclass rebuilt over a mapping).
- csrc/items/item_reader.cpp: a pickled item's `load` (the unpickler the reader
  was given) and `_slice` (a SharedList subclass's own slicing).
- csrc/lifetime/views.cpp: `_torchshm_owner` set on the tensor that aliases a
  private mapping (it keeps its owner alive).
A new call into Python from C++ is a hook in csrc/base/config.h, or one of these
(tests/test_imports.py counts them by file).
torchshm/__init__.py calls configure() once every module is imported, so no
module's import wires anything and the import order decides nothing. The
threshold is the one number that changes at run time (set_threshold).
"""

import sys

from torchshm import _compat


def _load():
    try:
        import torchshm._C as native
    except ImportError as exc:
        raise _compat.native_import_error(exc) from exc
    _compat.check_native(native)
    return native


try:
    _C = _load()
except ImportError as exc:
    # `python -m torchshm` is how one finds out why: it answers without the
    # extension rather than dying with the import (torchshm/_unloaded.py).
    if not _compat.launched_as_report():
        raise
    from torchshm import _unloaded

    sys.exit(_unloaded.main(exc))


def configure(*, policy, hooks, writers, max_depth, pool):
    """Hands the native side every policy number (`policy`: _sender.policy())
    and every hook (`hooks`: name -> callable, as csrc/base/config.h lists them),
    the writer frames (_channel.WRITERS) and the sender's pool, in one call.
    Called once, by torchshm/__init__.py."""
    _C.configure(
        policy=_C.SenderPolicy(**policy),
        hooks=hooks,
        writers=writers,
        max_depth=max_depth,
        pool=pool,
    )


def set_threshold(threshold):
    """The one number that changes at run time (_config.on_threshold_change)."""
    _C.set_threshold(threshold)
