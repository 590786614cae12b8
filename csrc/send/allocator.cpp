#include "send/allocator.h"

#include <cstring>
#include <unordered_map>

#include "base/config.h"
#include "base/errors.h"
#include "base/numpy_api.h"
#include "base/python_compat.h"
#include "base/stats.h"
#include "lifetime/segment.h"
#include "lifetime/slabs.h"
#include "lifetime/views.h"

namespace torchshm {
namespace {

constexpr const char* kCapsule = "mem_handler";  // NumPy's capsule name

struct BornContext {
  int64_t min_bytes;
  PyObject* fallback_capsule;  // strong reference: keeps `fallback` alive
  PyDataMem_Handler* fallback;
};

struct Block {
  PyObject* owner;  // the segment's int8 tensor (strong reference), or
  Slab* slab;       // the slab a small block was carved from (slabs.h)
  size_t size;      // bytes NumPy asked for
  size_t capacity;  // bytes usable from the block's address
};

// Guarded by the GIL (Note [Born shared]).
std::unordered_map<uintptr_t, Block> blocks;
// Set while the source runs: whatever it allocates is not born.
thread_local bool in_source = false;

// Holds the GIL, and keeps the caller's pending exception (NumPy may free
// while one propagates) out of reach of the Python code run meanwhile.
class PythonGuard {
 public:
  PythonGuard() : gil_(PyGILState_Ensure()), pending_(fetch_error()) {}
  ~PythonGuard() {
    restore_error(pending_);
    PyGILState_Release(gil_);
  }

