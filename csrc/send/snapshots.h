// The sender's memory of the snapshots it made of large arrays, so that an
// unchanged array sent again costs a comparison, not a copy (Note [Resending
// an unchanged array]).
#pragma once

#include <cstdint>
#include <memory>
#include <unordered_map>

#include "base/torch_api.h"
#include "lifetime/segment.h"

namespace torchshm {

// Note [Resending an unchanged array]
// Each message snapshots the arrays it sends (Note [One message, one
// snapshot] in message.h): 4 tasks that take one 1 GiB model made 4 copies.
// For every copy (a segment of its own, or a place in the message's chunk:
// a model of many small layers is as common as one large one) the plan
// remembers here, per buffer (its root object, until it dies: Note [Knowing
// that a sent array is gone] in array_watch.h; an object that cannot be
// watched is not remembered), the bytes it copied and where:
// the segment (weakly), the offset and its generation. When a later message
// copies the same bytes of the same buffer, and that segment is still alive in
// this process with that generation, the array is compared with the snapshot
// (memcmp by up to copy_threads threads, at memory speed: cheaper than
// writing fresh pages); if equal, the message names the snapshot again. An
// array whose whole pages are the snapshot's own (Note [One copy of a sent
// array] in one_copy.h) is compared by its page table instead: equal if
// this process wrote none of them (written_pages: 4-5 ms per 512 MiB
// against ~50 ms of memcmp) and its partial first and last pages are.
// Equal bytes are exactly what a new copy would hold, and nothing writes a
// snapshot while its generation lasts (receivers map it privately: Note
// [Snapshots are mapped privately] in segment.h), so no receiver can tell.
// Nothing here keeps memory: once no message, receiver or pool holds the
// snapshot, it goes as before, and the next send copies. A chunk holds the
// copies of several arrays: a resend of one of them keeps the whole chunk,
// as any receiver of that message does. Cost for arrays that are never sent
// again (a DataLoader's fresh batches): a watch and a table entry per copy,
// dropped with the array. share() never
// reuses a snapshot (its copy must be shared memory). Two threads that copy
// the same array at the same time (two Queues' feeder threads) each make a
// copy: the entry is written once a copy is done; an executor's or a Pool's
// tasks are pickled by one thread, one after another.
class SnapshotCache {
 public:
  // An owner tensor over the remembered snapshot of buffer `key`'s bytes
  // [lo, hi) (absolute addresses) that still equals them, and its offset; or
  // an undefined tensor. `src` is lo's address.
  std::pair<py::object, int64_t> reuse(py::handle key, int64_t lo, int64_t hi,
                                       int threads);
  // Remembers that bytes [lo, hi) of `key`'s buffer were copied to `at` in
  // `segment` (a snapshot of its current generation).
  void remember(py::handle key, int64_t lo, int64_t hi,
                const std::shared_ptr<Segment>& segment, int64_t at);
  // Knows the memory of buffer `buffer` (a base chain's root) as `key`
  // while `buffer` lives: a buffer whose Python object is new at every
  // pickle (a pyarrow Buffer, torchshm/_send/arrow.py) is resent as an
  // unchanged ndarray is, its bytes compared.
  void known_as(py::handle buffer, py::object key);
  // The key `buffer`'s memory is known by: its known_as key, or itself.
  py::handle key_of(py::handle buffer) const;
  // Forgets everything (a forked child: the snapshots are the parent's).
  void clear() {
    entries_.clear();
    aliases_.clear();
  }
  size_t size() const { return entries_.size(); }

 private:
  struct Entry {
    py::object weak;  // keeps the key's watch, whose end erases the entry
    int64_t lo, hi, at;
    std::weak_ptr<Segment> segment;
    uint64_t generation;
  };
  std::unordered_map<PyObject*, Entry> entries_;  // under the GIL
  struct Alias {
    py::object watch;  // keeps the buffer's watch, whose end erases this
    py::object key;
  };
  std::unordered_map<PyObject*, Alias> aliases_;  // under the GIL
};

SnapshotCache& snapshots();

}  // namespace torchshm
