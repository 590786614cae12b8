// Releasing the GIL around native work, without aborting the process when
// the interpreter exits meanwhile.
#pragma once

#include <Python.h>
#include <cxxabi.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "python_compat.h"

namespace torchshm {

// Note [The GIL at exit]
// ~~~~~~~~~~~~~~~~~~~~~~
// Once the interpreter has begun to finalize, CPython 3.9-3.13 ends any
// other thread that comes back for the GIL with pthread_exit, which unwinds
// that thread's stack. In pybind11's gil_scoped_release the GIL is taken
// back in a destructor, which is noexcept: the unwinding stops there and
// std::terminate aborts the whole process as it exits ("terminate called
// without an active exception", exit status 134). A user's daemon thread
// pickling a large array while the main thread returned was enough: 10 aborts
// in 10 runs (tests/test_exit.py). So every GIL release in csrc/ is a
// GilReleased:
// - a thread that finds the interpreter finalizing never takes the GIL back:
//   it waits for the exit that is under way to end it, as CPython 3.14 does
//   with its own threads (Python code can no longer run in it anyway);
// - one that finalization catches while it waits for the GIL is unwound from
//   a destructor that lets the unwinding pass (noexcept(false)), up through
//   pybind11 and every catch-all of ours (each rethrows abi::__forced_unwind:
//   caught and not rethrown, it is a segfault) to the thread's start, as any
//   Python thread is.
// The main thread is the one that finalizes (its own GIL is never refused):
// it always takes the GIL back.
class GilReleased {
 public:
  GilReleased() : state_(PyEval_SaveThread()) {}
  ~GilReleased() noexcept(false) {
    if (interpreter_finalizing() && ::syscall(SYS_gettid) != ::getpid()) {
      for (;;) ::pause();  // the process's exit ends this thread
    }
    PyEval_RestoreThread(state_);
  }
  GilReleased(const GilReleased&) = delete;
  GilReleased& operator=(const GilReleased&) = delete;

 private:
  PyThreadState* state_;
};

}  // namespace torchshm