 private:
  PyGILState_STATE gil_;
  PyObject* pending_;
};

// The source's segment tensor for `size` bytes and whether it was used
// before; (None, false) when it declines. Call with a PythonGuard held.
std::pair<py::object, bool> ask_source(size_t size) {
  PyObject* source = config().hooks.born_source;
  py::int_ wanted(size);
  in_source = true;
  PyObject* result = call_hook(source, wanted.ptr());
  in_source = false;
  if (result == nullptr) {
    // The source catches its own failures; reaching here is a bug, and
    // NumPy's allocation still succeeds through the fallback.
    PyErr_WriteUnraisable(source);
    return {py::none(), false};
  }
  py::object reply = py::reinterpret_steal<py::object>(result);
  if (reply.is_none()) return {py::none(), false};
  auto [owner, reused] = reply.cast<std::pair<py::object, bool>>();
  at::Tensor tensor = owner.cast<at::Tensor>();
  TORCH_CHECK(tensor.is_contiguous() && tensor.scalar_type() == at::kChar &&
                  static_cast<size_t>(tensor.numel()) >= size,
              "torchshm: the born-memory source returned a tensor that cannot "
              "hold ",
              size, " bytes");
  return {std::move(owner), reused};
}

// A block carved from a slab, a new slab opened if needed (Note [Small
// blocks]); an empty one where none can be had. Call with a PythonGuard
// held.
Slabs::Block carve_or_open(size_t size) {
  Slabs& all = slabs();
  Slabs::Block block = all.carve(size);
  if (block.data != nullptr) return block;
  if (!all.may_open()) {
    count(kAllocationsFallback);
    return {};
  }
  auto [owner, reused] = ask_source(Slabs::kSlabBytes);
  if (owner.is_none()) {
    all.declined();
    return {};
  }
  all.open(std::move(owner), reused);
  return all.carve(size);
}

// A small block carved from a slab (Note [Small blocks]), or nullptr.
void* take_small_block(size_t size, bool zeroed) {
  const Slabs::Block block = carve_or_open(size);
  if (block.data == nullptr) return nullptr;
  if (zeroed && block.dirty) std::memset(block.data, 0, size);
  blocks[reinterpret_cast<uintptr_t>(block.data)] = {nullptr, block.slab, size,
                                                     block.capacity};
  return block.data;
}

// A born block of `size` bytes, or nullptr when the source declines. Call
// with a PythonGuard held.
void* take_block(size_t size, bool zeroed) {
  if (!configured() || in_source) return nullptr;
  if (size <= Slabs::kMaxBlock) return take_small_block(size, zeroed);
  auto [owner, reused] = ask_source(size);
  if (owner.is_none()) return nullptr;
  at::Tensor tensor = owner.cast<at::Tensor>();
  void* data = tensor.data_ptr();
  // A fresh memfd reads as zero however it was populated; a reused segment
  // holds its last message.
  if (zeroed && reused) std::memset(data, 0, size);
  blocks[reinterpret_cast<uintptr_t>(data)] = {
      owner.release().ptr(), nullptr, size,
      static_cast<size_t>(tensor.numel())};
  return data;
}

void* allocate(BornContext* ctx, size_t size, bool zeroed) {
  if (size > 0 && size >= static_cast<size_t>(ctx->min_bytes)) {
    PythonGuard guard;
    try {
      if (void* data = take_block(size, zeroed)) {
        count(kAllocationsShared);
        return data;
      }
    } catch (const std::exception& e) {
      PyErr_SetString(PyExc_RuntimeError, e.what());
      PyErr_WriteUnraisable(config().hooks.born_source);
    }
  }
  PyDataMemAllocator& fallback = ctx->fallback->allocator;
  return zeroed ? fallback.calloc(fallback.ctx, size, 1)
                : fallback.malloc(fallback.ctx, size);
}

PyObject* owner_of(const Block& block) {
  return block.slab != nullptr ? Slabs::owner(block.slab) : block.owner;
}

// Drops a born block's owner; false if `data` is not a born block.
bool release_block(void* data) {
  PythonGuard guard;
  auto it = blocks.find(reinterpret_cast<uintptr_t>(data));
  if (it == blocks.end()) return false;
  const Block block = it->second;
  blocks.erase(it);
  if (block.slab != nullptr)
    slabs().release(block.slab, block.capacity);
  else
    Py_DECREF(block.owner);
  return true;
}

void* born_malloc(void* ctx, size_t size) {
  return allocate(static_cast<BornContext*>(ctx), size, false);
}

void* born_calloc(void* ctx, size_t count, size_t itemsize) {
  size_t size = 0;
  if (__builtin_mul_overflow(count, itemsize, &size)) return nullptr;
  return allocate(static_cast<BornContext*>(ctx), size, true);
}

void* born_realloc(void* raw_ctx, void* data, size_t size) {
  auto* ctx = static_cast<BornContext*>(raw_ctx);
  size_t old_size = 0;
  {
    PythonGuard guard;
    auto it = blocks.find(reinterpret_cast<uintptr_t>(data));
    if (it != blocks.end()) {
      if (size <= it->second.capacity) {
        it->second.size = size;
        return data;
      }
      old_size = it->second.size;
    }
  }
  PyDataMemAllocator& fallback = ctx->fallback->allocator;
  if (old_size == 0) return fallback.realloc(fallback.ctx, data, size);
  void* moved = allocate(ctx, size, false);
  if (moved == nullptr) return nullptr;  // realloc failed: `data` stays valid
  std::memcpy(moved, data, old_size);
  release_block(data);
  return moved;
}

void born_free(void* ctx, void* data, size_t size) {
  if (data != nullptr && release_block(data)) return;
  PyDataMemAllocator& fallback =
      static_cast<BornContext*>(ctx)->fallback->allocator;
  fallback.free(fallback.ctx, data, size);
}

PyDataMem_Handler* handler_of(py::handle capsule) {
  auto* handler = static_cast<PyDataMem_Handler*>(
      PyCapsule_GetPointer(capsule.ptr(), kCapsule));
  if (handler == nullptr) throw py::error_already_set();
  return handler;
}

bool is_born(const PyDataMem_Handler* handler) {
  return handler->allocator.malloc == born_malloc;
}

// Runs when the capsule's last reference goes: NumPy arrays hold their
// handler's capsule, so no block of this handler is alive any more.
void destroy_handler(PyObject* capsule) {
  auto* handler =
      static_cast<PyDataMem_Handler*>(PyCapsule_GetPointer(capsule, kCapsule));
  auto* ctx = static_cast<BornContext*>(handler->allocator.ctx);
  Py_DECREF(ctx->fallback_capsule);
  delete ctx;
  delete handler;
}

}  // namespace

Slabs::Block carve_block(size_t size) {
  if (size > Slabs::kMaxBlock || !configured()) return {};
  PythonGuard guard;
  return carve_or_open(size);
}

py::object make_born_handler(int64_t min_bytes, py::object fallback) {
  TORCH_CHECK(min_bytes >= 1, "expected min_bytes >= 1, got ", min_bytes);
  PyDataMem_Handler* fallback_handler = handler_of(fallback);
  if (is_born(fallback_handler)) {
    auto* inner = static_cast<BornContext*>(fallback_handler->allocator.ctx);
    fallback = py::reinterpret_borrow<py::object>(inner->fallback_capsule);
    fallback_handler = inner->fallback;
  }
  auto* ctx =
      new BornContext{min_bytes, fallback.release().ptr(), fallback_handler};
  auto* handler = new PyDataMem_Handler{};
  std::strncpy(handler->name, "torchshm_born", sizeof(handler->name) - 1);
  handler->version = 1;
  handler->allocator = {ctx, born_malloc, born_calloc, born_realloc, born_free};
  PyObject* capsule = PyCapsule_New(handler, kCapsule, destroy_handler);
  if (capsule == nullptr) {
    Py_DECREF(ctx->fallback_capsule);
    delete ctx;
    delete handler;
    throw py::error_already_set();
  }
  return py::reinterpret_steal<py::object>(capsule);
}

py::object born_fallback(py::handle capsule) {
  PyDataMem_Handler* handler = handler_of(capsule);
  if (!is_born(handler)) return py::none();
  return py::reinterpret_borrow<py::object>(
      static_cast<BornContext*>(handler->allocator.ctx)->fallback_capsule);
}

py::object current_numpy_handler() {
  PyObject* handler = PyDataMem_GetHandler();
  if (handler == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(handler);
}

py::object swap_numpy_handler(py::handle handler) {
  handler_of(handler);  // a mem_handler capsule, or TypeError/ValueError
  PyObject* previous = PyDataMem_SetHandler(handler.ptr());
  if (previous == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(previous);
}

py::object born_owner(int64_t address) {
  auto it = blocks.find(static_cast<uintptr_t>(address));
  if (it == blocks.end()) return py::none();
  return py::reinterpret_borrow<py::object>(owner_of(it->second));
}

at::Tensor born_tensor(const void* data) {
  auto it = blocks.find(reinterpret_cast<uintptr_t>(data));
  if (it == blocks.end()) return at::Tensor();
  return py::handle(owner_of(it->second)).cast<at::Tensor>();
}

bool born_whole_segment(const void* data) {
  auto it = blocks.find(reinterpret_cast<uintptr_t>(data));
  return it != blocks.end() && it->second.slab == nullptr;
}

int64_t born_blocks() { return static_cast<int64_t>(blocks.size()); }

int64_t freeze_born_for_fork() {
  int64_t shared = 0;
  for (const auto& [address, block] : blocks) {
    if (block.slab != nullptr) continue;
    View* view = view_of(py::handle(block.owner).cast<at::Tensor>());
    if (view == nullptr) continue;
    Segment& segment = *view->segment;
    if (segment.may_be_written_by_others()) continue;  // shared on purpose
    if (!segment.freeze_data()) {
      segment.others_may_write();  // both sides write one mapping now
      ++shared;
    }
  }
  return shared;
}

}  // namespace torchshm
