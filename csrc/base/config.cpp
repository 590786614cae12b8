#include "base/config.h"

namespace torchshm {
namespace {

Config current;
std::atomic<bool> is_configured{false};
std::atomic<int64_t> calls{0};

}  // namespace

void configure(const Config& config) {
  TORCH_CHECK(!is_configured.load(),
              "torchshm's native side is configured once, at import");
  const SenderPolicy& p = config.policy;
#define TORCHSHM_CHECK_FIELD(type, name, lowest)                          \
  TORCH_CHECK(p.name >= (lowest), "invalid sender policy: " #name " is ", \
              p.name, ", expected at least ", (lowest));
  TORCHSHM_SENDER_POLICY(TORCHSHM_CHECK_FIELD)
#undef TORCHSHM_CHECK_FIELD
  TORCH_CHECK(p.chunk_max >= p.chunk_start, "invalid sender policy: chunk_max ",
              p.chunk_max, " is below chunk_start ", p.chunk_start);
  const Hooks& h = config.hooks;
  const std::pair<const char*, PyObject*> hooks[] = {
#define TORCHSHM_NAMED(name) {#name, h.name},
      TORCHSHM_HOOKS(TORCHSHM_NAMED)
#undef TORCHSHM_NAMED
  };
  for (const auto& [name, hook] : hooks)
    TORCH_CHECK(hook != nullptr && PyCallable_Check(hook),
                "expected a callable for hook ", name);
  TORCH_CHECK(h.writers != nullptr && PyTuple_Check(h.writers) &&
                  h.max_depth > 0 && h.pool != nullptr,
              "expected writer code objects, a frame depth and the pool");
  current = config;
  for (const auto& [name, hook] : hooks) Py_INCREF(hook);
  Py_INCREF(h.writers);
  is_configured.store(true);
}

void set_threshold(int64_t threshold) {
  TORCH_CHECK(threshold >= 0, "expected a threshold of at least 0, got ",
              threshold);
  config();  // configured
  current.policy.threshold = threshold;
}

bool configured() { return is_configured.load(); }

const Config& config() {
  TORCH_CHECK(is_configured.load(),
              "torchshm: the native side is not configured (import torchshm)");
  return current;
}

PyObject* call_hook(PyObject* hook, PyObject* arg) {
  calls.fetch_add(1, std::memory_order_relaxed);
  return PyObject_CallOneArg(hook, arg);
}

PyObject* call_hook(PyObject* hook, PyObject* arg1, PyObject* arg2) {
  calls.fetch_add(1, std::memory_order_relaxed);
  return PyObject_CallFunctionObjArgs(hook, arg1, arg2, nullptr);
}

PyObject* call_hook(PyObject* hook, PyObject* arg1, PyObject* arg2,
                    PyObject* arg3) {
  calls.fetch_add(1, std::memory_order_relaxed);
  return PyObject_CallFunctionObjArgs(hook, arg1, arg2, arg3, nullptr);
}

int64_t hook_calls() { return calls.load(); }
void reset_hook_calls() { calls.store(0); }

}  // namespace torchshm
