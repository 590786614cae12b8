// Whether this shared object carries a C++ runtime of its own. Header-only
// and free of torch, so that tests/test_config.py builds it into a small
// library with and without a static libstdc++.
#pragma once

#include <dlfcn.h>

#include <exception>

namespace torchshm {

// Note [One C++ runtime]
// torch's errors (c10::Error, thrown by TORCH_CHECK here) are caught by
// code of this module and of torch's alike. A module that carries a C++
// runtime of its own (libstdc++ linked statically, as a compiler wrapper
// may do: the GPU machines' /opt/gcc/bin/g++ does, under Ubuntu's Python,
// which links with -Bsymbolic-functions) crashed the process at the first
// error raised there (SIGSEGV, torch 2.11, Python 3.12); the system g++
// built a module that passed. A static build on the 2-core reference
// machine (Debian's GCC 12, pyenv's Python) raised that error cleanly: the
// hazard depends on the toolchain, and a crash is the worst way to find
// out. So the module says whether it carries its own runtime, and the
// import refuses it with the fix (_compat.check_native).
namespace cxx_runtime_detail {
// Code of this shared object's own: internal linkage, so no other object's
// copy can stand in for it (an inline variable is one per process).
[[maybe_unused]] static void anchor() {}
}  // namespace cxx_runtime_detail

// Whether std::terminate lies in the shared object that holds this code.
inline bool own_cxx_runtime() {
  Dl_info runtime{};
  Dl_info self{};
  if (::dladdr(reinterpret_cast<void*>(&std::terminate), &runtime) == 0 ||
      ::dladdr(reinterpret_cast<void*>(&cxx_runtime_detail::anchor), &self) ==
          0)
    return false;
  return runtime.dli_fbase == self.dli_fbase;
}

}  // namespace torchshm
