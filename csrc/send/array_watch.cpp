// Note [Knowing that a sent array is gone] (array_watch.h).
#include "send/array_watch.h"

#include <algorithm>
#include <cstring>
#include <unordered_map>
#include <utility>
#include <vector>

#include "base/numpy_api.h"
#include "base/python_compat.h"
#include "lifetime/live.h"

namespace torchshm {
namespace {

constexpr const char* kWatchCapsule = "mem_handler";  // NumPy's capsule name
constexpr const char* kWatchedName = "torchshm_watched";

struct Wrapped {
  PyDataMem_Handler* inner;
  PyObject* inner_capsule;  // strong reference, never released
};

struct Watch {
  PyObject* owner;  // the array (borrowed: the watch ends before it dies)
  std::vector<void (*)(PyObject*)> forget;
};

// By data address; never destroyed (arrays die during shutdown). Guarded by
// the GIL, which NumPy holds when it calls a handler.
std::unordered_map<uintptr_t, Watch>& watches() {
  static auto* table = new std::unordered_map<uintptr_t, Watch>();
  return *table;
}

// The watch on `data` ends: its callbacks run (taken out first: they may
// free other arrays, which come back here).
void end_watch(void* data) {
  auto& table = watches();
  auto found = table.find(reinterpret_cast<uintptr_t>(data));
  if (found == table.end()) return;
  Watch watch = std::move(found->second);
  table.erase(found);
  PyObject* pending = fetch_error();  // NumPy may free while one propagates
  for (auto forget : watch.forget) forget(watch.owner);
  restore_error(pending);
}

Wrapped& wrapped_ctx(void* ctx) { return *static_cast<Wrapped*>(ctx); }

void* watched_malloc(void* ctx, size_t size) {
  auto& w = wrapped_ctx(ctx);
  return w.inner->allocator.malloc(w.inner->allocator.ctx, size);
}

void* watched_calloc(void* ctx, size_t n, size_t size) {
  auto& w = wrapped_ctx(ctx);
  return w.inner->allocator.calloc(w.inner->allocator.ctx, n, size);
}

void* watched_realloc(void* ctx, void* ptr, size_t size) {
  auto& w = wrapped_ctx(ctx);
  end_watch(ptr);  // what was remembered of these bytes no longer holds
  return w.inner->allocator.realloc(w.inner->allocator.ctx, ptr, size);
}

void watched_free(void* ctx, void* ptr, size_t size) {
  auto& w = wrapped_ctx(ctx);
  end_watch(ptr);
  w.inner->allocator.free(w.inner->allocator.ctx, ptr, size);
}

PyDataMem_Handler* watched_capsule_handler(PyObject* capsule) {
  auto* h = static_cast<PyDataMem_Handler*>(
      PyCapsule_GetPointer(capsule, kWatchCapsule));
  if (h == nullptr) PyErr_Clear();
  return h;
}

bool is_wrapper(PyDataMem_Handler* h) {
  return h != nullptr && h->allocator.free == watched_free;
}

// The wrapper of `inner` (one per handler wrapped, never freed), or null.
PyObject* wrapper_of(PyObject* inner) {
  static auto* made = new std::unordered_map<PyObject*, PyObject*>();
  auto found = made->find(inner);
  if (found != made->end()) return found->second;
  PyDataMem_Handler* h = watched_capsule_handler(inner);
  if (h == nullptr) return nullptr;
  Py_INCREF(inner);
  auto* handler = new PyDataMem_Handler{};
  std::strncpy(handler->name, kWatchedName, sizeof(handler->name) - 1);
  handler->version = 1;
  handler->allocator = {new Wrapped{h, inner}, watched_malloc, watched_calloc,
                        watched_realloc, watched_free};
  PyObject* capsule = PyCapsule_New(handler, kWatchCapsule, nullptr);
  if (capsule == nullptr) {
    PyErr_Clear();
    return nullptr;
  }
  made->emplace(inner, capsule);
  return capsule;
}

// Watches `a` through its handler; false where it cannot.
bool watch_array(PyArrayObject* a, void (*forget)(PyObject*)) {
  if (PyArray_BASE(a) != nullptr || !(PyArray_FLAGS(a) & NPY_ARRAY_OWNDATA))
    return false;
  auto* fields = reinterpret_cast<PyArrayObject_fields*>(a);
  PyObject* current = fields->mem_handler;
  if (current == nullptr) return false;
  if (!is_wrapper(watched_capsule_handler(current))) {
    PyObject* wrapper = wrapper_of(current);
    if (wrapper == nullptr) return false;
    Py_INCREF(wrapper);
    fields->mem_handler = wrapper;
    Py_DECREF(current);  // the wrapper holds the handler it wraps
  }
  Watch& w = watches()[reinterpret_cast<uintptr_t>(PyArray_DATA(a))];
  w.owner = reinterpret_cast<PyObject*>(a);
  if (std::find(w.forget.begin(), w.forget.end(), forget) == w.forget.end())
    w.forget.push_back(forget);
  return true;
}

}  // namespace

py::object forget_when_gone(py::handle owner, void (*forget)(PyObject*)) {
  if (PyArray_Check(owner.ptr()) &&
      watch_array(reinterpret_cast<PyArrayObject*>(owner.ptr()), forget))
    return py::none();
  return weak_ref_forgetting(owner, forget);
}

PyObject* unwatched_handler(PyObject* capsule) {
  PyDataMem_Handler* h = watched_capsule_handler(capsule);
  return is_wrapper(h) ? static_cast<Wrapped*>(h->allocator.ctx)->inner_capsule
                       : capsule;
}

}  // namespace torchshm
