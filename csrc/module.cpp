// The native module's bindings: what Python may call of the mechanism in the
// other files of csrc/. The wire's rebuilds are made in rebuild.cpp (named
// torchshm._reduction.<name>), the layout table in layout_table.cpp, the
// testing submodule in testing.cpp.
#define TORCHSHM_IMPORT_ARRAY
#include <algorithm>
#include <string>
#include <vector>

#include "base/config.h"
#include "base/cxx_runtime.h"
#include "base/errors.h"
#include "base/gil.h"
#include "base/ndarray.h"
#include "base/numpy_api.h"
#include "base/parallel.h"
#include "base/stats.h"
#include "base/torch_api.h"
#include "bindings.h"
#include "items/items.h"
#include "lifetime/fork_guard.h"
#include "lifetime/identity.h"
#include "lifetime/layout.h"
#include "lifetime/live.h"
#include "lifetime/pool.h"
#include "lifetime/segment.h"
#include "lifetime/slabs.h"
#include "lifetime/table.h"
#include "lifetime/views.h"
#include "send/allocator.h"
#include "send/message.h"
#include "send/one_copy.h"
#include "send/plan.h"
#include "send/rebuild.h"
#include "send/snapshots.h"
#include "send/tensors.h"

namespace {

using torchshm::checked_view;
using torchshm::Segment;
using torchshm::View;

PyObject* shm_error_type = nullptr;

}  // namespace

void torchshm::set_python_error(std::exception_ptr error) {
  try {
    std::rethrow_exception(error);
  } catch (py::error_already_set& e) {
    e.restore();
  } catch (const torchshm::ShmError& e) {
    py::object args = py::make_tuple(e.err(), e.what());
    PyErr_SetObject(shm_error_type, args.ptr());
  } catch (const py::builtin_exception& e) {
    e.set_error();
  } catch (const c10::TypeError& e) {
    PyErr_SetString(PyExc_TypeError, e.what_without_backtrace());
  } catch (const c10::ValueError& e) {
    PyErr_SetString(PyExc_ValueError, e.what_without_backtrace());
  } catch (const c10::IndexError& e) {
    PyErr_SetString(PyExc_IndexError, e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "torchshm: unknown C++ exception");
  }
}

