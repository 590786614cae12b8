// One message's state on the sender, the references it writes, and the
// ForkingPickler reducer that uses them (Note [One message, one snapshot]).
#pragma once

#include <cstdint>
#include <string>
#include <unordered_map>

#include "base/torch_api.h"
#include "send/plan.h"

namespace torchshm {

// Note [One message, one snapshot]
// multiprocessing pickles each message with a fresh ForkingPickler, whose
// memo holds every object it pickled until the message is done. A reducer
// sees only the array, so the per-message state lives in a Message that only
// objects in that memo keep alive: the SegmentRefs it writes. The thread
// remembers it weakly (current_message). Its
// Plan (Note [Sender plan]) remembers which buffers this message copied and
// where, so within a message views of one buffer share one copy and one
// segment (aliasing survives), and the next message starts afresh (a later
// send snapshots the array again).
//
// The reducer (reduce_ndarray) decides by size, natively:
// - below min(threshold, pack_min): numpy's own reduce;
// - below the threshold: numpy's own reduce, counting the message's bytes of
//   such arrays (Note [Counting a message's small arrays] in message.cpp);
//   once they reach the threshold, the message's later arrays are shared
//   (1000 x 64 KiB then costs ~6x less than pickling);
// - from the threshold up: Plan::place, then (rebuild_ndarray, (SegmentRef,
//   view args...)); pickle calls the SegmentRef's native __reduce__, which
//   issues the message's ticket.
// Python is called at most once per array: for memory a torch tensor owns
// (the plan's kTorchOwned: the reduce_torch_owned hook), for object and
// empty arrays (reduce_other), and on a failure (fall_back), so that the
// reducer never raises. The wire's rebuild functions are native too, named as
// torchshm._reduction names them in every pickle (the wire format):
// rebuild.cpp.
//
// Tickets and the pipe (Note [Segment lifetime]). A ticket issued while a
// multiprocessing writer's frame is on this thread's stack (Connection.send,
// SimpleQueue.put, Queue's feeder: torchshm/_send/channel.py lists their code
// objects) is marked "being written" with this process as its writer, and
// remembered by the thread. Connection._send_bytes, which writes every such
// message in the thread that pickled it, then calls message_writing(pipe)
// before its first byte goes out (no receiver can hold the ticket yet, so
// naming the pipe in its slot races with nobody), and message_written()
// after the write returned, or message_not_written() if it raised. Nothing
// calls Python to find the pipe while pickling. A thread's messages are
// sequential, so a message that starts while tickets of its predecessor are
// still remembered cancels them: that message was never written (its
// pickling failed), and nobody can claim them.

// Note [Messages at exit]
// ~~~~~~~~~~~~~~~~~~~~~~~
// torch releases the GIL whenever a tensor's Python object dies
// (THPVariable_clear, inside a noexcept scope), so a thread other than the
// main one whose pickler drops a message's last reference to a segment's
// tensor once finalization has begun aborts the process as Note [The GIL at
// exit] describes, out of our reach (1 to 3 exits in 100 of
// tests/test_exit.py's daemon-thread sender, pip stack). So torchshm's exit
// hook (torchshm/_lifetime/lifecycle.py, _exit) calls begin_exit() before
// finalization, and waits, for a bounded time, for the messages that other
// threads have under way to be done (live_messages()). A message any
// thread starts after that is pickled by value (sends_by_value: no segment,
// no ticket, nothing for the exit to let go of): Python code still runs
// after the hook, an atexit handler that puts into a Queue and joins its
// feeder among it (multiprocessing runs its finalizers, ours included,
// before sys.exit runs atexit's handlers). Only once the interpreter is
// finalizing does a thread other than the main one sleep at a new message
// until the exit, GIL released (Python code can no longer run in it
// anyway). Queues' feeder threads are joined before the hook runs: what
// they send is sent.
void begin_exit();
int64_t live_messages();
// Whether a new array is pickled by value (see the Note; also in the child
// of a fork torchshm did not prepare: fork_guard.h).
bool sends_by_value();

// Counts a message made off the main thread while it lives (live_messages).
class OffMainThreadCount {
 public:
  OffMainThreadCount();
  ~OffMainThreadCount();
  OffMainThreadCount(const OffMainThreadCount&) = delete;
  OffMainThreadCount& operator=(const OffMainThreadCount&) = delete;

 private:
  const bool counted_;
};

class Message {
  // First, so destroyed last: after every tensor the message holds (its
  // plan's), whose dealloc releases the GIL.
  OffMainThreadCount alive_;

 public:
  Plan plan;

  // `self` is this Message's Python object, which the references it makes
  // keep alive.
  // (rebuild_ndarray, (SegmentRef, view args...)) for an array placed in a
  // segment (kSegment or kCopied).
  py::object reduce_shared(py::handle self, PyArrayObject* array,
                           const Placement& placed);
  // This message's reference to segment `name` (owner: a tensor over it).
  py::object ref(py::handle self, py::object owner, py::object name);

 private:
  // segment name -> weak ref to its SegmentRef: a strong one would make a
  // cycle that keeps the message alive past its pickler, and a later message
  // would reuse a stale snapshot.
  std::unordered_map<std::string, py::object> refs_;
};

// A segment named by one message. Its ticket is issued when the pickler
// writes it, so every byte string that names the segment has a ticket of its
// own, even when a nested dumps on this thread shares this object with an
// outer message.
struct SegmentRef {
  // Keeps the message alive while the memo holds this. First, so released
  // last: the message must be counted while `owner` dies (Note [Messages
  // at exit]).
  py::object message;
  py::object owner;  // a tensor over the segment
  py::object name;
  // (attach_segment, (locator, ticket, generation)).
  py::tuple reduce() const;
};

// The message this thread is pickling (a new one if none is alive).
py::object current_message();

// Around the write of the thread's last message (see the Note):
// message_writing names the pipe (its inode; 0: not a pipe) in the slots of
// its tickets and returns whether it has any; message_written clears their
// "being written" mark, message_not_written cancels them, and
// forget_written_tickets drops them without a word (a forked child: they are
// the parent's).
bool message_writing(uint64_t pipe_inode);
void message_written();
void message_not_written();
void forget_written_tickets();

// The ForkingPickler reducer (a plain C function, so that pickle's C
// implementation calls it with no Python frame in between).
py::object reduce_ndarray_function();

// rebuild_ndarray's arguments after the owner: (offset, dtype, shape,
// strides, writeable, subtype), with `first` in front when given. The one
// place that decides how a dtype travels (see the definition).
py::tuple view_args(PyArrayObject* array, int64_t offset,
                    const std::vector<npy_intp>& strides = {},
                    py::handle first = py::handle());

}  // namespace torchshm
