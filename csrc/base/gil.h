// Releasing the GIL around native work, without aborting the process when
// the interpreter exits meanwhile.
#pragma once

#include <Python.h>
#include <cxxabi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "base/python_compat.h"

namespace torchshm {

// Note [The GIL at exit]
// ~~~~~~~~~~~~~~~~~~~~~~
// Once the interpreter has begun to finalize, CPython 3.9-3.13 ends any
// other thread that comes back for the GIL with pthread_exit, which unwinds
// that thread's stack. Nothing on that stack may run then: the thread holds
// no GIL, yet the destructors it unwinds drop Python references (a segment's
// owning tensor: torch's dealloc then segfaulted, 3 exits in 40 on Python
// 3.13), and a noexcept one (pybind11's gil_scoped_release) aborts the whole
// process ("terminate called without an active exception"; a user's daemon
// thread pickling a large array while the main thread returned: 10 aborts in
// 10 runs, tests/test_exit.py). So every GIL release in csrc/ is a
// GilReleased, which never lets that unwinding start:
// - a thread that finds the interpreter finalizing never takes the GIL back;
// - one that finalization catches while it waits for the GIL catches the
//   forced unwind where it starts, in PyEval_RestoreThread, and stays there.
// Either way the thread sleeps until the exit under way ends the process,
// which is what CPython 3.14 does with its own threads (PyThread_hang_thread):
// Python code can no longer run in it anyway. The catch-alls in csrc/ still
// rethrow abi::__forced_unwind, for torch's own GIL releases (caught and not
// rethrown, a forced unwind is a segfault).
// The main thread is the one that finalizes (its own GIL is never refused):
// it always takes the GIL back.

// Whether this thread is the process's main thread, the one that finalizes.
inline bool on_main_thread() { return ::syscall(SYS_gettid) == ::getpid(); }

[[noreturn]] inline void sleep_until_exit() {
  for (;;) ::pause();  // the process's exit ends this thread
}

class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  ~GilReleased() {
    if (interpreter_finalizing() && !on_main_thread()) sleep_until_exit();
    try {
      PyEval_RestoreThread(state_);
    } catch (abi::__forced_unwind&) {
      sleep_until_exit();  // never rethrown: see the Note above
    }
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace torchshm