PYBIND11_MODULE(_C, m) {
  if (_import_array() < 0) throw py::error_already_set();
  m.doc() = "torchshm's native mechanism: segments, holders, extents, copies.";
  m.attr("built_with_torch") = TORCHSHM_TORCH_VERSION;
  m.attr("built_with_numpy") = TORCHSHM_NUMPY_VERSION;
  m.attr("own_cxx_runtime") = torchshm::own_cxx_runtime();
  m.attr("LAYOUT") = torchshm::layout_table();

  // OSError(errno, message): Python decides by .errno which failures mean
  // "fall back to pickling".
  shm_error_type = PyErr_NewExceptionWithDoc(
      "torchshm._C.SharedMemoryError",
      "A shared-memory operation failed; .errno says why.", PyExc_OSError,
      nullptr);
  m.attr("SharedMemoryError") = py::handle(shm_error_type);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const torchshm::ShmError&) {
      torchshm::set_python_error(p);
    }
  });

  py::class_<torchshm::SessionTable, std::shared_ptr<torchshm::SessionTable>>(
      m, "SessionTable")
      .def_static("map", &torchshm::SessionTable::map, py::arg("fd"))
      .def_property_readonly("capacity", &torchshm::SessionTable::capacity)
      .def_property_readonly("fd_base", &torchshm::SessionTable::fd_base)
      .def("claim", &torchshm::SessionTable::claim, py::arg("uid"))
      .def("budget_set", &torchshm::SessionTable::budget_set, py::arg("holder"),
           py::arg("bytes"))
      .def("budget_total", &torchshm::SessionTable::budget_total);

  py::class_<Segment, std::shared_ptr<Segment>>(m, "Segment")
      .def_static("create", &Segment::create, py::arg("session"),
                  py::arg("table"), py::arg("capacity"), py::arg("creator"),
                  py::arg("threads") = 1, py::arg("populate") = true,
                  py::call_guard<torchshm::GilReleased>())
      .def_static("attach", &Segment::attach, py::arg("fd"), py::arg("session"),
                  py::arg("uid"), py::call_guard<torchshm::GilReleased>())
      .def_property_readonly("name", &Segment::name)
      .def_property_readonly("locator", &Segment::locator)
      .def_property_readonly("session", &Segment::session)
      .def_property_readonly("uid", &Segment::uid)
      .def_property_readonly("index", &Segment::index)
      .def_property_readonly("fd", &Segment::fd)
      .def_property_readonly("capacity", &Segment::capacity)
      // The shared mapping's data: what the GPU registration covers
      // (torchshm/_lifetime/pins.py).
      .def_property_readonly(
          "address",
          [](const Segment& segment) {
            return reinterpret_cast<uintptr_t>(segment.data());
          })
      .def_property_readonly("created_here", &Segment::created_here)
      .def("hold_for_device", &Segment::hold_for_device)
      .def("release_for_device", &Segment::release_for_device)
      .def_property_readonly("data_frozen", &Segment::data_frozen)
      .def_property("defers_releases", &Segment::defers_releases,
                    &Segment::defer_releases)
      .def_property_readonly("generation", &Segment::generation)
      .def_property_readonly("unlinked", &Segment::unlinked)
      .def_property_readonly("pinned", &Segment::pinned)
      .def_property_readonly("snapshot", &Segment::snapshot)
      .def_property_readonly("private_ready", &Segment::private_ready)
      .def("adopt_private", &Segment::adopt_private, py::arg("other"))
      .def_property_readonly("holders", &Segment::holders)
      .def_property_readonly("local_views", &Segment::local_views)
      .def_property_readonly("table", &Segment::table)
      .def("close_fd", &Segment::close_fd)
      .def("rebind", &Segment::rebind, py::arg("table"), py::arg("index"))
      .def("take_slot", &Segment::take_slot, py::arg("holder"))
      .def("release_slot", &Segment::release_slot, py::arg("slot"),
           py::arg("holder"))
      .def("issue_ticket", &Segment::issue_ticket, py::arg("channel") = 0,
           py::arg("writer") = 0)
      .def("claim_ticket", &Segment::claim_ticket, py::arg("ticket"),
           py::arg("holder"))
      .def("cancel_ticket", &Segment::cancel_ticket, py::arg("ticket"))
      .def("has_live_holder", &Segment::has_live_holder,
           py::arg("except_slot") = -1)
      .def("pin", &Segment::pin)
      .def("unlink", &Segment::unlink)
      .def(
          "tensor",
          [](std::shared_ptr<Segment> self, int slot, uint64_t holder) {
            return torchshm::view_tensor(std::move(self), slot, holder);
          },
          py::arg("slot"), py::arg("holder"),
          "An int8 tensor over the data; its view owns `slot` (-1: none).");
  m.def("segments_with_fd", &torchshm::segments_with_fd);
  m.def("begin_exit", &torchshm::begin_exit);
  m.def("live_messages", &torchshm::live_messages);
  m.def("open_creator_fds", &torchshm::open_creator_fds);
  m.def("born_blocks", &torchshm::born_blocks,
        "Born blocks alive in this process (Note [Born shared]).");
  m.def("one_copy_held", &torchshm::one_copy_held,
        "Arrays whose pages are their snapshot's (Note [One copy of a sent "
        "array]).");
  m.def("prune_in_flight", &torchshm::prune_in_flight);
  m.def("take_deferred_releases", [] {
    // (segment, slot, holder) of each release waiting for copies (Note
    // [Copies before reuse] in lifetime/views.h).
    std::vector<py::tuple> taken;
    for (auto& entry : torchshm::take_deferred_releases())
      taken.push_back(py::make_tuple(entry.segment, entry.slot, entry.holder));
    return taken;
  });
  m.def("forget_deferred_releases", &torchshm::forget_deferred_releases);
  // Note [Small blocks]: the sizes, for the tests and the benchmarks.
  m.attr("KEPT_FDS_FROM") = py::int_(torchshm::kKeptFdsFrom);
  m.attr("SLAB_BYTES") = py::int_(torchshm::Slabs::kSlabBytes);
  m.attr("SMALL_BLOCK_MAX") = py::int_(torchshm::Slabs::kMaxBlock);
  m.attr("RETIRED_SLABS_FLOOR") = py::int_(torchshm::Slabs::kRetiredFloor);
  m.attr("DECLINED_RETRY_SECONDS") = py::float_(torchshm::Slabs::kRetrySeconds);
  m.def(
      "slab_empty_since", [] { return torchshm::slabs().empty_since(); },
      "When the current slab went empty, or inf (Note [Small blocks]).");
  m.def(
      "has_current_slab", [] { return torchshm::slabs().has_current(); },
      "Whether small blocks are being carved from a slab.");
  m.def(
      "release_empty_slab",
      [](double older_than) {
        return torchshm::slabs().let_go_if_empty(older_than);
      },
      py::arg("older_than"),
      "Lets go of the current slab if empty that long; the bytes.");
  m.def("set_sharing", &torchshm::set_sharing, py::arg("on"),
        "Sharing mode for this thread (share()): returns the previous one.");
  m.def("forget_snapshots", [] { torchshm::snapshots().clear(); });
  m.def(
      "snapshots_remembered", [] { return torchshm::snapshots().size(); },
      "How many sent arrays' snapshots this process remembers (tests).");
  m.def(
      "message_owner",
      [](const at::Tensor& owner, int threads) {
        return torchshm::message_owner(py::cast(owner), threads);
      },
      py::arg("owner"), py::arg("threads"),
      "What a message's arrays over segment `owner` are rebuilt over.");
  m.def("in_flight_count", &torchshm::in_flight_count);
  m.def("wake_when_quiet", &torchshm::wake_when_quiet, py::arg("fd"));

  m.def(
      "segment_of",
      [](const at::Tensor& t) -> std::shared_ptr<Segment> {
        View* view = torchshm::view_of(t);
        return view ? view->segment : nullptr;
      },
      py::arg("tensor"));
  m.def(
      "disown",
      [](const at::Tensor& t) { checked_view(t).slot_owner().disown(); },
      py::arg("tensor"));
  m.def(
      "adopt",
      [](const at::Tensor& t, int slot, uint64_t holder) {
        checked_view(t).slot_owner().adopt(slot, holder);
      },
      py::arg("tensor"), py::arg("slot"), py::arg("holder"),
      "Makes a view own a slot taken for this process (a forked child's "
      "inherited view).");

  m.def("process_id", &torchshm::self_id);
  m.def("set_lock_session", &torchshm::set_lock_session, py::arg("session"));
  m.def("set_lock_dir", &torchshm::set_lock_dir, py::arg("path"));
  m.def("holder_alive", &torchshm::holder_alive, py::arg("holder"));
  m.def("prepare_child", &torchshm::prepare_child);
  m.def("after_fork_in_parent", [] {
    torchshm::after_fork_in_parent();
    torchshm::fork_done_in_parent();
  });
  m.def("prepared_fork", &torchshm::prepared_fork);
  m.def("freeze_born_for_fork", &torchshm::freeze_born_for_fork,
        "Note [A plain send is as it was] (send/plan.h): born segments "
        "frozen before a prepared fork; how many could not be.");
  m.def("sends_by_value", &torchshm::sends_by_value,
        "Whether a new message is pickled by value (Note [Messages at exit] "
        "in send/message.h).");
  m.def("forked_without_hooks", &torchshm::forked_without_hooks,
        "Whether this process descends from a fork torchshm did not prepare "
        "(Note [Forks torchshm did not prepare] in fork_guard.h).");
  m.def("after_fork_in_child", &torchshm::after_fork_in_child);
  m.def("remove_own_lock", &torchshm::remove_own_lock);

  // Note [Born shared] (allocator.h).
  m.def("make_born_handler", &torchshm::make_born_handler, py::arg("min_bytes"),
        py::arg("fallback"));
  m.def("born_fallback", &torchshm::born_fallback, py::arg("handler"));
  m.def("current_numpy_handler", &torchshm::current_numpy_handler);
  m.def("swap_numpy_handler", &torchshm::swap_numpy_handler,
        py::arg("handler"));

  // The sender's pool (pool.h, Note [Segment pool]).
  using torchshm::SegmentPool;
  py::class_<SegmentPool, std::shared_ptr<SegmentPool>>(m, "SegmentPool")
      .def(py::init([](int64_t min_class, int64_t steps, double max_waste) {
             TORCH_CHECK(min_class > 0 && steps > 0 && max_waste >= 1,
                         "invalid size classes");
             return std::make_shared<SegmentPool>(
                 torchshm::PoolClasses{min_class, steps, max_waste});
           }),
           py::arg("min_class"), py::arg("steps"), py::arg("max_waste"))
      .def("size_class", &SegmentPool::size_class, py::arg("nbytes"))
      .def(
          "take",
          [](SegmentPool& self, int64_t nbytes, bool thorough) -> py::object {
            at::Tensor owner = self.take(nbytes, thorough);
            return owner.defined() ? py::cast(owner) : py::none();
          },
          py::arg("nbytes"), py::arg("thorough"))
      .def("admit", &SegmentPool::admit, py::arg("segment"))
      .def("get", &SegmentPool::get, py::arg("name"))
      .def("release_idle", &SegmentPool::release_idle,
           py::arg("older_than") = 0.0)
      .def("oldest_quiet_use", &SegmentPool::oldest_quiet_use)
      .def("release_all", &SegmentPool::release_all)
      .def("forget", &SegmentPool::forget)
      .def("names", &SegmentPool::names)
      .def("__len__", &SegmentPool::size)
      .def_property_readonly("nbytes", &SegmentPool::nbytes)
      .def_readwrite("fast_until", &SegmentPool::fast_until);

  // Note [The seam] (torchshm/_native.py): everything, once. The policy's
  // fields and the hooks' names come from config.h's lists; Python gives
  // every one by name, and a missing or unknown one is an error.
  using torchshm::SenderPolicy;
  py::class_<SenderPolicy> policy(m, "SenderPolicy");
  std::vector<std::string> fields;
