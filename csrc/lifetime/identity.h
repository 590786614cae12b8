// Who holds a segment, and whether that holder is still alive.
//
// Every process that holds torchshm memory has a random 63-bit id, fresh after
// fork, and a lock file <run dir>/torchshm-<id>.lock (the run dir: the user's
// own directory in /dev/shm, torchshm/_keeper/daemon.py) on which it
// holds an exclusive flock for its whole life (the file says its pid and
// session, for people and for the keeper). The kernel drops the lock when the
// process dies, however it dies, so any process that shares this /dev/shm (a
// container with --ipc=host, another network or PID namespace) can tell
// whether a holder lives: a lock it can take, or no regular file of this
// user under that name (missing, or something another user planted), means
// dead. Ids are never reused, so a stale id can never name a new process.
//
// A holder word in a segment's slot (segment.h) is either such a process id
// or a ticket (layout.h): a message in flight, judged by the session's
// keeper.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <string>

#include "lifetime/layout.h"

namespace torchshm {

// A random non-zero id below kTicketBit (or, with ticket=true, a ticket word).
uint64_t random_id(bool ticket = false);

// The run directory, set once before any other call here (later calls are
// ignored). Without one no lock can be made, and every holder looks dead.
void set_lock_dir(const std::string& path);
// <run dir>/torchshm-<16 hex digits>.lock
std::string lock_path(uint64_t id);

// This process's id; the first call creates and locks its lock file.
uint64_t self_id();

// The session this process belongs to, written into its lock file (and its
// forked children's) for the keeper (Note [Segment lifetime]).
void set_lock_session(const std::string& session);

// Whether a holder word names a live holder: tickets are alive (the keeper
// judges them), a process is alive while its lock is held. An alive answer
// stands for a few milliseconds (Note [Alive answers are remembered briefly]
// in identity.cpp): callers must treat "alive" as the answer that keeps
// memory. A lock file this process cannot open for want of fds or memory
// (EMFILE, ENFILE, ENOMEM, EINTR) tells nothing: "alive", not remembered (a
// process at its fd limit once judged every other holder dead, for good,
// and let its segments be reused under them). Thread-safe.
bool holder_alive(uint64_t holder);

// Fork support (Note [Fork] in torchshm/_lifetime/lifecycle.py). Before fork
// the parent creates the child's id and lock; the child inherits the locked
// descriptor, so the lock dies with the child whether it execs (the descriptor
// is close-on-exec) or not. After fork the parent closes its copy; the child
// adopts the id and closes the parent's lock descriptor.
uint64_t prepare_child();
void after_fork_in_parent();
void after_fork_in_child();

// getpid(), cached: it is asked on every view's birth and death, and glibc
// makes it a system call. A pthread_atfork handler refreshes it in every
// forked child (however the fork was made, as long as it ran through fork()).
pid_t current_pid();

// Removes this process's lock file (a clean exit, after every slot it held
// was released).
void remove_own_lock();

}  // namespace torchshm
