// One message's state on the sender, the references it writes, and the
// ForkingPickler reducer that uses them (Note [One message, one snapshot]).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <unordered_map>

#include "plan.h"

namespace torchshm {

// Note [One message, one snapshot]
// multiprocessing pickles each message with a fresh ForkingPickler, whose
// memo holds every object it pickled until the message is done. A reducer
// sees only the array, so the per-message state lives in a Message that only
// the SegmentRefs (and the message token) in that memo keep alive; the
// thread remembers it weakly (current_message). Its Plan (Note [Sender
// plan]) remembers which buffers this message copied and where, so within a
// message views of one buffer share one copy and one segment (aliasing
// survives), and the next message starts afresh (a later send snapshots the
// array again).
//
// An array at or above the threshold never enters Python on its way: pickle
// calls the native reducer, which places it through the thread's message
// and returns (rebuild_ndarray, (SegmentRef, view args...)); pickle then
// calls the SegmentRef's native __reduce__, which issues the message's
// ticket. Python's policy reducer (torchshm/_sender.py) takes every other
// array, and every failure, so that the reducer never raises.
//
// A ticket whose message goes into a known pipe is marked "being written"
// (Note [Segment lifetime]) and remembered by the thread until the write
// returns: the writer's Connection._send_bytes then calls message_written()
// (torchshm/_channel.py), or message_not_written() when it raised. A thread's
// messages are sequential, so a message that starts while tickets of its
// predecessor are still remembered cancels them: that message was never
// written (its pickling failed), and nobody can claim them.

class Message {
 public:
  Plan plan;
  int64_t small_bytes = 0;  // below-threshold bytes pickled inline so far

  // `self` is this Message's Python object, which the references it makes
  // keep alive.
  // (rebuild_ndarray, (SegmentRef, view args...)) for an array this message
  // sends through shared memory, or None for memory a torch tensor owns that
  // torchshm did not make (unless `copy`: then it is copied too).
  py::object share(py::handle self, py::handle array, bool copy);
  // This message's reference to segment `name` (owner: a tensor over it).
  py::object ref(py::handle self, py::object owner, py::object name);
  // The object that keeps this message alive through inline arrays.
  py::object token(py::handle self);

 private:
  // segment name -> weak ref to its SegmentRef: a strong one would make a
  // cycle that keeps the message alive past its pickler, and a later message
  // would reuse a stale snapshot.
  std::unordered_map<std::string, py::object> refs_;
  py::object token_;  // weak ref to the message token, once there is one
};

// A segment named by one message. Its ticket is issued when the pickler
// writes it, so every byte string that names the segment has a ticket of its
// own, even when a nested dumps on this thread shares this object with an
// outer message.
struct SegmentRef {
  py::object owner;  // a tensor over the segment
  py::object name;
  py::object message;  // keeps the message alive while the memo holds this
  // (attach_segment, (name, ticket, generation)).
  py::tuple reduce() const;
};

// The message this thread is pickling (a new one if none is alive).
py::object current_message();

// The thread's message was written (see the Note): its tickets are no longer
// "being written". message_not_written cancels them; forget_written_tickets
// drops them without a word (a forked child: they are the parent's).
void message_written();
void message_not_written();
void forget_written_tickets();

// The inode of the pipe the message being pickled goes to, or 0: the
// frames above the pickler say which Connection writes it.
uint64_t current_channel();

// Python's side of the wire format and of the channel lookup.
void configure_wire(py::object rebuild_ndarray, py::object attach_segment,
                    py::object message_token);
// writers: {code object: finder(frame) -> Connection}; pipe_inode(finder,
// frame) -> inode or 0; max_depth: how many frames up to look.
void configure_channel(py::object writers, py::object pipe_inode,
                       int max_depth);

// The ForkingPickler reducer (a plain C function, so that pickle's C
// implementation calls it with no Python frame in between).
py::object fast_reducer();

}  // namespace torchshm
