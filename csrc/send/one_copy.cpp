// One copy of a sent array (Note [One copy of a sent array] in one_copy.h).
#include "send/one_copy.h"

#include <dlfcn.h>

#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "base/config.h"
#include "base/pages.h"
#include "base/stats.h"
#include "lifetime/fork_guard.h"
#include "lifetime/live.h"
#include "lifetime/views.h"
#include "send/allocator.h"
#include "send/array_watch.h"

namespace torchshm {
namespace {

// Arrays holding a snapshot at once; past it, copies as before (each costs
// a mapping and up to two more VMAs, against vm.max_map_count's 65530).
constexpr int64_t kMaxHeld = 4096;

// glibc's chunk header, just below the pointer malloc returned: the size
// word's IS_MMAPPED bit, and the leading gap an aligned chunk records.
constexpr size_t kIsMmapped = 0x2;
constexpr size_t kSizeBits = 0x7;

// Whether NumPy's default handler (malloc, calloc, free) made the array's
// data: directly, or as a born handler's fallback.
bool default_handler(PyArrayObject* array) {
  PyObject* capsule = PyArray_HANDLER(array);
  if (capsule == nullptr) return false;
  capsule = unwatched_handler(capsule);  // one sent before
  py::object fallback = born_fallback(capsule);
  if (!fallback.is_none()) capsule = fallback.ptr();
  auto* handler = static_cast<PyDataMem_Handler*>(
      PyCapsule_GetPointer(capsule, "mem_handler"));
  if (handler == nullptr) {
    PyErr_Clear();
    return false;
  }
  return std::strcmp(handler->name, "default_allocator") == 0;
}

// The end of the glibc mmap()ed chunk that `data` (a pointer malloc
// returned) starts, or 0 if it is not one. Such a chunk starts a mapping and
// its header fills the first two words: nothing is read outside the page.
int64_t mmapped_chunk_end(const void* data) {
  constexpr int64_t kHeader = 2 * sizeof(size_t);
  if (reinterpret_cast<int64_t>(data) % page_bytes() != kHeader) return 0;
  const auto* words = static_cast<const size_t*>(data);
  const size_t size = words[-1];
  if (!(size & kIsMmapped)) return 0;
  const size_t gap = words[-2];  // before the chunk, for an aligned one
  const int64_t chunk = reinterpret_cast<int64_t>(data) - 2 * sizeof(size_t);
  const int64_t start = chunk - static_cast<int64_t>(gap);
  const int64_t bytes = static_cast<int64_t>((size & ~kSizeBits) + gap);
  // A mapping is whole pages: anything else is not glibc's header.
  if (start % page_bytes() != 0 || bytes % page_bytes() != 0) return 0;
  return chunk + static_cast<int64_t>(size & ~kSizeBits);
}

// glibc's mallinfo2() (glibc 2.33 up), spelled here: every field a size_t.
struct MallocCounts {
  size_t arena, ordblks, smblks, hblks, hblkhd, usmblks, fsmblks, uordblks,
      fordblks, keepcost;
};

// Whether malloc is glibc's (not a preloaded jemalloc or tcmalloc): glibc's
// own count of the bytes in use (in its arenas and in its mmap()ed chunks)
// grows by a block that malloc() gives. Neither dlsym nor a block's header
// can tell: in a non-PIE executable (Debian's python3) malloc's address is
// the executable's canonical PLT entry, and a probe block may come from a
// free chunk of glibc's heap (after many frees, a block of any size may),
// without an mmap()ed chunk's header. mallinfo2 must be libc's own (tcmalloc
// defines one of its own); another thread's frees during the probe can only
// make it say no (then copies as before), so it is asked up to three times.
bool glibc_malloc() {
  static const bool yes = [] {
    void* symbol = ::dlsym(RTLD_DEFAULT, "mallinfo2");
    Dl_info where{};
    if (symbol == nullptr || ::dladdr(symbol, &where) == 0 ||
        where.dli_fname == nullptr ||
        std::strstr(where.dli_fname, "/libc.so") == nullptr)
      return false;
    auto* counts = reinterpret_cast<MallocCounts (*)()>(symbol);
    auto in_use = [&] {
      const MallocCounts c = counts();
      return c.uordblks + c.hblkhd;
    };
    constexpr size_t kProbe = 1 << 20;
    void* (*volatile allocate)(size_t) = std::malloc;  // not elided
    for (int tries = 0; tries < 3; ++tries) {
      const size_t before = in_use();
      void* p = allocate(kProbe);
      const size_t after = in_use();
      std::free(p);
      if (p != nullptr && after >= before + kProbe) return true;
    }
    return false;
  }();
  return yes;
}

struct Held {
  py::object weak;  // keeps the watch on the array, whose end lets go
  py::object view;  // the segment's first view: no reuse while held
  uint64_t forks;   // unprepared_forks() when it began
};

// By array; never destroyed (callbacks may run during shutdown). The GIL
// guards it: every entry point holds it.
std::unordered_map<PyObject*, Held>& held() {
  static auto* table = new std::unordered_map<PyObject*, Held>();
  return *table;
}

void let_go(Held& entry) {
  // A fork from C while it was held left a child mapping it, slotless.
  if (unprepared_forks() == entry.forks) return;
  if (View* view = view_of(unpack_tensor(entry.view))) view->segment->retire();
}

}  // namespace

int64_t one_copy_offset(py::handle root, PyArrayObject* nearest, int64_t src,
                        int64_t n) {
  const int64_t min = config().policy.one_copy_min;
  if (min <= 0 || n < min || root || PyArray_BASE(nearest) != nullptr ||
      !(PyArray_FLAGS(nearest) & NPY_ARRAY_OWNDATA))
    return -1;
  if (static_cast<int64_t>(held().size()) >= kMaxHeld &&
      held().count(reinterpret_cast<PyObject*>(nearest)) == 0)
    return -1;
  const void* data = PyArray_DATA(nearest);
  if (!glibc_malloc() || !default_handler(nearest)) return -1;
  const int64_t end = mmapped_chunk_end(data);
  const int64_t begin = reinterpret_cast<int64_t>(data);
  // The whole allocation, so that each adoption maps every whole page of
  // it and the previous snapshot holds none of them any more.
  // A chunk glibc mapped for this block alone: its header's size is the
  // request's, rounded up to a page (a larger one is not what it seems).
  if (end == 0 || src != begin || n < PyArray_NBYTES(nearest) ||
      src + n > end || end - (src + n) > page_bytes() + 16 ||
      pages_covered(src, src + n).bytes() == 0)
    return -1;
  return src % page_bytes();
}

void adopt_pages(PyArrayObject* nearest, const py::object& view,
                 const std::shared_ptr<Segment>& segment, int64_t at,
                 int64_t src, int64_t n) {
  const PageRange whole = pages_covered(src, src + n);
  if (segment == nullptr || whole.bytes() == 0) return;
  auto* key = reinterpret_cast<PyObject*>(nearest);
  auto& table = held();
  auto found = table.find(key);
  py::object weak;
  if (found == table.end()) {
    weak = forget_when_gone(key, [](PyObject* dead) {
      auto& entries = held();
      auto it = entries.find(dead);
      if (it == entries.end()) return;
      Held gone = std::move(it->second);
      entries.erase(it);
      let_go(gone);
    });
  }
  if (!segment->map_data_over(reinterpret_cast<void*>(whole.first),
                              at + (whole.first - src), whole.bytes()))
    return;
  count(kBytesOneCopy, whole.bytes());
  if (found != table.end()) {
    // Its pages left the earlier snapshot: let go of that one.
    Held previous = std::exchange(
        found->second, Held{found->second.weak, view, unprepared_forks()});
    let_go(previous);
    return;
  }
  table.emplace(key, Held{std::move(weak), view, unprepared_forks()});
}

bool pages_adopted(py::handle key, const Segment& segment) {
  auto found = held().find(key.ptr());
  if (found == held().end()) return false;
  View* view = view_of(unpack_tensor(found->second.view));
  return view != nullptr && view->segment.get() == &segment;
}

int64_t one_copy_held() { return static_cast<int64_t>(held().size()); }

}  // namespace torchshm