#define TORCHSHM_BIND(type, name, lowest)          \
  policy.def_readonly(#name, &SenderPolicy::name); \
  fields.push_back(#name);
  TORCHSHM_SENDER_POLICY(TORCHSHM_BIND)
#undef TORCHSHM_BIND
  policy.attr("FIELDS") = py::tuple(py::cast(fields));
  policy.def(py::init([fields](const py::kwargs& given) {
    for (const auto& [key, value] : given)
      TORCH_CHECK(std::find(fields.begin(), fields.end(),
                            py::cast<std::string>(key)) != fields.end(),
                  "unknown sender policy field ",
                  py::str(key).cast<std::string>());
    SenderPolicy p;
#define TORCHSHM_TAKE(type, name, lowest)                 \
  TORCH_CHECK(given.contains(#name),                      \
              "sender policy field " #name " not given"); \
  p.name = py::cast<type>(given[#name]);
    TORCHSHM_SENDER_POLICY(TORCHSHM_TAKE)
#undef TORCHSHM_TAKE
    return p;
  }));
  std::vector<std::string> hook_names;
#define TORCHSHM_NAME(name) hook_names.push_back(#name);
  TORCHSHM_HOOKS(TORCHSHM_NAME)
#undef TORCHSHM_NAME
  m.attr("HOOKS") = py::tuple(py::cast(hook_names));
  m.def(
      "configure",
      [hook_names](const SenderPolicy& policy, const py::dict& hooks,
                   py::tuple writers, int max_depth,
                   std::shared_ptr<SegmentPool> pool) {
        TORCH_CHECK(py::len(hooks) == hook_names.size(), "expected the hooks ",
                    py::str(py::cast(hook_names)).cast<std::string>(), ", got ",
                    py::str(hooks.attr("keys")()).cast<std::string>());
        torchshm::Hooks h{};
#define TORCHSHM_TAKE(name)                                       \
  TORCH_CHECK(hooks.contains(#name), "hook " #name " not given"); \
  h.name = py::handle(hooks[#name]).ptr();
        TORCHSHM_HOOKS(TORCHSHM_TAKE)
#undef TORCHSHM_TAKE
        h.writers = writers.ptr();
        h.max_depth = max_depth;
        h.pool = std::move(pool);
        torchshm::configure(torchshm::Config{policy, h});
      },
      py::kw_only(), py::arg("policy"), py::arg("hooks"), py::arg("writers"),
      py::arg("max_depth"), py::arg("pool"));
  m.def("set_threshold", &torchshm::set_threshold, py::arg("threshold"));

  // The sender (plan.h, Note [Sender plan]; message.h, Note [One message,
  // one snapshot]). A Message is never pickled: its SegmentRefs are.
  py::class_<torchshm::Message>(m, "Message");
  py::class_<torchshm::SegmentRef>(m, "SegmentRef")
      .def_readonly("owner", &torchshm::SegmentRef::owner)
      .def_readonly("name", &torchshm::SegmentRef::name)
      .def("__reduce__", &torchshm::SegmentRef::reduce);
  m.attr("reduce_ndarray") = torchshm::reduce_ndarray_function();
  for (const char* name :
       {"rebuild_ndarray", "rebuild_inline", "message_token"})
    m.attr(name) = torchshm::wire_function(name);
  m.def("memory_owner", &torchshm::memory_owner, py::arg("array"));
  m.def("resend_as", &torchshm::resend_as, py::arg("array"), py::arg("key"));
  m.def("shared_address", &torchshm::shared_address, py::arg("owner"),
        py::arg("address"), py::arg("nbytes"),
        py::call_guard<py::gil_scoped_release>());

  // Torch storages in segments (tensors.h, Note [Tensor storages]).
  m.def("move_storage", &torchshm::move_storage, py::arg("tensor"),
        py::arg("owner"), py::arg("threads"));
  m.def("snapshot_storage", &torchshm::snapshot_storage, py::arg("tensor"),
        py::arg("owner"), py::arg("threads"));
  m.def("storage_written", &torchshm::storage_written, py::arg("tensor"));
  m.def("segment_storage", &torchshm::segment_storage, py::arg("owner"),
        py::arg("nbytes"));
  m.def("message_ref", &torchshm::message_ref, py::arg("owner"));
  // Small storages (tensors.h, Note [Small storages]).
  m.def("carve_storage", &torchshm::carve_storage, py::arg("nbytes"),
        "A storage carved from a slab (an int8 tensor), or None.");
  m.def("move_storage_to_block", &torchshm::move_storage_to_block,
        py::arg("tensor"));
  m.def("block_of", &torchshm::block_of, py::arg("tensor"));
  m.def("in_torchshm_memory", &torchshm::in_torchshm_memory, py::arg("tensor"));
  m.def("block_storage", &torchshm::block_storage, py::arg("owner"),
        py::arg("offset"), py::arg("nbytes"));
  m.def("message_writing", &torchshm::message_writing, py::arg("pipe_inode"));
  m.def("message_written", &torchshm::message_written);
  m.def("message_not_written", &torchshm::message_not_written);
  m.def("forget_written_tickets", &torchshm::forget_written_tickets);
  m.def(
      "view_args",
      [](py::handle array, int64_t offset) {
        return torchshm::view_args(torchshm::as_ndarray(array), offset);
      },
      py::arg("array"), py::arg("offset"));

  // Note [Live views] (live.h): one table, written from both languages.
  using torchshm::LiveViews;
  py::class_<LiveViews>(m, "LiveViews")
      .def("get", &LiveViews::get, py::arg("name"))
      .def("remember", &LiveViews::remember, py::arg("name"), py::arg("owner"),
           py::arg("callback") = py::none())
      .def("forget_if_dead", &LiveViews::forget_if_dead, py::arg("name"))
      .def("owners", &LiveViews::owners)
      .def("prune", &LiveViews::prune)
      .def("clear", &LiveViews::clear)
      .def("__len__", &LiveViews::size);
  m.attr("live") =
      py::cast(&torchshm::live_views(), py::return_value_policy::reference);

  std::vector<std::string> names(
      torchshm::kCounterNames,
      torchshm::kCounterNames + torchshm::kCounterCount);
  m.attr("COUNTER_NAMES") = py::tuple(py::cast(names));
  m.def(
      "count",
      [](int index, int64_t n) {
        TORCH_CHECK(index >= 0 && index < torchshm::kCounterCount,
                    "expected a counter index below ",
                    int(torchshm::kCounterCount), ", got ", index);
        torchshm::count(static_cast<torchshm::Counter>(index), n);
      },
      py::arg("index"), py::arg("n") = 1);
  m.def("counters", [] {
    std::vector<int64_t> out;
    for (auto& c : torchshm::counters) out.push_back(c.load());
    return out;
  });
  m.def("reset_counters", [] {
    for (auto& c : torchshm::counters) c.store(0);
  });

  // Note [Threads at fork] (parallel.h). wait_threads_gone runs in a
  // before-fork hook with the GIL held, so no Python thread starts a copy
  // meanwhile.
  m.def("name_this_thread", &torchshm::name_this_thread, py::arg("name"));
  m.attr("EXPIRY_THREAD_NAME") = torchshm::kExpiryThreadName;
  m.def("wait_threads_gone", &torchshm::wait_threads_gone,
        py::arg("timeout_seconds") = 1.0);

  // SharedList and SharedDict items (items.h, Note [Item format]): plain
  // CPython types, so that shared[i] is one C call.
  if (torchshm::add_item_codec(m.ptr()) < 0) throw py::error_already_set();

  m.def("wrap_ndarray", &torchshm::wrap_ndarray, py::arg("owner"),
        py::arg("offset"), py::arg("dtype"), py::arg("shape"),
        py::arg("strides"), py::arg("writeable"));

  // For tests and benchmarks only (testing.cpp).
  torchshm::add_testing_module(m);
}
