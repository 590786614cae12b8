"""The seam between Python and C++: the one module that imports torchshm._C.

Note [The seam]
~~~~~~~~~~~~~~~
C++ does mechanism (csrc/), Python owns every decision (style.md). They meet
here, in two ways and no others:
- Python calls the native module: every other module takes `_C` from here.
- C++ calls Python only through the hooks that configure() hands over, once,
  with every policy number, in one native call (`_C.configure`). The native
  side keeps no default of its own: a field configure() leaves out is an
  error at import, not a silent second copy of a number.
torchshm/__init__.py calls configure() once every module is imported, so no
module's import wires anything and the import order decides nothing. The
threshold is the one number that changes at run time (set_threshold).
"""

from torchshm import _compat

try:
    import torchshm._C as _C
except ImportError as exc:
    raise _compat.native_import_error(exc) from exc
_compat.check_native(_C)


def configure(*, policy, hooks, writers, max_depth, pool):
    """Hands the native side every policy number (`policy`: _sender.policy())
    and every hook (`hooks`: name -> callable, as csrc/config.h lists them),
    the writer frames (_channel.WRITERS) and the sender's pool, in one call.
    Called once, by torchshm/__init__.py."""
    _C.configure(**policy, **hooks, writers=writers, max_depth=max_depth, pool=pool)


def set_threshold(threshold):
    """The one number that changes at run time (_config.on_threshold_change)."""
    _C.set_threshold(threshold)
