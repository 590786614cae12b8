// Bindings only: the mechanism lives in segment.cpp, table.cpp, identity.cpp,
// allocator.cpp, ndarray.cpp, pool.cpp, plan.cpp, message.cpp, parallel.cpp
// and stats.cpp.
#define TORCHSHM_IMPORT_ARRAY
#include <torch/extension.h>

#include "allocator.h"
#include "errors.h"
#include "identity.h"
#include "items.h"
#include "layout.h"
#include "message.h"
#include "ndarray.h"
#include "numpy_api.h"
#include "parallel.h"
#include "plan.h"
#include "pool.h"
#include "segment.h"
#include "stats.h"
#include "table.h"

namespace {

using torchshm::Segment;
using torchshm::View;

View& checked_view(const at::Tensor& tensor) {
  View* view = torchshm::view_of(tensor);
  TORCH_CHECK(view != nullptr, "expected a tensor over a torchshm segment");
  return *view;
}

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
  m.attr("HEADER_BYTES") = torchshm::kHeaderBytes;
  m.attr("SLOTS") = torchshm::kSlots;
  m.attr("TICKET_BIT") = torchshm::kTicketBit;
  {
    // Every constant of layout.h, for the keeper's copy and its test.
    using namespace torchshm;
    py::dict layout;
    layout["SEGMENT_MAGIC"] = kSegmentMagic;
    layout["SLOTS"] = kSlots;
    layout["SLOT_BYTES"] = sizeof(Slot);
    layout["SLOTS_OFFSET"] = offsetof(SegmentHeader, slots);
    layout["SLOT_CHANNEL"] = offsetof(Slot, channel);
    layout["SLOT_WRITER"] = offsetof(Slot, writer);
    layout["SLOT_VERDICT"] = offsetof(Slot, verdict);
    layout["CAPACITY_OFFSET"] = offsetof(SegmentHeader, capacity);
    layout["CREATOR_OFFSET"] = offsetof(SegmentHeader, creator);
    layout["UID_OFFSET"] = offsetof(SegmentHeader, uid);
    layout["GENERATION_OFFSET"] = offsetof(SegmentHeader, generation);
    layout["UNLINKED_OFFSET"] = offsetof(SegmentHeader, unlinked);
    layout["SLOTS_USED_OFFSET"] = offsetof(SegmentHeader, slots_used);
    layout["PINNED_OFFSET"] = offsetof(SegmentHeader, pinned);
    layout["HEADER_BYTES"] = kHeaderBytes;
    layout["TICKET_BIT"] = kTicketBit;
    layout["WRITING_BIT"] = kWritingBit;
    layout["TICKET_SLOT_SHIFT"] = kTicketSlotShift;
    layout["TICKET_SLOT_MASK"] = kTicketSlotMask;
    layout["TABLE_MAGIC"] = kTableMagic;
    layout["TABLE_CAPACITY_OFFSET"] = offsetof(TableHeader, capacity);
    layout["TABLE_FD_BASE_OFFSET"] = offsetof(TableHeader, fd_base);
    layout["TABLE_BUDGET_OFFSET"] = kTableBudgetOffset;
    layout["BUDGET_ENTRIES"] = kBudgetEntries;
    layout["BUDGET_ENTRY_BYTES"] = sizeof(BudgetEntry);
    layout["TABLE_UIDS_OFFSET"] = kTableUidsOffset;
    layout["FLAG_TICKETS"] = kFlagTickets;
    layout["FLAG_RELEASED"] = kFlagReleased;
    m.attr("LAYOUT") = layout;
  }

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
      .def("flag", &torchshm::SessionTable::flag, py::arg("index"),
           py::arg("bits"))
      .def("budget_set", &torchshm::SessionTable::budget_set, py::arg("holder"),
           py::arg("bytes"))
      .def("budget_total", &torchshm::SessionTable::budget_total);

