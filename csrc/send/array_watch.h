// Knowing that an array the sender remembers is gone, without a weak
// reference on it.
//
// Note [Knowing that a sent array is gone]
// The sender remembers arrays it copied until they die: an unchanged array
// sent again is not copied again (snapshots.h), and a large one's pages are
// mapped over its snapshot (one_copy.h). A weak reference on the array would
// tell, but NumPy refuses resize() of an array that anything weakly
// references, refcheck=False or not, where it worked without torchshm. So
// an array that owns its data is watched through its memory handler
// instead (NEP 49: each array keeps the handler that frees its data): it is
// swapped for a wrapper of that handler ("torchshm_watched", one per
// handler wrapped) which, before it frees or moves (realloc: resize) the
// data of a watched array, runs the callbacks registered for it, with the
// GIL held as NumPy calls it. Everything else (a view: NumPy never resizes
// one; a non-array root; a handler this cannot wrap) gets a weak reference,
// as before. What a user can see: np.lib.get_handler_name(a) names the
// wrapper once `a` was sent; numpy.ndarray's behaviour is unchanged.
#pragma once

#include <Python.h>

#include "base/torch_api.h"

namespace torchshm {

// Calls `forget(owner)` once `owner` dies or, for an array that owns its
// data, once that data is freed or moved. What it returns keeps the watch
// (a weak reference, or None): the caller holds it while it remembers.
py::object forget_when_gone(py::handle owner, void (*forget)(PyObject*));

// The handler a watched array's data came from, if `capsule` is the
// wrapper; else `capsule` itself (borrowed either way).
PyObject* unwatched_handler(PyObject* capsule);

}  // namespace torchshm