  py::class_<Segment, std::shared_ptr<Segment>>(m, "Segment")
      .def_static("create", &Segment::create, py::arg("session"),
                  py::arg("table"), py::arg("capacity"), py::arg("creator"),
                  py::arg("threads") = 1,
                  py::call_guard<py::gil_scoped_release>())
      .def_static("attach", &Segment::attach, py::arg("fd"), py::arg("session"),
                  py::arg("uid"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("name", &Segment::name)
      .def_property_readonly("locator", &Segment::locator)
      .def_property_readonly("session", &Segment::session)
      .def_property_readonly("uid", &Segment::uid)
      .def_property_readonly("index", &Segment::index)
      .def_property_readonly("fd", &Segment::fd)
      .def_property_readonly("capacity", &Segment::capacity)
      .def_property_readonly("generation", &Segment::generation)
      .def_property_readonly("unlinked", &Segment::unlinked)
      .def_property_readonly("pinned", &Segment::pinned)
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
      .def("mark_written", &Segment::mark_written, py::arg("ticket"))
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
  m.def("open_creator_fds", &torchshm::open_creator_fds);
  m.def("wake_when_quiet", &torchshm::wake_when_quiet, py::arg("fd"));

  m.def(
      "segment_of",
      [](const at::Tensor& t) -> std::shared_ptr<Segment> {
        View* view = torchshm::view_of(t);
        return view ? view->segment : nullptr;
      },
      py::arg("tensor"));
  m.def(
      "disown", [](const at::Tensor& t) { checked_view(t).disown(); },
      py::arg("tensor"));
  m.def(
      "adopt",
      [](const at::Tensor& t, int slot, uint64_t holder) {
        checked_view(t).adopt(slot, holder);
      },
      py::arg("tensor"), py::arg("slot"), py::arg("holder"),
      "Makes a view own a slot taken for this process (a forked child's "
      "inherited view).");

  m.def("process_id", &torchshm::self_id);
  m.def("set_lock_session", &torchshm::set_lock_session, py::arg("session"));
  m.def("holder_alive", &torchshm::holder_alive, py::arg("holder"));
  m.def("lock_path", &torchshm::lock_path, py::arg("id"));
  m.def("prepare_child", &torchshm::prepare_child);
  m.def("after_fork_in_parent", &torchshm::after_fork_in_parent);
  m.def("after_fork_in_child", &torchshm::after_fork_in_child);
  m.def("remove_own_lock", &torchshm::remove_own_lock);

  // Note [Born shared] (allocator.h).
  m.def("set_born_source", &torchshm::set_born_source, py::arg("source"));
  m.def("make_born_handler", &torchshm::make_born_handler, py::arg("min_bytes"),
        py::arg("fallback"));
  m.def("born_fallback", &torchshm::born_fallback, py::arg("handler"));
  m.def("current_numpy_handler", &torchshm::current_numpy_handler);
  m.def("swap_numpy_handler", &torchshm::swap_numpy_handler,
        py::arg("handler"));
  m.def("born_owner", &torchshm::born_owner, py::arg("address"));
  m.def("born_blocks", &torchshm::born_blocks);

  m.def("byte_extent", &torchshm::byte_extent, py::arg("array"));
  m.def("data_address", &torchshm::data_address, py::arg("array"));
  m.def("copy_extent", &torchshm::copy_extent, py::arg("array"),
        py::arg("dest"), py::arg("dest_offset"), py::arg("threads") = 1);
  m.def(
      "receive_ndarray",
      [](const at::Tensor& owner, int64_t offset, py::handle dtype,
         const std::vector<int64_t>& shape, const std::vector<int64_t>& strides,
         bool writeable) {
        py::object array = torchshm::wrap_ndarray(owner, offset, dtype, shape,
                                                  strides, writeable);
        torchshm::count(torchshm::kArraysReceived);
        return array;
      },
      py::arg("owner"), py::arg("offset"), py::arg("dtype"), py::arg("shape"),
      py::arg("strides"), py::arg("writeable"),
      "wrap_ndarray for a received array: counted as arrays_received.");

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

  // The sender (plan.h, Note [Sender plan]; message.h, Note [One message,
  // one snapshot]).
  using torchshm::Message;
  py::class_<Message>(m, "Message")
      .def(py::init<>())
      .def(
          "place",
          [](Message& self, py::handle array, bool copy) {
            torchshm::Placement p = self.plan.place(array, copy);
            if (p.name.is_none())
              return py::make_tuple(p.owner, p.name, p.offset);
            return py::make_tuple(
                p.owner, p.name,
                torchshm::view_args(array, p.offset, p.strides));
          },
          py::arg("array"), py::arg("copy") = false)
      .def(
          "share",
          [](py::handle self, py::handle array, bool copy) {
            return self.cast<Message&>().share(self, array, copy);
          },
          py::arg("array"), py::arg("copy") = false)
      .def("token",
           [](py::handle self) { return self.cast<Message&>().token(self); })
      .def_readwrite("small_bytes", &Message::small_bytes);
  py::class_<torchshm::SegmentRef>(m, "SegmentRef")
      .def_readonly("owner", &torchshm::SegmentRef::owner)
      .def_readonly("name", &torchshm::SegmentRef::name)
      .def("__reduce__", &torchshm::SegmentRef::reduce);
  m.def("memory_owner", &torchshm::memory_owner, py::arg("array"));
  m.def("current_message", &torchshm::current_message);
  m.def("message_written", &torchshm::message_written);
  m.def("message_not_written", &torchshm::message_not_written);
  m.def("forget_written_tickets", &torchshm::forget_written_tickets);
  m.def(
      "view_args",
      [](py::handle array, int64_t offset) {
        TORCH_CHECK(PyArray_Check(array.ptr()), "expected a numpy.ndarray");
        return torchshm::view_args(array, offset);
      },
      py::arg("array"), py::arg("offset"));
  m.def(
      "configure_sender",
      [](py::object policy_reducer, py::object fall_back, py::object allocate,
         int64_t inline_below, int64_t threshold, int64_t sparse_ratio,
         int64_t pack_limit, int64_t chunk_start, int64_t chunk_max,
         int64_t alignment, int copy_threads) {
        TORCH_CHECK(threshold >= 0 && sparse_ratio >= 1 && pack_limit >= 0 &&
                        chunk_start > 0 && chunk_max >= chunk_start &&
                        alignment > 0 && copy_threads >= 1,
                    "invalid sender policy");
        torchshm::SenderPolicy p;
        p.inline_below = inline_below;
        p.threshold = threshold;
        p.sparse_ratio = sparse_ratio;
        p.pack_limit = pack_limit;
        p.chunk_start = chunk_start;
        p.chunk_max = chunk_max;
        p.alignment = alignment;
        p.copy_threads = copy_threads;
        torchshm::configure_sender(std::move(policy_reducer),
                                   std::move(fall_back), std::move(allocate),
                                   p);
      },
      py::arg("policy_reducer"), py::arg("fall_back"), py::arg("allocate"),
      py::arg("inline_below"), py::arg("threshold"), py::arg("sparse_ratio"),
      py::arg("pack_limit"), py::arg("chunk_start"), py::arg("chunk_max"),
      py::arg("alignment"), py::arg("copy_threads"));
  m.def("configure_sender_pool", &torchshm::configure_sender_pool,
        py::arg("pool"), py::arg("live"));
  m.def("configure_wire", &torchshm::configure_wire, py::arg("rebuild_ndarray"),
        py::arg("attach_segment"), py::arg("message_token"));
  m.def("configure_channel", &torchshm::configure_channel, py::arg("writers"),
        py::arg("pipe_inode"), py::arg("max_depth"));
  m.attr("reduce_ndarray") = torchshm::fast_reducer();

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
}
